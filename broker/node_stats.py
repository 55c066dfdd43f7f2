"""The node's view of its workers' periodic STATS (broker/contract.py): queue counts, connections.

Each worker's latest report replaces its previous one, so what the API shows is at most one
stats_interval old. Lookups are built lazily, once per new report, so listing 100,000 queues
does not rebuild anything per request.
"""

from __future__ import annotations

import time
from typing import Any

# Positions in a shard's queue rows and a frontend's connection rows (contract.STATS).
Q_VHOST, Q_NAME, Q_READY, Q_UNACKED, Q_CONSUMERS, Q_BYTES = range(6)
C_ID, C_HOST, C_PORT, C_USER, C_VHOST, C_PROPS, C_AT, C_RECV, C_SEND, C_BLOCKED, C_CHANNELS = range(11)


class NodeStats:
    def __init__(self) -> None:
        self.shards: dict[int, dict] = {}
        self.frontends: dict[int, dict] = {}
        self.received_at: dict[tuple[str, int], float] = {}
        self._queues: dict[tuple[str, str], list] | None = None

    def update(self, role: str, index: int, payload: Any) -> None:
        if not isinstance(payload, dict):
            return
        (self.shards if role == "shard" else self.frontends)[index] = payload
        self.received_at[(role, index)] = time.time()
        if role == "shard":
            self._queues = None

    def forget(self, role: str, index: int) -> None:
        (self.shards if role == "shard" else self.frontends).pop(index, None)
        if role == "shard":
            self._queues = None

    def queues(self) -> dict[tuple[str, str], list]:
        """(vhost, name) -> [vhost, name, ready, unacked, consumers, ready_bytes]."""
        if self._queues is None:
            self._queues = {(row[Q_VHOST], row[Q_NAME]): row
                            for payload in self.shards.values() for row in payload.get("queues", ())}
        return self._queues

    def connections(self) -> list[tuple[int, list]]:
        """(frontend index, connection row) for every open connection."""
        return [(fe, row) for fe, payload in sorted(self.frontends.items())
                for row in payload.get("connections", ())]

    def consumers(self) -> list[tuple[int, list]]:
        return [(fe, row) for fe, payload in sorted(self.frontends.items())
                for row in payload.get("consumers", ())]
