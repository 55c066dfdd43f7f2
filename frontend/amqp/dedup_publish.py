"""Publishes to a deduplicating exchange (``x-message-deduplication`` on an exchange).

A node has several frontends and a publisher that retries after a reconnect may land on
another one, so the cache cannot live here: every publish to such an exchange goes, as
one ``DEDUP_PUBLISH``, to the exchange's owner shard (``broker.dedup.exchange_shard``),
which drops duplicates and forwards the rest to the shards of the routed queues
(shard/dedup.py). The frontend routes as usual and waits for one confirm, the owner's.
Messages without the header take the same way, so a channel's publishes to the exchange
stay in order with each other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from broker import contract
from broker.amqp.properties import delivery_mode
from broker.dedup import dedup_key, exchange_shard

if TYPE_CHECKING:
    from frontend.confirms import ConfirmTracker
    from frontend.worker import FrontendWorker

_DEDUP_PUBLISH = contract.DEDUP_PUBLISH


class DedupConnection(Protocol):
    """What a publish to a deduplicating exchange uses of the connection (frontend/amqp/connection.py)."""

    worker: FrontendWorker
    conn_id: int
    vhost: str
    confirm_shards: set[int]


class DedupChannel(Protocol):
    """What it uses of the channel (frontend/amqp/channel.py Channel)."""

    conn: DedupConnection
    key: int  # the channel's number for the shards
    confirm: ConfirmTracker | None


def publish_dedup(channel: DedupChannel, ex: Any, exchange: str, routing_key: str, props_raw: bytes, body: bytes,
                  queues: list[str] | tuple[str, ...], mandatory: bool = False) -> None:
    """Hand a publish to the exchange's owner shard (queues may be empty: it remembers the key)."""
    conn = channel.conn
    worker = conn.worker
    defs = worker.defs
    vhost = conn.vhost
    groups: dict[int, list[str]] = {}
    for name in queues:
        groups.setdefault(defs.queue(vhost, name).shard, []).append(name)
    key, ttl = dedup_key(props_raw, ex.dedup)
    owner = exchange_shard(vhost, exchange, worker.shard_count)
    confirm = channel.confirm
    if confirm is None:
        conn_id = number = seq = None
    else:
        seq = confirm.publish(1)  # one answer: the owner's, after every shard it forwarded to
        conn_id, number = conn.conn_id, channel.key
        conn.confirm_shards.add(owner)
    worker.shard_put(owner, [_DEDUP_PUBLISH, vhost, exchange, routing_key, props_raw, body,
                             delivery_mode(props_raw) == 2, conn_id, number, seq, key, ttl,
                             [[shard, names] for shard, names in groups.items()],
                             [conn.conn_id, channel.key] if mandatory and groups else None])
