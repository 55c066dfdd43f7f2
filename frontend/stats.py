"""The frontend's periodic STATS report (broker/contract.py): its connections, channels, consumers.

Built from what the connections already hold, once per stats_interval: nothing is counted per
message for it except bytes per socket read/write.

Reports are deltas, as a shard's: a connection's row (with its consumers) goes to the node when it
opened or something in it moved since the last report (bytes, channels, consumers, blocked), and a
closed connection goes as its id. 10,000 idle connections cost the node nothing per interval; they
used to cost it 2.6 KiB each, the last two full reports of every frontend held for rates. The first
report after the frontend starts, and the one after the node asks (QUERY "stats_full": a seq gap),
carries every connection with "full": true.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from broker.heap_trim import HeapTrimmer
    from frontend.session import Session


class StatsFrontend(Protocol):
    """What the report reads of the frontend (frontend/worker.py FrontendWorker)."""

    conns: dict[int, Session]
    counters: dict[str, int]
    n_received: int
    n_received_confirm: int
    n_confirmed: int
    n_unroutable_returned: int
    n_unroutable_dropped: int
    heap_trimmer: HeapTrimmer


def _peer(peer: Any) -> tuple[str, int]:
    if isinstance(peer, tuple) and len(peer) >= 2:
        return str(peer[0]), int(peer[1])
    return "", 0


def _send_pend(transport: Any) -> int:
    """Bytes written to the connection and not yet taken by its socket (RabbitMQ's send_pend)."""
    try:
        return int(transport.get_write_buffer_size())
    except (AttributeError, RuntimeError, TypeError):
        return 0


def _counters(worker: StatsFrontend) -> dict:
    counters = dict(worker.counters)
    counters["publishers"] = sum(1 for conn in worker.conns.values() if getattr(conn, "publisher", False))
    counters.update(received=worker.n_received, received_confirm=worker.n_received_confirm,
                    confirmed=worker.n_confirmed, unroutable_returned=worker.n_unroutable_returned,
                    unroutable_dropped=worker.n_unroutable_dropped, heap_trims=worker.heap_trimmer.trims)
    return counters


class StatsReporter:
    """Builds the frontend's STATS payloads as deltas (see the module docstring)."""

    __slots__ = ("sent", "seq", "full_next", "rows_sent")

    def __init__(self) -> None:
        # conn_id -> hash of what the node holds of it (its moving parts), as of our last report: an
        # int per connection rather than a copy of its row.
        self.sent: dict[int, int] = {}
        self.seq = 0
        self.full_next = True
        self.rows_sent = 0  # connection rows sent since the frontend started (tests and metrics count them)

    def report(self, worker: StatsFrontend) -> dict:
        full = self.full_next
        sent = self.sent
        now: dict[int, int] = {}
        connections = []
        consumers = []
        for conn in worker.conns.values():
            if not getattr(conn, "user", None) or conn.transport is None:
                continue  # still in the handshake (or gone): not a connection yet for the API
            channels = []
            conn_consumers = []
            conn_id = conn.conn_id
            for number, ch in getattr(conn, "channels", {}).items():
                confirm = ch.confirm
                channels.append((number, ch.prefetch_count, ch.global_prefetch, len(ch.consumers),
                                 len(ch.tags), confirm.unconfirmed if confirm is not None else 0,
                                 confirm is not None, ch.tx is not None))
                for tag, c in ch.consumers.items():
                    conn_consumers.append((conn_id, number, tag, c.queue, c.no_ack, ch.prefetch_count))
            recv, send = getattr(conn, "recv_oct", 0), getattr(conn, "send_oct", 0)
            blocked = bool(getattr(conn, "_read_pause", ()))
            send_pend = _send_pend(conn.transport)
            sig = hash((recv, send, blocked, send_pend, tuple(channels), tuple(conn_consumers)))
            now[conn_id] = sig
            if not full and sent.get(conn_id) == sig:
                continue
            host, port = _peer(conn.peer)
            connections.append([conn_id, host, port, conn.user, conn.vhost,
                                getattr(conn, "client_properties", {}), getattr(conn, "connected_at", 0),
                                recv, send, blocked, channels, send_pend])
            consumers.extend(conn_consumers)
        if full:
            closed: list = []
        else:
            # New connections are among the rows sent, so this counts closes without a scan of `sent`.
            n_new = sum(1 for row in connections if row[0] not in sent)
            closed = [cid for cid in sent if cid not in now] if len(sent) + n_new > len(now) else []
        self.sent = now
        self.full_next = False
        self.seq += 1
        self.rows_sent += len(connections)
        return {"seq": self.seq, "full": full, "connections": connections, "consumers": consumers,
                "closed": closed, "rows_sent": self.rows_sent, "counters": _counters(worker)}
