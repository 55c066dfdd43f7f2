"""Frame encoders. Control methods go through pamqp; the per-message frames are packed by hand.

Hot frames are built with one b"".join over precompiled struct packs; the frame-end octet of one
frame and the header of the next are packed together (byte layout: docs/codec.md). Equality with
pamqp.frame.marshal, byte for byte, is proven by tests/test_codec.py.
"""

from __future__ import annotations

import struct
from typing import Any

from pamqp import commands
from pamqp import frame as pamqp_frame

from broker.amqp import (
    pamqp_names,  # noqa: F401  (replies echo any UTF-8 name, as RabbitMQ's do)
    pamqp_types,  # noqa: F401  (pamqp's amqp_type without a string per call)
)
from broker.amqp.constants import DEFAULT_FRAME_MAX, PROTOCOL_HEADER

# method frame header (type, channel, size, class, method) + first shortstr length
_DELIVER_HEAD = struct.Struct(">BHIHHB")
_TAG_BIT_LEN = struct.Struct(">QBB")  # delivery-tag, redelivered, exchange length
_PUBLISH_HEAD = struct.Struct(">BHIHHHB")  # ... ticket, exchange length
_BITS_END_HEADER = struct.Struct(">BBBHIHHQ")  # bits, frame-end, type 2, channel, size, class, weight, body size
_END_HEADER = struct.Struct(">BBHIHHQ")  # frame-end, type 2, channel, size, class, weight, body size
_END_BODY = struct.Struct(">BBHI")  # frame-end, type 3, channel, size
_ACK = struct.Struct(">BHIHHQBB")  # 13-byte payload: class, method, tag, bits; frame-end
_EMPTY_METHOD = struct.Struct(">BHIIB")  # a method frame without arguments: header, class+method, frame-end
_COUNT_METHOD = struct.Struct(">BHIIIB")  # one long argument (message-count): header, class+method, count, end
# Methods whose only argument is a message count (long): queue.delete-ok, queue.purge-ok. A pipelined
# delete's reply through pamqp (slot loop, type lookup, validation, marshal) was ~8 % of the pair's
# loop CPU per queue.delete (docs/benchmarks.md "CPU per delete").
_ONE_COUNT = frozenset((commands.Queue.DeleteOk, commands.Queue.PurgeOk))

_LEN1 = [bytes((i,)) for i in range(256)]
_END = b"\xce"
_HEARTBEAT = b"\x08\x00\x00\x00\x00\x00\x00\xce"


def encode_protocol_header() -> bytes:
    return PROTOCOL_HEADER


def encode_heartbeat() -> bytes:
    return _HEARTBEAT


def encode_method(channel: int, method: Any) -> bytes:
    """Any method frame via pamqp (which validates the method's fields); one without arguments
    (queue.bind-ok, unbind-ok, ...: nothing to validate), and queue.delete-ok / purge-ok with a
    count in range, are packed at once."""
    if not method.__slots__:
        return _EMPTY_METHOD.pack(1, channel, 4, method.index, 0xCE)
    if method.__class__ in _ONE_COUNT:
        count = method.message_count
        if count.__class__ is int and 0 <= count <= 0xFFFFFFFF:  # else pamqp's own error, as before
            return _COUNT_METHOD.pack(1, channel, 8, method.index, count, 0xCE)
    return pamqp_frame.marshal(method, channel)


def _body_tail(channel: int, body: bytes, frame_max: int) -> list:
    """Everything after the properties: content header's frame-end, body frames, final frame-end."""
    size = len(body)
    if not size:
        return [_END]
    limit = frame_max - 8 if frame_max else size
    if size <= limit:
        return [_END_BODY.pack(0xCE, 3, channel, size), body, _END]
    if limit <= 0:
        raise ValueError(f"frame_max {frame_max} leaves no room for a body")
    view = memoryview(body)
    parts = []
    for start in range(0, size, limit):
        chunk = view[start : start + limit]
        parts.append(_END_BODY.pack(0xCE, 3, channel, len(chunk)))
        parts.append(chunk)
    parts.append(_END)
    return parts


