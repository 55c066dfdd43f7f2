"""AMQP content properties as DataFrame values: the `headers` map and the `properties` struct.

Sans-IO and Spark-free (the segment reader and the AMQP reader share it). Decoding goes through
`broker.amqp.properties` (pamqp); the result is cached per distinct properties blob, because a
stream usually holds few distinct ones (same content type, same delivery mode) and a pamqp decode
costs far more than a dict lookup. Deliveries from a stream carry a per-message `x-stream-offset`
header that would defeat the cache: `split_offset` takes it out first (it becomes the `offset`
column).
"""

from __future__ import annotations

import datetime as dt
import json
import struct
from typing import Any

from broker.amqp.properties import decode_properties, headers_offset

# Field order of the `properties` struct (AMQP basic property names, snake_case).
PROPERTY_FIELDS = (
    "content_type", "content_encoding", "delivery_mode", "priority", "correlation_id", "reply_to",
    "expiration", "message_id", "timestamp", "type", "user_id", "app_id",
)
_OFFSET_ENTRY = b"\x0fx-stream-offset" + b"l"
_OFFSET_ENTRY_LEN = len(_OFFSET_ENTRY) + 8
_U32 = struct.Struct(">I")
_I64 = struct.Struct(">q")
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
_CACHE_MAX = 4096
_PAMQP_NAMES = {"type": "message_type"}

Decoded = tuple[list[tuple[str, str]] | None, dict[str, Any]]


def header_text(value: Any) -> str | None:
    """A header value as the string stored in the `headers` map (maps need one value type)."""
    if value is None:
        return None
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dt.datetime):
        return value.isoformat()
    if isinstance(value, dict | list):
        return json.dumps(value, default=str, sort_keys=True)
    return str(value)


def _micros(value: Any) -> int | None:
    """An AMQP timestamp property (pamqp gives a datetime) as microseconds since the epoch."""
    if isinstance(value, dt.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=dt.UTC)
        return (value - _EPOCH) // dt.timedelta(microseconds=1)
    if isinstance(value, int):
        return value * 1_000_000
    return None


def split_offset(props_raw: bytes) -> tuple[int | None, bytes]:
    """(x-stream-offset, props without that header) for a delivery from a stream queue.

    The shard appends the entry at the end of the headers table (`shard.stream_queue.with_offset`),
    so it is found at a fixed place; props without it come back unchanged with None.
    """
    try:
        pos = headers_offset(props_raw)
    except ValueError:
        return None, props_raw
    if pos is None:
        return None, props_raw
    tlen = _U32.unpack_from(props_raw, pos)[0]
    end = pos + 4 + tlen
    start = end - _OFFSET_ENTRY_LEN
    if tlen < _OFFSET_ENTRY_LEN or props_raw[start:start + len(_OFFSET_ENTRY)] != _OFFSET_ENTRY:
        return None, props_raw
    offset = _I64.unpack_from(props_raw, end - 8)[0]
    if tlen == _OFFSET_ENTRY_LEN:  # the only header: drop the table and its flag bit
        return offset, bytes((props_raw[0] & ~0x20, props_raw[1])) + props_raw[2:pos] + props_raw[end:]
    return offset, props_raw[:pos] + _U32.pack(tlen - _OFFSET_ENTRY_LEN) + props_raw[pos + 4:start] + props_raw[end:]


class OffsetSplitter:
    """`split_offset` with a memo of the last blob's layout, for a consumer of one stream.

    Consecutive deliveries of a stream usually differ only in the 8 bytes of their offset: when a blob
    has the last one's length, the bytes before the offset entry, the entry's name and the bytes after
    it, it is the last blob with another offset, and the same props object is returned without slicing
    (C-level `startswith`/`endswith`, no copies; the dict lookups that follow reuse its cached hash).
    """

    __slots__ = ("_entry_at", "_len", "_prefix", "_props", "_suffix")

    def __init__(self) -> None:
        self._len = -1
        self._entry_at = 0
        self._prefix = b""
        self._suffix = b""
        self._props = b""

    def split(self, props_raw: bytes) -> tuple[int | None, bytes]:
        at = self._entry_at
        if (len(props_raw) == self._len and props_raw.startswith(_OFFSET_ENTRY, at)
                and props_raw.startswith(self._prefix) and props_raw.endswith(self._suffix)):
            return _I64.unpack_from(props_raw, at + len(_OFFSET_ENTRY))[0], self._props
        offset, props = split_offset(props_raw)
        if offset is not None:
            # The entry's 8-byte value ends the headers table; the table's length field is in the prefix.
            pos = headers_offset(props_raw)
            assert pos is not None
            end = pos + 4 + _U32.unpack_from(props_raw, pos)[0]
            self._len = len(props_raw)
            self._entry_at = end - _OFFSET_ENTRY_LEN
            self._prefix = props_raw[:self._entry_at]
            self._suffix = props_raw[end:]
            self._props = props
        return offset, props


class PropsDecoder:
    """props_raw -> (headers as (key, value) pairs or None, properties dict), cached per distinct blob."""

    __slots__ = ("_cache", "errors")

    def __init__(self) -> None:
        self._cache: dict[bytes, Decoded] = {}
        self.errors = 0  # blobs pamqp could not decode (their row gets empty properties)

    def decode(self, props_raw: bytes) -> Decoded:
        hit = self._cache.get(props_raw)
        if hit is not None:
            return hit
        try:
            p = decode_properties(props_raw)
        except ValueError:
            self.errors += 1
            out: Decoded = (None, dict.fromkeys(PROPERTY_FIELDS))
        else:
            headers = None
            if p.headers:
                headers = [(str(k), header_text(v)) for k, v in p.headers.items()]
            values = {name: getattr(p, _PAMQP_NAMES.get(name, name)) for name in PROPERTY_FIELDS}
            values["timestamp"] = _micros(values["timestamp"])
            out = (headers, values)
        if len(self._cache) >= _CACHE_MAX:
            self._cache.clear()
        self._cache[bytes(props_raw)] = out
        return out
