"""Basic content properties: full decode/encode through pamqp, and fast single-field readers.

props_raw = property flags (one or more 16-bit words, bit 0 = another word follows) then the
present properties in flag order. The fast readers walk only as far as the field they need,
since content-type, content-encoding and headers are the only fields before delivery-mode.
"""

from __future__ import annotations

import struct

from pamqp import commands, decode
from pamqp import encode as _pamqp_encode

from broker.amqp import pamqp_types  # noqa: F401  (pamqp's amqp_type without a string per call)

EMPTY_PROPS = b"\x00\x00"

_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")

_pamqp_table_value = _pamqp_encode.encode_table_value


def _table_value(value) -> bytes:
    # pamqp decodes a long string ('S') that is not UTF-8 to bytes but cannot encode bytes back
    # (TypeError): a valid message whose properties we must rewrite (BCC strip, x-death, timestamp,
    # reply-to, x-delivery-count) would fail. Write such a value back as the 'S' it came as.
    if value.__class__ is bytes:
        return b"S" + _U32.pack(len(value)) + value
    return _pamqp_table_value(value)


# field_table and field_array look encode_table_value up as a module global on every value.
_pamqp_encode.encode_table_value = _table_value

_FLAG_CONTENT_TYPE = 0x8000
_FLAG_CONTENT_ENCODING = 0x4000
_FLAG_HEADERS = 0x2000
_FLAG_DELIVERY_MODE = 0x1000
_FLAG_PRIORITY = 0x0800


def _skip_flags(props_raw: bytes) -> tuple[int, int]:
    """(first flag word, offset of the property list). ValueError if truncated."""
    n = len(props_raw)
    if n < 2:
        raise ValueError("property flags truncated")
    flags = (props_raw[0] << 8) | props_raw[1]
    pos = 2
    word = flags
    while word & 1:  # continuation words carry no basic properties, only need skipping
        if pos + 2 > n:
            raise ValueError("property flags truncated")
        word = (props_raw[pos] << 8) | props_raw[pos + 1]
        pos += 2
    return flags, pos


def _skip_to_headers(props_raw: bytes) -> tuple[int, int]:
    flags, pos = _skip_flags(props_raw)
    n = len(props_raw)
    if flags & _FLAG_CONTENT_TYPE:
        if pos >= n:
            raise ValueError("content-type truncated")
        pos += 1 + props_raw[pos]
    if flags & _FLAG_CONTENT_ENCODING:
        if pos >= n:
            raise ValueError("content-encoding truncated")
        pos += 1 + props_raw[pos]
    if pos > n:
        raise ValueError("properties truncated")
    return flags, pos


def delivery_mode(props_raw: bytes) -> int:
    """The delivery-mode octet (2 = persistent), or 0 when the property is absent."""
    flags = (props_raw[0] << 8) | props_raw[1] if len(props_raw) >= 2 else -1
    if flags == 0:
        return 0
    if flags == _FLAG_DELIVERY_MODE:  # the most common non-empty shape: only delivery-mode
        if len(props_raw) < 3:
            raise ValueError("delivery-mode truncated")
        return props_raw[2]
    flags, pos = _skip_to_headers(props_raw)
    if not flags & _FLAG_DELIVERY_MODE:
        return 0
    n = len(props_raw)
    if flags & _FLAG_HEADERS:
        if pos + 4 > n:
            raise ValueError("headers table truncated")
        pos += 4 + _U32.unpack_from(props_raw, pos)[0]
    if pos >= n:
        raise ValueError("delivery-mode truncated")
    return props_raw[pos]


def priority(props_raw: bytes) -> int:
    """The priority octet, or 0 when the property is absent. ValueError if truncated.

    Priority comes right after delivery-mode; only the variable-length fields before it
    (content-type, content-encoding, headers) need walking, and the two shapes clients
    send most (priority alone, or with delivery-mode) are read at a fixed offset.
    """
    if len(props_raw) < 2 or not props_raw[0] & 0x08:
        return 0
    flags = (props_raw[0] << 8) | props_raw[1]
    if flags == _FLAG_PRIORITY | _FLAG_DELIVERY_MODE:
        if len(props_raw) < 4:
            raise ValueError("priority truncated")
        return props_raw[3]
    if flags == _FLAG_PRIORITY:
        if len(props_raw) < 3:
            raise ValueError("priority truncated")
        return props_raw[2]
    flags, pos = _skip_to_headers(props_raw)
    n = len(props_raw)
    if flags & _FLAG_HEADERS:
        if pos + 4 > n:
            raise ValueError("headers table truncated")
        pos += 4 + _U32.unpack_from(props_raw, pos)[0]
    if flags & _FLAG_DELIVERY_MODE:
        pos += 1
    if pos >= n:
        raise ValueError("priority truncated")
    return props_raw[pos]


def decode_headers(props_raw: bytes) -> dict | None:
    """The headers table, or None when absent. ValueError if malformed."""
    flags, pos = _skip_to_headers(props_raw)
    if not flags & _FLAG_HEADERS:
        return None
    if pos + 4 > len(props_raw):
        raise ValueError("headers table truncated")
    try:
        _, table = decode.field_table(bytes(props_raw[pos:]))
    except Exception as exc:  # pamqp leaks several error types from nested values
        raise ValueError(f"malformed headers table: {exc}") from exc
    return table


def decode_properties(props_raw: bytes) -> commands.Basic.Properties:
    """All properties as a pamqp object. ValueError if malformed."""
    flags, pos = _skip_flags(props_raw)
    data = bytes(props_raw[pos:])
    props = commands.Basic.Properties()
    try:
        _checked_length(flags, data)
        props.unmarshal(flags, data)
    except ValueError:
        raise
    except Exception as exc:  # e.g. OverflowError from an absurd timestamp
        raise ValueError(f"malformed properties: {exc}") from exc
    return props


def encode_properties(props: commands.Basic.Properties) -> bytes:
    return props.marshal()


_FIELD_TYPES = [
    (commands.Basic.Properties.flags[name], getattr(commands.Basic.Properties, "_" + name))
    for name in commands.Basic.Properties.__slots__
]


def _checked_length(flags: int, data: bytes) -> None:
    """pamqp silently truncates short strings; check every field fits before decoding."""
    pos, n = 0, len(data)
    for flag, kind in _FIELD_TYPES:
        if not flags & flag:
            continue
        if kind == "shortstr":
            if pos >= n:
                raise ValueError("property truncated")
            pos += 1 + data[pos]
        elif kind == "table":
            if pos + 4 > n:
                raise ValueError("property truncated")
            pos += 4 + _U32.unpack_from(data, pos)[0]
        elif kind == "octet":
            pos += 1
        elif kind == "timestamp":
            pos += 8
        if pos > n:
            raise ValueError("property truncated")


def headers_offset(props_raw: bytes) -> int | None:
    """Offset of the headers table (its u32 length) in props_raw, None when absent. ValueError if truncated."""
    flags, pos = _skip_to_headers(props_raw)
    return pos if flags & _FLAG_HEADERS else None
