"""Events produced by FrameParser.feed. Plain NamedTuples: cheap to build, easy to compare in tests.

props_raw is the content header's payload after body-size (property flags + property list)
exactly as the peer sent it, so it can be stored and re-sent without re-encoding.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class ProtocolHeaderReceived(NamedTuple):
    pass


class BadProtocolHeader(NamedTuple):
    data: bytes  # the 8 bytes received; the server answers with its header and closes


class MethodFrame(NamedTuple):
    channel: int
    method: Any  # a pamqp.commands object


class Publish(NamedTuple):
    channel: int
    exchange: str
    routing_key: str
    mandatory: bool
    immediate: bool
    props_raw: bytes
    body: bytes


class PublishRun(NamedTuple):
    """Consecutive Publish events of one channel that differ only in their bodies (same exchange,
    routing key, flags and props_raw bytes), from a parser built with publish_runs=True. It stands
    for ``Publish(channel, exchange, routing_key, mandatory, immediate, props_raw, body)`` for each
    body, in order; it always holds at least two."""

    channel: int
    exchange: str
    routing_key: str
    mandatory: bool
    immediate: bool
    props_raw: bytes
    bodies: list


class Deliver(NamedTuple):
    channel: int
    consumer_tag: str
    delivery_tag: int
    redelivered: bool
    exchange: str
    routing_key: str
    props_raw: bytes
    body: bytes


class ContentMethod(NamedTuple):
    """basic.get-ok / basic.return with their assembled content."""

    channel: int
    method: Any
    props_raw: bytes
    body: bytes


class Ack(NamedTuple):
    channel: int
    delivery_tag: int
    multiple: bool


class Nack(NamedTuple):
    channel: int
    delivery_tag: int
    multiple: bool
    requeue: bool


class Reject(NamedTuple):
    channel: int
    delivery_tag: int
    requeue: bool


class Heartbeat(NamedTuple):
    channel: int


class ChannelProtocolError(NamedTuple):
    channel: int
    code: int
    text: str
    class_id: int
    method_id: int


class ConnectionProtocolError(NamedTuple):
    """Always the last event: the parser ignores all input after it."""

    code: int
    text: str
    class_id: int
    method_id: int
