"""What a client connection keeps and loses when a shard process dies (docs/architecture.md).

As RabbitMQ does when a queue process crashes, the connection stays open:

- publishes waiting for a confirm that may have gone to the dead shard are nacked (the channel's
  whole unconfirmed window when its connection ever published to that shard: a nack means "may
  or may not be stored", which is true of all of them);
- a tx.commit waiting for that shard fails with 406 "partial tx completion" (RabbitMQ's answer to
  a commit that was not fully stored), the channel closes, the connection stays;
- consumers of the dead shard's queues are cancelled with basic.cancel when the client announced
  the consumer_cancel_notify capability (silently otherwise) and can consume again at once: the
  restarted shard recovers the queue;
- delivery tags of messages the dead shard had delivered stay valid for the client, but acking or
  nacking them does nothing: the restarted shard has those messages ready again (redelivered);
- requests waiting on the shard (basic.get, queue.declare counts, purge, consume) are sent again
  to the new incarnation by the frontend worker.

Connections with nothing on that shard see nothing at all.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from pamqp import commands as C

from frontend.amqp.channel import OPEN

if TYPE_CHECKING:
    from frontend.amqp.channel import Channel

DEAD_SHARD = -1  # shard of a delivery tag whose message the dead shard had: acks of it go nowhere


class LosingConnection(Protocol):
    """What it uses of the connection (frontend/amqp/connection.py AMQPConnection)."""

    channels: dict[int, Channel]
    confirm_shards: set[int]  # shards this connection published to with confirms

    @property
    def cancel_notify(self) -> bool: ...

    def confirm_dirty(self, channel: Channel) -> None: ...


def connection_lost_shard(conn: LosingConnection, shard: int) -> None:
    """Settle everything `conn` had in flight on `shard`, which died (its new incarnation is starting)."""
    published_there = shard in conn.confirm_shards
    for ch in list(conn.channels.values()):
        if ch.state != OPEN:
            continue
        confirm = ch.confirm
        if confirm is not None and published_there and confirm.unconfirmed:
            confirm.fail_all()
            conn.confirm_dirty(ch)
        if ch.tx_commit is not None and ch.tx_commit.unconfirmed and published_there:
            ch.tx_commit.fail_all()
            ch.commit_settled()
            if ch.state != OPEN:
                continue
        _forget_deliveries(ch, shard)
        for tag, consumer in list(ch.consumers.items()):
            if consumer.shard != shard or not consumer.answered:
                continue  # a consume still waiting is sent again to the new incarnation
            del ch.consumers[tag]
            if conn.cancel_notify:
                ch.conn.send_method(ch.number, C.Basic.Cancel(consumer_tag=tag, nowait=True))


def _forget_deliveries(ch: Any, shard: int) -> None:
    unacked = ch.tags.unacked
    for tag, ref in unacked.items():
        if ref[0] == shard:
            unacked[tag] = (DEAD_SHARD, 0, 0)
    if ch.held:
        ch.held = type(ch.held)(entry for entry in ch.held if entry[0] != shard)
    for consumer in ch.consumers.values():
        if consumer.early:
            consumer.early = [entry for entry in consumer.early if entry[0] != shard]
