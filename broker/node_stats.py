"""The node's view of its workers' periodic STATS (broker/contract.py): queue counts, connections.

Each worker's latest report replaces its previous one, so what the API shows is at most one
stats_interval old. A shard reports only the queue rows that changed since its last report (and
the queues removed), merged here into one table in O(changed rows): 100,000 idle queues cost the
node's event loop nothing per interval, and listing them rebuilds nothing per request.
"""

from __future__ import annotations

import time
from typing import Any

from broker.interning import Interner

# Positions in a shard's queue rows and a frontend's connection rows (contract.STATS).
Q_VHOST, Q_NAME, Q_READY, Q_UNACKED, Q_CONSUMERS, Q_BYTES, Q_PUBLISHED, Q_DELIVERED, Q_ACKED = range(9)
# Then (shards of this version on; older rows stop at Q_ACKED): parts of Q_DELIVERED and redeliveries.
Q_DELIVER_NO_ACK, Q_GET, Q_GET_NO_ACK, Q_REDELIVERED = range(9, 13)
C_ID, C_HOST, C_PORT, C_USER, C_VHOST, C_PROPS, C_AT, C_RECV, C_SEND, C_BLOCKED, C_CHANNELS, C_SEND_PEND = range(12)
# RabbitMQ's message_stats keys of a queue, in the order counts() returns them.
KEYS = ("publish", "deliver_get", "ack", "deliver", "deliver_no_ack", "get", "get_no_ack", "redeliver")


def counts(c: list | tuple) -> tuple[int, ...] | None:
    """A row's (or a shard's totals') counters as KEYS' values; None when it has none.

    c: [published, delivered, acked] or [published, delivered, acked, deliver_no_ack, get,
    get_no_ack, redelivered]; "deliver" (consumers with manual ack) is what remains of delivered.
    """
    if len(c) < 3:
        return None
    published, delivered, acked = c[0], c[1], c[2]
    if len(c) < 7:
        return (published, delivered, acked, delivered, 0, 0, 0, 0)
    no_ack, get, get_no_ack, redelivered = c[3], c[4], c[5], c[6]
    return (published, delivered, acked, delivered - no_ack - get - get_no_ack, no_ack, get, get_no_ack,
            redelivered)


# message_stats keys RabbitMQ counts at the publishing channel, and the frontend counter of each.
FRONTEND_KEYS = (("publish", "received"), ("confirm", "confirmed"), ("return_unroutable", "unroutable_returned"),
                 ("drop_unroutable", "unroutable_dropped"))


def _stats(cur: tuple, before: tuple | None, seconds: float) -> dict:
    out: dict = {}
    for i, key in enumerate(KEYS):
        rate = 0.0
        if before is not None and seconds > 0 and cur[i] >= before[i]:  # < : the shard restarted
            rate = (cur[i] - before[i]) / seconds
        out[key] = cur[i]
        out[key + "_details"] = {"rate": round(rate, 1)}
    return out


def add_stats(into: dict, more: dict) -> dict:
    """Sum two message_stats dicts (totals and rates)."""
    for key in KEYS:
        if key in more:
            into[key] = into.get(key, 0) + more[key]
            rate = into.get(key + "_details", {"rate": 0.0})["rate"] + more[key + "_details"]["rate"]
            into[key + "_details"] = {"rate": round(rate, 1)}
    return into