def encode_deliver(
    channel: int,
    consumer_tag: str | bytes,
    delivery_tag: int,
    redelivered: bool,
    exchange: str | bytes,
    routing_key: str | bytes,
    props_raw: bytes,
    body: bytes,
    frame_max: int = DEFAULT_FRAME_MAX,
) -> bytes:
    """basic.deliver + content header + body frames (none for an empty body).

    Names may be given already encoded (bytes), which saves the encode per message."""
    ct = consumer_tag if consumer_tag.__class__ is bytes else consumer_tag.encode()
    ex = exchange if exchange.__class__ is bytes else exchange.encode()
    rk = routing_key if routing_key.__class__ is bytes else routing_key.encode()
    size = len(body)
    try:
        # The common case (one body frame) is one join of a literal tuple; sharing the header parts
        # with the split path below through a helper measured 0.92 -> 1.86 us per deliver.
        if size and (size <= frame_max - 8 or not frame_max):  # the common case: one body frame
            return b"".join((
                _DELIVER_HEAD.pack(1, channel, 16 + len(ct) + len(ex) + len(rk), 60, 60, len(ct)),
                ct,
                _TAG_BIT_LEN.pack(delivery_tag, redelivered, len(ex)),
                ex,
                _LEN1[len(rk)],
                rk,
                _END_HEADER.pack(0xCE, 2, channel, 12 + len(props_raw), 60, 0, size),
                props_raw,
                _END_BODY.pack(0xCE, 3, channel, size),
                body,
                _END,
            ))
        parts = [
            _DELIVER_HEAD.pack(1, channel, 16 + len(ct) + len(ex) + len(rk), 60, 60, len(ct)),
            ct,
            _TAG_BIT_LEN.pack(delivery_tag, redelivered, len(ex)),
            ex,
            _LEN1[len(rk)],
            rk,
            _END_HEADER.pack(0xCE, 2, channel, 12 + len(props_raw), 60, 0, size),
            props_raw,
        ]
    except (struct.error, IndexError) as exc:
        raise ValueError(f"cannot encode basic.deliver: {exc}") from exc
    parts += _body_tail(channel, body, frame_max)
    return b"".join(parts)


_TAG_BIT = struct.Struct(">QB")  # delivery-tag, redelivered (the run encoder packs the names once)


def encode_deliver_run(
    channel: int,
    consumer_tag: str | bytes,
    first_tag: int,
    items: list,
    frame_max: int = DEFAULT_FRAME_MAX,
) -> bytes:
    """Several deliveries to one consumer in one pass: exactly the bytes of ``encode_deliver`` for
    each item in turn, delivery tags ``first_tag``, ``first_tag + 1``, ...

    ``items`` are contract DELIVER items (broker/contract.py): [6:11] are redelivered, exchange,
    routing_key, props_raw, body. The method frame's head and names are packed once per exchange and
    routing key, the content header once per properties and body size: per delivery only the tag
    and a few list slots remain (issue #15: 0.57 -> 0.13 us per delivery measured)."""
    ct = consumer_tag if consumer_tag.__class__ is bytes else consumer_tag.encode()
    limit = frame_max - 8 if frame_max else 0
    parts: list = []
    tag_bit = _TAG_BIT.pack
    end_header = _END_HEADER.pack
    ex_prev = rk_prev = props_prev = None
    size_prev = -1
    head = names = header = b""
    single = True  # the header ends with the one body frame's header
    tag = first_tag
    try:
        for item in items:
            ex = item[7]
            rk = item[8]
            if ex != ex_prev or rk != rk_prev:
                ex_prev = ex
                rk_prev = rk
                exb = ex if ex.__class__ is bytes else ex.encode()
                rkb = rk if rk.__class__ is bytes else rk.encode()
                head = _DELIVER_HEAD.pack(1, channel, 16 + len(ct) + len(exb) + len(rkb), 60, 60, len(ct)) + ct
                names = _LEN1[len(exb)] + exb + _LEN1[len(rkb)] + rkb
            props = item[9]
            body = item[10]
            size = len(body)
            if size != size_prev or props != props_prev:
                size_prev = size
                props_prev = props
                header = end_header(0xCE, 2, channel, 12 + len(props), 60, 0, size) + props
                single = size and (size <= limit or not frame_max)
                if single:
                    header += _END_BODY.pack(0xCE, 3, channel, size)
            if single:
                parts += (head, tag_bit(tag, item[6]), names, header, body, _END)
            else:
                parts += (head, tag_bit(tag, item[6]), names, header)
                parts += _body_tail(channel, body, frame_max)
            tag += 1
    except (struct.error, IndexError) as exc:
        raise ValueError(f"cannot encode basic.deliver: {exc}") from exc
    return b"".join(parts)


