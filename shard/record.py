"""One stored message record: its byte layout, writing it, reading it, scanning for it.

Layout (little-endian, see docs/storage.md):

    u32 L (payload length) | u32 CRC32(payload) | payload
    payload = u64 ts_ms | u8 flags | u8 exlen | exchange | u8 rklen | routing_key
              | u32 propslen | props | u64 bodylen | body

L == 0 marks the end of data (a sparse segment is zeros after its last record).
The hot path works directly on the segment's mmap: no per-record objects beyond
the returned bytes/str.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import Any

from broker.crc import crc32 as _isal_crc32

HEADER = struct.Struct("<II")  # payload length, crc32 of payload
HEADER_SIZE = HEADER.size
_TS_FLAGS_EXLEN = struct.Struct("<QBB")
_U8 = struct.Struct("<B")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")

# ts(8) + flags(1) + exlen(1) + rklen(1) + propslen(4) + bodylen(8)
MIN_PAYLOAD = 23
MIN_RECORD = HEADER_SIZE + MIN_PAYLOAD

FLAG_PERSISTENT = 1

_pack_head = _TS_FLAGS_EXLEN.pack
_pack_u8 = _U8.pack
_pack_u32 = _U32.pack
_pack_u64 = _U64.pack
_pack_header_into = HEADER.pack_into
_unpack_header = HEADER.unpack_from
_unpack_head = _TS_FLAGS_EXLEN.unpack_from
_unpack_u32 = _U32.unpack_from
_unpack_u64 = _U64.unpack_from
_crc32 = _isal_crc32  # ISA-L's: the same values as zlib.crc32 (files stay readable), ~3-5x faster


def encode_payload(ts_ms: int, flags: int, ex: bytes, rk: bytes, props: bytes, body: bytes) -> bytes:
    """The payload bytes of a record (everything after the 8-byte header)."""
    return b"".join(
        (_pack_head(ts_ms, flags, len(ex)), ex, _pack_u8(len(rk)), rk, _pack_u32(len(props)), props,
         _pack_u64(len(body)), body)
    )


def write(buf: Any, pos: int, payload: bytes) -> int:
    """Write a record with `payload` at `pos` of a writable buffer (the mmap); returns its size.

    The payload goes first and the length last: a process killed in between leaves
    L == 0 at `pos`, which reads as a clean end of data.
    """
    end = pos + HEADER_SIZE + len(payload)
    buf[pos + HEADER_SIZE:end] = payload
    _pack_header_into(buf, pos, len(payload), _crc32(payload))
    return end - pos


def read(buf: Any, pos: int) -> tuple[int, int, str, str, bytes, bytes, int]:
    """Decode the record at `pos`: (ts_ms, flags, exchange, routing_key, props, body, next_pos).

    No CRC check: records were verified when the segment was recovered or written by us.
    """
    length = _unpack_u32(buf, pos)[0]
    p = pos + HEADER_SIZE
    ts, flags, el = _unpack_head(buf, p)
    p += 10
    ex = buf[p:p + el].decode() if el else ""
    p += el
    rl = buf[p]
    p += 1
    rk = buf[p:p + rl].decode() if rl else ""
    p += rl
    pl = _unpack_u32(buf, p)[0]
    p += 4
    props = buf[p:p + pl]
    p += pl
    bl = _unpack_u64(buf, p)[0]
    p += 8
    return ts, flags, ex, rk, props, buf[p:p + bl], pos + HEADER_SIZE + length


def skip(buf: Any, pos: int) -> int:
    """Position of the record after the one at `pos`, without decoding it."""
    return pos + HEADER_SIZE + _unpack_u32(buf, pos)[0]


def body_len(buf: Any, pos: int) -> int:
    """Body size of the record at `pos` (from its lengths, body untouched)."""
    length = _unpack_u32(buf, pos)[0]
    p = pos + HEADER_SIZE + 9
    el = buf[p]
    p += 1 + el
    rl = buf[p]
    p += 1 + rl
    pl = _unpack_u32(buf, p)[0]
    return length - MIN_PAYLOAD - el - rl - pl


def _fields(buf: Any, p: int, length: int) -> tuple[int, int] | None:
    """(flags, body_len) of a payload at `p` of `length` bytes, None if its lengths are inconsistent."""
    end = p + length
    flags = buf[p + 8]
    q = p + 9
    q += 1 + buf[q]
    if q >= end:
        return None
    q += 1 + buf[q]
    if q + 4 > end:
        return None
    q += 4 + _unpack_u32(buf, q)[0]
    if q + 8 > end:
        return None
    bl = _unpack_u64(buf, q)[0]
    if q + 8 + bl != end:
        return None
    return flags, bl


class ScanResult:
    """Where a scan stopped and why (`reason` is "" for a clean end of data)."""

    __slots__ = ("end", "reason")

    def __init__(self) -> None:
        self.end = 0
        self.reason = ""


def scan(buf: Any, start: int, end: int, verify: bool, result: ScanResult) -> Iterator[tuple[int, int, int]]:
    """Yield (pos, flags, body_len) for each record in buf[start:end].

    Stops at a clean end of data (L == 0 with a zero CRC field), at the buffer end,
    or at the first torn (runs past `end`) or corrupt (bad CRC when `verify`, or
    inconsistent field lengths) record. `result.end` is then the position of the
    first byte not belonging to a good record; `result.reason` says why, "" if clean.
    """
    mv = memoryview(buf)
    try:
        pos = start
        while True:
            if pos + HEADER_SIZE > end:
                if pos < end and any(mv[pos:end]):
                    result.reason = f"torn record header at {pos}"
                break
            length, crc = _unpack_header(buf, pos)
            if length == 0:
                if crc != 0:
                    result.reason = f"garbage at {pos}"
                break
            if length < MIN_PAYLOAD:
                result.reason = f"bad record length {length} at {pos}"
                break
            nxt = pos + HEADER_SIZE + length
            if nxt > end:
                result.reason = f"torn record at {pos} (length {length} runs past {end})"
                break
            if verify and _crc32(mv[pos + HEADER_SIZE:nxt]) != crc:
                result.reason = f"CRC mismatch in record at {pos}"
                break
            fields = _fields(buf, pos + HEADER_SIZE, length)
            if fields is None:
                result.reason = f"inconsistent field lengths in record at {pos}"
                break
            yield pos, fields[0], fields[1]
            pos = nxt
        result.end = pos
    finally:
        mv.release()


FLAG_FILLER = 2  # a record recovery wrote over damaged bytes: never delivered, always removed


def _valid_at(buf: Any, mv: memoryview, pos: int, end: int) -> int:
    """End of the valid record (CRC and field lengths) at `pos`, or -1."""
    if pos + HEADER_SIZE > end:
        return -1
    length, crc = _unpack_header(buf, pos)
    nxt = pos + HEADER_SIZE + length
    if length < MIN_PAYLOAD or nxt > end or _fields(buf, pos + HEADER_SIZE, length) is None:
        return -1
    if _crc32(mv[pos + HEADER_SIZE:nxt]) != crc:
        return -1
    return nxt


def chain_count(buf: Any, start: int, stop: int) -> int | None:
    """How many records the length fields between `start` and `stop` describe, None if they do not
    add up to exactly `stop` (a damaged length field). Damage inside a body or a CRC leaves the
    lengths intact, so this tells how many records a damaged range held."""
    n = 0
    pos = start
    while pos < stop:
        if pos + HEADER_SIZE > stop:
            return None
        length = _unpack_header(buf, pos)[0]
        if length < MIN_PAYLOAD:
            return None
        pos += HEADER_SIZE + length
        n += 1
    return n if pos == stop else None


def _last_nonzero(mv: memoryview, start: int, end: int) -> int:
    """Index of the last non-zero byte in [start, end), or start - 1."""
    step = 1 << 16
    hi = end
    while hi > start:
        lo = max(start, hi - step)
        kept = len(bytes(mv[lo:hi]).rstrip(b"\0"))
        if kept:
            return lo + kept - 1
        hi = lo
    return start - 1


def resync(buf: Any, start: int, end: int) -> int:
    """Position of the first valid record after damage at `start`, or -1 if none follows.

    Every byte position is tried; a candidate counts only if its CRC matches (the CRC decides,
    not a length that merely looks plausible) and what follows it is a valid record too, a clean
    end of data (L == 0 with a zero CRC field) or the end of the buffer: a record-shaped run of
    bytes inside a damaged body would have to fake two CRCs to be taken for data.
    """
    mv = memoryview(buf)
    try:
        # A record starts with a non-zero length: no candidate lies after the last non-zero byte
        # (a write segment is zeros after its data; trying each of those positions took seconds).
        last = _last_nonzero(mv, start, end)
        for pos in range(start + 1, min(end - MIN_RECORD, last) + 1):
            nxt = _valid_at(buf, mv, pos, end)
            if nxt < 0:
                continue
            if nxt + HEADER_SIZE > end or _unpack_header(buf, nxt) == (0, 0) or _valid_at(buf, mv, nxt, end) >= 0:
                return pos
        return -1
    finally:
        mv.release()


def filler(size: int, offsets: int = 0) -> bytes:
    """A whole record of `size` (>= MIN_RECORD) bytes that recovery writes over damaged bytes.

    In a stream, `offsets` (stored in the timestamp field) is how many message offsets the
    damaged bytes held, so the offsets of the records after it do not move.
    """
    payload = encode_payload(offsets, FLAG_FILLER, b"", b"", b"", bytes(size - MIN_RECORD))
    return HEADER.pack(len(payload), _crc32(payload)) + payload