class NodeStats:
    def __init__(self) -> None:
        # Each worker's latest payload (a shard's "queues" there is only its latest delta).
        self.shards: dict[int, dict] = {}
        # The report before the latest one per shard, and when both arrived: rates are their difference.
        self.previous: dict[int, tuple[float, dict]] = {}
        # Per shard: its queue rows as merged from full snapshots and deltas; and, for the rows its
        # latest report changed, the row before (rates; an unchanged row's rate is 0).
        self.rows: dict[int, dict[tuple[str, str], list]] = {}
        self.changed_prev: dict[int, dict[tuple[str, str], list]] = {}
        self.seq: dict[int, int] = {}  # the latest report's seq per shard: a gap asks for a full snapshot
        self.rows_received: dict[int, int] = {}  # queue rows received per shard since it (re)started
        # Each frontend's latest payload without its rows (counters, seq), and its connection rows and
        # consumer rows per connection as merged from full reports and deltas (frontend/stats.py).
        self.frontends: dict[int, dict] = {}
        self.previous_fe: dict[int, tuple[float, dict]] = {}  # as `previous`, for the frontends
        self.fe_conns: dict[int, dict[int, list]] = {}
        self.fe_consumers: dict[int, dict[int, list]] = {}
        self.fe_seq: dict[int, int] = {}
        # Per frontend: conn_id -> (recv_oct, send_oct) bytes per second over the latest interval, for
        # the connections its latest report carried (a row not sent did not move: rate 0).
        self.fe_rates: dict[int, dict[int, tuple[float, float]]] = {}
        self._props = Interner()  # connections' client properties: one copy per distinct table
        self.received_at: dict[tuple[str, int], float] = {}
        self._queues: dict[tuple[str, str], list] = {}  # every shard's rows, merged
        # Per shard, the report whose parts came and whose last part has not ("more", shard/stats.py):
        # its seq, the rows before its parts changed them, and a full report's rows so far (else None).
        self._parts: dict[int, tuple[Any, dict, dict | None]] = {}

    def update(self, role: str, index: int, payload: Any) -> bool:
        """Take a worker's report; True when a shard's deltas do not follow on from what we hold
        (the caller asks that shard for a full snapshot, QUERY "stats_full")."""
        if not isinstance(payload, dict):
            return False
        now = time.time()
        need_full = False
        if role == "shard":
            if payload.get("more"):
                # A part of a report the shard reads over several loop turns: its rows now, the
                # report (totals, rates, seq) with its last part.
                self._merge_part(index, payload)
                return False
            if index in self.shards:
                self.previous[index] = (self.received_at[(role, index)], self.shards[index])
            need_full = self._merge(index, payload)
            self.shards[index] = payload
        else:
            if index in self.frontends:
                self.previous_fe[index] = (self.received_at[(role, index)], self.frontends[index])
            prev_at = self.received_at.get((role, index))
            need_full = self._merge_frontend(index, payload, now - prev_at if prev_at is not None else 0.0)
            self.frontends[index] = {k: v for k, v in payload.items()
                                     if k not in ("connections", "consumers", "closed")}
        self.received_at[(role, index)] = now
        return need_full

    def _merge_part(self, index: int, payload: dict) -> None:
        """Apply a part of a shard's report (``"more"``: more parts of the same seq follow): a delta's
        rows and removals go into the tables now; a full report's rows are gathered until its last
        part, which drops every row none of its parts carried."""
        seq = payload.get("seq")
        part = self._parts.get(index)
        if part is None or part[0] != seq:  # the report's first part (or a restarted shard's)
            part = self._parts[index] = (seq, {}, {} if payload.get("full") else None)
        before, fresh = part[1], part[2]
        table = self.rows.setdefault(index, {})
        merged = self._queues
        n = 0
        for row in payload.get("queues", ()):
            key = (row[Q_VHOST], row[Q_NAME])
            old = table.get(key)
            if old is not None and key not in before and old != row:
                before[key] = old
            if fresh is not None:
                fresh[key] = row
            else:
                table[key] = row
            merged[key] = row
            n += 1
        if fresh is None:
            for key in payload.get("removed", ()):
                key = (key[0], key[1])
                table.pop(key, None)
                merged.pop(key, None)
        self.rows_received[index] = self.rows_received.get(index, 0) + n

    def _merge(self, index: int, payload: dict) -> bool:
        """Apply a shard's rows: O(rows in the report), so idle queues cost nothing here."""
        merged = self._queues
        table = self.rows.setdefault(index, {})
        before: dict[tuple[str, str], list] = {}
        seq = payload.get("seq")
        full = bool(payload.get("full", True)) or seq is None  # no seq: an older shard, always full
        last = self.seq.get(index)
        part = self._parts.pop(index, None)
        if part is not None and part[0] != seq:
            part = None  # parts of a report whose last part never came (the shard restarted)
        if part is not None:
            before = part[1]
        if full:
            fresh = part[2] if part is not None and part[2] is not None else {}
            for row in payload.get("queues", ()):
                key = (row[Q_VHOST], row[Q_NAME])
                fresh[key] = row
                old = table.get(key)
                if old is not None and old != row:
                    before[key] = old
            for key in table.keys() - fresh.keys():
                merged.pop(key, None)
            merged.update(fresh)
            self.rows[index] = fresh
            self.rows_received[index] = self.rows_received.get(index, 0) + len(payload.get("queues", ()))
        else:
            n = 0
            for row in payload.get("queues", ()):
                key = (row[Q_VHOST], row[Q_NAME])
                old = table.get(key)
                if old is not None and key not in before:
                    before[key] = old
                table[key] = row
                merged[key] = row
                n += 1
            for key in payload.get("removed", ()):
                key = (key[0], key[1])
                table.pop(key, None)
                merged.pop(key, None)
            self.rows_received[index] = self.rows_received.get(index, 0) + n
        self.changed_prev[index] = before
        if seq is not None:
            self.seq[index] = int(seq)
        return not full and (last is None or int(seq) != last + 1)

    def _merge_frontend(self, index: int, payload: dict, seconds: float) -> bool:
        """Apply a frontend's connection rows: O(rows in the report), so idle connections cost nothing.
        ``seconds`` since the frontend's previous report: byte rates of the rows that changed."""
        old_conns = self.fe_conns.get(index, {})
        rates: dict[int, tuple[float, float]] = {}
        if seconds > 0:
            for row in payload.get("connections", ()):
                old = old_conns.get(row[C_ID])
                # Bytes of an unchanged row did not move: all of a changed row's moved since the last report.
                if old is not None and row[C_RECV] >= old[C_RECV] and row[C_SEND] >= old[C_SEND]:
                    rates[row[C_ID]] = (round((row[C_RECV] - old[C_RECV]) / seconds, 1),
                                        round((row[C_SEND] - old[C_SEND]) / seconds, 1))
        self.fe_rates[index] = rates
        seq = payload.get("seq")
        full = bool(payload.get("full", True)) or seq is None  # no seq: an older frontend, always full
        last = self.fe_seq.get(index)
        by_conn: dict[int, list] = {}
        for row in payload.get("consumers", ()):
            by_conn.setdefault(row[0], []).append(row)
        intern = self._props
        if full:
            conns = self.fe_conns[index] = {}
            for row in payload.get("connections", ()):
                row[C_PROPS] = intern(row[C_PROPS])
                conns[row[C_ID]] = row
            self.fe_consumers[index] = by_conn
        else:
            conns = self.fe_conns.setdefault(index, {})
            consumers = self.fe_consumers.setdefault(index, {})
            for conn_id in payload.get("closed", ()):
                conns.pop(conn_id, None)
                consumers.pop(conn_id, None)
            for row in payload.get("connections", ()):
                conn_id = row[C_ID]
                row[C_PROPS] = intern(row[C_PROPS])
                conns[conn_id] = row
                # A changed connection comes with all its consumers: none listed, none left.
                mine = by_conn.get(conn_id)
                if mine:
                    consumers[conn_id] = mine
                else:
                    consumers.pop(conn_id, None)
        if seq is not None:
            self.fe_seq[index] = int(seq)
        return not full and (last is None or int(seq) != last + 1)

    def forget(self, role: str, index: int) -> None:
        (self.shards if role == "shard" else self.frontends).pop(index, None)
        if role != "shard":
            self.previous_fe.pop(index, None)
            self.fe_conns.pop(index, None)
            self.fe_consumers.pop(index, None)
            self.fe_seq.pop(index, None)
            self.fe_rates.pop(index, None)
        if role == "shard":
            self.previous.pop(index, None)
            self._parts.pop(index, None)
            for key in self.rows.pop(index, {}):
                self._queues.pop(key, None)
            self.changed_prev.pop(index, None)
            self.seq.pop(index, None)
            self.rows_received.pop(index, None)

    def queues(self) -> dict[tuple[str, str], list]:
        """(vhost, name) -> [vhost, name, ready, unacked, consumers, ready_bytes, ...] (read only)."""
        return self._queues

    def message_stats(self, row: list | None) -> dict:
        """RabbitMQ's message_stats of one queue: totals and a rate per second over the last interval."""
        if row is None:
            return {}
        cur = counts(row[Q_PUBLISHED:])
        if cur is None:
            return {}
        key = (row[Q_VHOST], row[Q_NAME])
        for index, changed in self.changed_prev.items():  # O(shards)
            prev = changed.get(key)
            if prev is not None:
                at = self.previous.get(index, (0.0, None))[0]
                latest = self.received_at.get(("shard", index), at)
                if latest > at > 0:
                    return _stats(cur, counts(prev[Q_PUBLISHED:]), latest - at)
                break
        return _stats(cur, None, 0.0)

    def totals(self, keys: set[tuple[str, str]] | None = None) -> dict:
        """message_stats summed over every queue (from the shards' own sums: O(shards)), or over the
        given queues (O(queues), for a user who sees only some vhosts)."""
        out: dict = {}
        if keys is None:
            for index, payload in self.shards.items():
                cur = counts(payload.get("totals") or ())
                if cur is None:
                    continue
                prev_at, prev = self.previous.get(index, (0.0, {}))
                latest = self.received_at.get(("shard", index), prev_at)
                add_stats(out, _stats(cur, counts(prev.get("totals") or ()), latest - prev_at))
        else:
            queues = self.queues()
            for k in keys:
                row = queues.get(k)
                if row is not None:
                    add_stats(out, self.message_stats(row))
        if not out:
            out = _stats((0,) * len(KEYS), None, 0.0)
        return out

    def frontend_counter(self, key: str) -> int:
        """A counter summed over the frontends' STATS (totals since each frontend started)."""
        return sum(p.get("counters", {}).get(key, 0) for p in self.frontends.values())

    def frontend_stats(self) -> dict:
        """The publisher side of message_stats (RabbitMQ's channel-level figures), from the frontends'
        counters: publish (received), confirm, return_unroutable, drop_unroutable, with rates."""
        out: dict = {}
        for key, counter in FRONTEND_KEYS:
            total = 0
            rate = 0.0
            for index, payload in self.frontends.items():
                cur = payload.get("counters", {}).get(counter, 0)
                total += cur
                prev_at, prev = self.previous_fe.get(index, (0.0, {}))
                before = prev.get("counters", {}).get(counter) if prev else None
                latest = self.received_at.get(("frontend", index), prev_at)
                if before is not None and latest > prev_at and cur >= before:
                    rate += (cur - before) / (latest - prev_at)
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
        return [(fe, row) for fe, conns in sorted(self.fe_conns.items()) for row in conns.values()]

    def connection_rates(self, index: int, conn_id: int) -> tuple[float, float]:
        """(recv_oct, send_oct) bytes per second of one connection over its frontend's latest interval."""
        return self.fe_rates.get(index, {}).get(conn_id, (0.0, 0.0))

    def frontend_connections(self, index: int) -> list[list]:
        """One frontend's connection rows."""
        return list(self.fe_conns.get(index, {}).values())

    def consumers(self) -> list[tuple[int, list]]:
        return [(fe, row) for fe, by_conn in sorted(self.fe_consumers.items())
                for rows in by_conn.values() for row in rows]
