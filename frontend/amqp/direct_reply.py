"""Direct reply-to (``amq.rabbitmq.reply-to``), RabbitMQ's queue-less RPC replies.

A channel consuming from the pseudo-queue ``amq.rabbitmq.reply-to`` (no-ack
only) gets a private name ``amq.rabbitmq.reply-to.<frontend>.<conn>.<channel>.<secret>``;
its publishes with ``reply_to=amq.rabbitmq.reply-to`` carry that name instead.
A publish to the default exchange with such a routing key is delivered
straight to that channel: on this frontend directly, on another frontend
through the node (contract FORWARD/FORWARDED, one hop; this is a low-rate RPC
pattern). Nothing is stored: a reply to a consumer that is gone is dropped,
as RabbitMQ does.
"""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING

from broker import contract
from broker.amqp.encoder import encode_deliver

if TYPE_CHECKING:
    from frontend.worker import FrontendWorker

PSEUDO_QUEUE = "amq.rabbitmq.reply-to"
PREFIX = PSEUDO_QUEUE + "."


def new_reply_name(frontend: int, conn_id: int, channel: int) -> str:
    return f"{PREFIX}{frontend}.{conn_id}.{channel}.{secrets.token_urlsafe(12)}"


def parse_reply_name(name: str) -> tuple[int, int, int] | None:
    """(frontend, conn_id, channel) of a reply name, None when it is not one."""
    parts = name[len(PREFIX):].split(".", 3) if name.startswith(PREFIX) else []
    if len(parts) != 4:
        return None
    try:
        return int(parts[0]), int(parts[1]), int(parts[2])
    except ValueError:
        return None


def route_reply(worker: FrontendWorker, routing_key: str, exchange: str, props_raw: bytes, body: bytes) -> None:
    """Send a reply to the channel its name designates, wherever it is (dropped if unknown)."""
    where = parse_reply_name(routing_key)
    if where is None:
        return
    if where[0] == worker.index:
        deliver_reply(worker, routing_key, exchange, props_raw, body)
    else:
        worker.node.put(None, [contract.FORWARD, where[0], ["reply", routing_key, exchange, props_raw, body]])


def deliver_reply(worker: FrontendWorker, routing_key: str, exchange: str, props_raw: bytes, body: bytes) -> None:
    where = parse_reply_name(routing_key)
    if where is None:
        return
    conn = worker.conns.get(where[1])
    ch = conn.channels.get(where[2]) if conn is not None else None
    if ch is None or ch.reply_consumer is None or ch.reply_consumer[1] != routing_key:
        return
    conn.write(encode_deliver(ch.number, ch.reply_consumer[0], ch.tags.skip(), False, exchange, routing_key,
                              props_raw, body, conn.frame_max))
