"""The node's view of its workers' periodic STATS (broker/contract.py): queue counts, connections.

Each worker's latest report replaces its previous one, so what the API shows is at most one
stats_interval old. Lookups are built lazily, once per new report, so listing 100,000 queues
does not rebuild anything per request.
"""

from __future__ import annotations

import time
from typing import Any

# Positions in a shard's queue rows and a frontend's connection rows (contract.STATS).
Q_VHOST, Q_NAME, Q_READY, Q_UNACKED, Q_CONSUMERS, Q_BYTES, Q_PUBLISHED, Q_DELIVERED, Q_ACKED = range(9)
COUNTERS = ((Q_PUBLISHED, "publish"), (Q_DELIVERED, "deliver_get"), (Q_ACKED, "ack"))
C_ID, C_HOST, C_PORT, C_USER, C_VHOST, C_PROPS, C_AT, C_RECV, C_SEND, C_BLOCKED, C_CHANNELS = range(11)


class NodeStats:
    def __init__(self) -> None:
        self.shards: dict[int, dict] = {}
        # The report before the latest one per shard, and when both arrived: rates are their difference.
        self.previous: dict[int, tuple[float, dict]] = {}
        self._prev_rows: dict[tuple[str, str], tuple[float, float, list]] | None = None
        self.frontends: dict[int, dict] = {}
        self.received_at: dict[tuple[str, int], float] = {}
        self._queues: dict[tuple[str, str], list] | None = None

    def update(self, role: str, index: int, payload: Any) -> None:
        if not isinstance(payload, dict):
            return
        now = time.time()
        if role == "shard":
            if index in self.shards:
                self.previous[index] = (self.received_at[(role, index)], self.shards[index])
            self._queues = None
            self._prev_rows = None
        (self.shards if role == "shard" else self.frontends)[index] = payload
        self.received_at[(role, index)] = now

    def forget(self, role: str, index: int) -> None:
        (self.shards if role == "shard" else self.frontends).pop(index, None)
        if role == "shard":
            self.previous.pop(index, None)
            self._queues = None
            self._prev_rows = None

    def queues(self) -> dict[tuple[str, str], list]:
        """(vhost, name) -> [vhost, name, ready, unacked, consumers, ready_bytes]."""
        if self._queues is None:
            self._queues = {(row[Q_VHOST], row[Q_NAME]): row
                            for payload in self.shards.values() for row in payload.get("queues", ())}
        return self._queues

    def _previous_rows(self) -> dict[tuple[str, str], tuple[float, float, list]]:
        """(vhost, name) -> (previous report time, latest report time, previous row)."""
        if self._prev_rows is None:
            rows = {}
            for index, (at, payload) in self.previous.items():
                latest = self.received_at.get(("shard", index), at)
                for row in payload.get("queues", ()):
                    rows[(row[Q_VHOST], row[Q_NAME])] = (at, latest, row)
            self._prev_rows = rows
        return self._prev_rows

    def message_stats(self, row: list | None) -> dict:
        """RabbitMQ's message_stats of one queue: totals and a rate per second over the last interval."""
        if row is None or len(row) <= Q_ACKED:
            return {}
        prev = self._previous_rows().get((row[Q_VHOST], row[Q_NAME]))
        out: dict = {}
        for i, key in COUNTERS:
            rate = 0.0
            if prev is not None and prev[1] > prev[0] and len(prev[2]) > i:
                rate = max(0.0, (row[i] - prev[2][i]) / (prev[1] - prev[0]))  # < 0: the shard restarted
            out[key] = row[i]
            out[key + "_details"] = {"rate": round(rate, 1)}
        return out

    def totals(self, keys: set[tuple[str, str]] | None = None) -> dict:
        """message_stats summed over every queue (from the shards' own sums: O(shards)), or over the
        given queues (O(queues), for a user who sees only some vhosts)."""
        out: dict = {}
        if keys is None:
            for j, (_, key) in enumerate(COUNTERS):
                total = 0
                rate = 0.0
                for index, payload in self.shards.items():
                    cur = payload.get("totals")
                    if not cur:
                        continue
                    total += cur[j]
                    prev_at, prev = self.previous.get(index, (0.0, {}))
                    latest = self.received_at.get(("shard", index), prev_at)
                    before = prev.get("totals")
                    if before and latest > prev_at and cur[j] >= before[j]:
                        rate += (cur[j] - before[j]) / (latest - prev_at)
                out[key] = total
                out[key + "_details"] = {"rate": round(rate, 1)}
            return out
        prev_rows = self._previous_rows()
        for i, key in COUNTERS:
            total = 0
            rate = 0.0
            for k, row in self.queues().items():
                if len(row) <= i or (keys is not None and k not in keys):
                    continue
                total += row[i]
                prev = prev_rows.get(k)
                if prev is not None and prev[1] > prev[0] and len(prev[2]) > i and row[i] >= prev[2][i]:
                    rate += (row[i] - prev[2][i]) / (prev[1] - prev[0])
            out[key] = total
            out[key + "_details"] = {"rate": round(rate, 1)}
        return out

    def damaged(self) -> dict[tuple[str, str], tuple[int, int]]:
        """(vhost, name) -> (damaged records, damaged ack entries) of the queues whose shard found
        storage damage since it opened them; queues without damage are absent."""
        return {(row[0], row[1]): (int(row[2]), int(row[3]))
                for payload in self.shards.values() for row in payload.get("damaged", ())
                if isinstance(row, list | tuple) and len(row) >= 4}

    def connections(self) -> list[tuple[int, list]]:
        """(frontend index, connection row) for every open connection."""
        return [(fe, row) for fe, payload in sorted(self.frontends.items())
                for row in payload.get("connections", ())]

    def consumers(self) -> list[tuple[int, list]]:
        return [(fe, row) for fe, payload in sorted(self.frontends.items())
                for row in payload.get("consumers", ())]
