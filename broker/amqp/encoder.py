"""Frame encoders. Control methods go through pamqp; the per-message frames are packed by hand.

Hot frames are built with one b"".join over precompiled struct packs; the frame-end octet of one
frame and the header of the next are packed together (byte layout: docs/codec.md). Equality with
pamqp.frame.marshal, byte for byte, is proven by tests/test_codec.py.
"""

from __future__ import annotations

import struct
from typing import Any

from pamqp import frame as pamqp_frame

from broker.amqp.constants import DEFAULT_FRAME_MAX, PROTOCOL_HEADER

# method frame header (type, channel, size, class, method) + first shortstr length
_DELIVER_HEAD = struct.Struct(">BHIHHB")
_TAG_BIT_LEN = struct.Struct(">QBB")  # delivery-tag, redelivered, exchange length
_PUBLISH_HEAD = struct.Struct(">BHIHHHB")  # ... ticket, exchange length
_BITS_END_HEADER = struct.Struct(">BBBHIHHQ")  # bits, frame-end, type 2, channel, size, class, weight, body size
_END_HEADER = struct.Struct(">BBHIHHQ")  # frame-end, type 2, channel, size, class, weight, body size
_END_BODY = struct.Struct(">BBHI")  # frame-end, type 3, channel, size
_ACK = struct.Struct(">BHIHHQBB")  # 13-byte payload: class, method, tag, bits; frame-end

_LEN1 = [bytes((i,)) for i in range(256)]
_END = b"\xce"
_HEARTBEAT = b"\x08\x00\x00\x00\x00\x00\x00\xce"


def encode_protocol_header() -> bytes:
    return PROTOCOL_HEADER


def encode_heartbeat() -> bytes:
    return _HEARTBEAT


def encode_method(channel: int, method: Any) -> bytes:
    """Any method frame via pamqp (which validates the method's fields)."""
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