def encode_publish(
    channel: int,
    exchange: str | bytes,
    routing_key: str | bytes,
    mandatory: bool,
    props_raw: bytes,
    body: bytes,
    frame_max: int = DEFAULT_FRAME_MAX,
) -> bytes:
    """basic.publish + content header + body frames (client side: the perf tool)."""
    ex = exchange if exchange.__class__ is bytes else exchange.encode()
    rk = routing_key if routing_key.__class__ is bytes else routing_key.encode()
    size = len(body)
    try:
        if size and (size <= frame_max - 8 or not frame_max):
            return b"".join((
                _PUBLISH_HEAD.pack(1, channel, 9 + len(ex) + len(rk), 60, 40, 0, len(ex)),
                ex,
                _LEN1[len(rk)],
                rk,
                _BITS_END_HEADER.pack(bool(mandatory), 0xCE, 2, channel, 12 + len(props_raw), 60, 0, size),
                props_raw,
                _END_BODY.pack(0xCE, 3, channel, size),
                body,
                _END,
            ))
        parts = [
            _PUBLISH_HEAD.pack(1, channel, 9 + len(ex) + len(rk), 60, 40, 0, len(ex)),
            ex,
            _LEN1[len(rk)],
            rk,
            _BITS_END_HEADER.pack(bool(mandatory), 0xCE, 2, channel, 12 + len(props_raw), 60, 0, size),
            props_raw,
        ]
    except (struct.error, IndexError) as exc:
        raise ValueError(f"cannot encode basic.publish: {exc}") from exc
    parts += _body_tail(channel, body, frame_max)
    return b"".join(parts)


def encode_content(
    channel: int, method: Any, props_raw: bytes, body: bytes, frame_max: int = DEFAULT_FRAME_MAX
) -> bytes:
    """Any content-bearing method (get-ok, return, ...) given as a pamqp object, with its content."""
    method_frame = pamqp_frame.marshal(method, channel)
    header = _END_HEADER.pack(0xCE, 2, channel, 12 + len(props_raw), method.index >> 16, 0, len(body))
    # the method frame's own frame-end is re-emitted as the first byte of the header pack
    return b"".join([method_frame[:-1], header, props_raw, *_body_tail(channel, body, frame_max)])


def encode_ack(channel: int, tag: int, multiple: bool) -> bytes:
    return _ACK.pack(1, channel, 13, 60, 80, tag, bool(multiple), 0xCE)


def encode_nack(channel: int, tag: int, multiple: bool, requeue: bool) -> bytes:
    return _ACK.pack(1, channel, 13, 60, 120, tag, bool(multiple) | (bool(requeue) << 1), 0xCE)


def encode_reject(channel: int, tag: int, requeue: bool) -> bytes:
    return _ACK.pack(1, channel, 13, 60, 90, tag, bool(requeue), 0xCE)

