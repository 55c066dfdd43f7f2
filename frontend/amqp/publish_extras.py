"""Publish-time features that need the message properties decoded.

Kept off the plain path: the channel calls into this module only when a cheap
byte test says it may be needed (the headers flag plus a ``CC``/``BCC`` key in
the raw table, the reply-to flag plus the pseudo-queue name, a delay header on
a delayed exchange, or the server-timestamp setting). Everything here decodes
the properties with pamqp and re-encodes them only when they must change.
"""

from __future__ import annotations

import struct
import time
from datetime import UTC, datetime
from decimal import Decimal

from pamqp import decode

from broker.amqp.properties import decode_headers, decode_properties, encode_properties, headers_offset

# First flag octet of props_raw: headers (0x2000) and reply-to (0x0200) are in it; the
# second octet holds timestamp (0x0040).
HEADERS_BIT = 0x20
REPLY_TO_BIT = 0x02
TIMESTAMP_BIT = 0x40

REPLY_TO_QUEUE = "amq.rabbitmq.reply-to"
_REPLY_MARK = REPLY_TO_QUEUE.encode()
_DELAY_MARK = b"\x07x-delay"
_U32 = struct.Struct(">I")
_I32 = struct.Struct(">i")
_I64 = struct.Struct(">q")


def may_reply_to_pseudo_queue(props_raw: bytes) -> bool:
    return len(props_raw) > 1 and props_raw[0] & REPLY_TO_BIT != 0 and _REPLY_MARK in props_raw


def with_timestamp(props_raw: bytes) -> bytes:
    """Properties with the timestamp set to now when the message has none."""
    if len(props_raw) > 1 and props_raw[1] & TIMESTAMP_BIT:
        return props_raw
    props = decode_properties(props_raw)
    props.timestamp = datetime.fromtimestamp(int(time.time()), UTC)
    return encode_properties(props)


def with_reply_to(props_raw: bytes, reply_to: str) -> bytes:
    props = decode_properties(props_raw)
    props.reply_to = reply_to
    return encode_properties(props)


def reply_to_of(props_raw: bytes) -> str | None:
    return decode_properties(props_raw).reply_to


# RabbitMQ's plugin delays only 0 < x-delay <= 2^32 - 1 (its Erlang timer limit); anything else
# is routed at once.
MAX_DELAY_MS = 4294967295


def delay_ms(props_raw: bytes) -> int | None:
    """The x-delay header in milliseconds, or None when absent or not a number.

    As rabbit_delayed_message_utils: integer types as they are, floats and decimals
    truncated, strings parsed as integers; anything else (booleans, tables, text that is
    not an integer) means no delay.
    """
    if len(props_raw) < 2 or not props_raw[0] & HEADERS_BIT or _DELAY_MARK not in props_raw:
        return None
    value = (decode_headers(props_raw) or {}).get("x-delay")
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, (float, Decimal)):
        try:
            return int(value)
        except (ValueError, OverflowError):  # nan, inf
            return None
    if isinstance(value, (bytes, str)):
        try:
            return int(value)
        except ValueError:
            return None
    return None


def with_delay(props_raw: bytes, value: int) -> bytes:
    """Properties with the x-delay header set to ``value`` (signed int, as RabbitMQ's plugin sets it).

    The raw headers table is spliced: only that entry changes, every other property and
    header keeps its exact bytes (pamqp cannot re-encode some values it decodes, such as a
    non-UTF-8 long string, and re-encoding changes integer widths and key order). ValueError
    if there is no headers table or it is malformed.
    """
    pos = headers_offset(props_raw)
    if pos is None or pos + 4 > len(props_raw):
        raise ValueError("no headers table")
    start = pos + 4
    end = start + _U32.unpack_from(props_raw, pos)[0]
    table = bytes(props_raw[start:end])
    if end > len(props_raw):
        raise ValueError("headers table truncated")
    if -0x80000000 <= value <= 0x7FFFFFFF:
        entry = _DELAY_MARK + b"I" + _I32.pack(value)
    else:
        entry = _DELAY_MARK + b"l" + _I64.pack(value)
    out = bytearray()
    off = 0
    n = len(table)
    try:
        while off < n:
            value_at = off + 1 + table[off]
            consumed, _ = decode.embedded_value(table[value_at:])
            if table[off:value_at] == _DELAY_MARK:
                out += entry
                entry = b""
            else:
                out += table[off:value_at + consumed]
            off = value_at + consumed
    except Exception as exc:  # pamqp leaks several error types from nested values
        raise ValueError(f"malformed headers table: {exc}") from exc
    out += entry  # not there before: added
    return bytes(props_raw[:pos]) + _U32.pack(len(out)) + bytes(out) + bytes(props_raw[end:])
