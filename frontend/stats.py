"""The frontend's periodic STATS report (broker/contract.py): its connections, channels, consumers.

Built from what the connections already hold, once per stats_interval: nothing is counted per
message for it except bytes per socket read/write.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from frontend.worker import FrontendWorker


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


def frontend_stats(worker: FrontendWorker) -> dict:
    connections = []
    consumers = []
    for conn in worker.conns.values():
        if not getattr(conn, "user", None) or conn.transport is None:
            continue  # still in the handshake (or gone): not a connection yet for the API
        channels = []
        for number, ch in getattr(conn, "channels", {}).items():
            confirm = ch.confirm
            channels.append([number, ch.prefetch_count, ch.global_prefetch, len(ch.consumers),
                             len(ch.tags), confirm.unconfirmed if confirm is not None else 0,
                             confirm is not None, ch.tx is not None])
            for tag, c in ch.consumers.items():
                consumers.append([conn.conn_id, number, tag, c.queue, c.no_ack, ch.prefetch_count])
        host, port = _peer(conn.peer)
        connections.append([conn.conn_id, host, port, conn.user, conn.vhost,
                            getattr(conn, "client_properties", {}), getattr(conn, "connected_at", 0),
                            getattr(conn, "recv_oct", 0), getattr(conn, "send_oct", 0),
                            bool(getattr(conn, "_read_pause", ())), channels, _send_pend(conn.transport)])
    counters = dict(worker.counters)
    counters["publishers"] = sum(1 for conn in worker.conns.values() if getattr(conn, "publisher", False))
    counters.update(received=worker.n_received, received_confirm=worker.n_received_confirm,
                    confirmed=worker.n_confirmed, unroutable_returned=worker.n_unroutable_returned,
                    unroutable_dropped=worker.n_unroutable_dropped)
    return {"connections": connections, "consumers": consumers, "counters": counters}
