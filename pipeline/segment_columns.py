"""Finding, checking and decoding a run of segment records as columns (numpy and Arrow), not per record.

The Spark reader of segment files spends its time per record, so only what must be done per record
stays in a Python loop: reading the 8-byte header and the CRC32 of the payload (ISA-L's, zlib's
values: `broker/crc.py`, over a memoryview of the mapped file, no copy). The field lengths of every record are then checked for
the whole run at once with numpy, with exactly the rules of `shard.record` (`_fields`, `scan`), and
the variable-length fields (exchange, routing key, properties, body) become Arrow arrays through
Arrow's binary *view* type: one 16-byte view per record pointing into the mapped file, which
Arrow's own cast turns into an ordinary binary column in one C++ copy. No Python `bytes` object is
made per record.

This is an accelerator, not a second definition of the format: it only ever accepts records that
pass both checks, and wherever a run stops for any reason other than its row limit, the caller asks
`shard.record.scan` (the storage's reader) what is at that position: a clean end, or the reason a
record is bad (pipeline/segments.py).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from broker.crc import crc32 as _crc32
from shard import record

_HEADER = struct.Struct("<II")
_MAX_VIEW_OFFSET = (1 << 31) - 1  # Arrow views address their buffer with int32 offsets
_BYTE4 = np.arange(4)
_BYTE8 = np.arange(8)
_BYTE12 = np.arange(12)


@dataclass
class Run:
    """Good records of one run, as columns (row i = the i-th record from the run's start)."""

    position: np.ndarray  # int64, byte position of each record in its file
    ts: np.ndarray  # int64, ms since the epoch
    flags: np.ndarray  # uint8
    exchange: Any  # pa.StringArray
    routing_key: Any  # pa.StringArray
    props: Any  # pa.BinaryArray
    body: Any  # pa.BinaryArray

    def __len__(self) -> int:
        return len(self.position)

    def take(self, keep: np.ndarray) -> Run:
        """The rows where the boolean mask `keep` is true."""
        idx = pa.array(np.flatnonzero(keep))
        return Run(self.position[keep], self.ts[keep], self.flags[keep], self.exchange.take(idx),
                   self.routing_key.take(idx), self.props.take(idx), self.body.take(idx))


def crc_run(buf: Any, mv: memoryview, pos: int, end: int, limit: int) -> tuple[list[int], int]:
    """(positions, stop): up to `limit` consecutive records from `pos` whose header is plausible and whose
    payload's CRC32 matches; `stop` is the position after the last one (where a check failed, or the end)."""
    out: list[int] = []
    app = out.append
    unpack = _HEADER.unpack_from
    crc32 = _crc32
    min_payload = record.MIN_PAYLOAD
    stop = end - 8
    n = 0
    while n < limit and pos <= stop:
        length, crc = unpack(buf, pos)
        nxt = pos + 8 + length
        if length < min_payload or nxt > end or crc32(mv[pos + 8:nxt]) != crc:
            break
        app(pos)
        pos = nxt
        n += 1
    return out, pos


def _u32(a: np.ndarray, at: np.ndarray) -> np.ndarray:
    return a[at[:, None] + _BYTE4].view("<u4").ravel().astype(np.int64)


def _u64(a: np.ndarray, at: np.ndarray) -> np.ndarray:
    return a[at[:, None] + _BYTE8].view("<u8").ravel()


def _binary(a: np.ndarray, data: Any, starts: np.ndarray, lens: np.ndarray) -> Any:
    """A pa.BinaryArray of a[starts[i]:starts[i] + lens[i]], via 16-byte binary views into `data` (= a's buffer)."""
    n = len(starts)
    views = np.zeros((n, 4), np.int32)
    views[:, 0] = lens
    views[:, 3] = starts
    long_ = lens > 12
    if long_.any():
        views[long_, 1] = a[starts[long_, None] + _BYTE4].view("<i4").ravel()  # the 4-byte prefix
    short = ~long_
    if short.any():  # up to 12 bytes are stored inline in the view, zero padded
        s, ln = starts[short], lens[short]
        inline = a[np.minimum(s[:, None] + _BYTE12, len(a) - 1)]
        inline[_BYTE12[None, :] >= ln[:, None]] = 0
        views.view(np.uint8).reshape(n, 16)[short, 4:] = inline
    arr = pa.Array.from_buffers(pa.binary_view(), n, [None, pa.py_buffer(views), data])
    return arr.cast(pa.binary())


def _text(arr: Any) -> Any:
    """Names as strings (a record whose CRC matches holds what the broker wrote: valid UTF-8; replaced if not)."""
    try:
        return arr.cast(pa.string())
    except pa.ArrowInvalid:
        return pa.array([b.decode("utf-8", "replace") for b in arr.to_pylist()], pa.string())


def decode_run(a: np.ndarray, data: Any, positions: list[int]) -> tuple[Run, int]:
    """(the records at `positions` that also pass the field-length checks, as columns; how many passed).

    `a` is the mapped file as a uint8 array and `data` the same memory as a pa.Buffer; every record at
    `positions` passed `crc_run`. Records are taken up to the first with inconsistent field lengths.
    """
    pos = np.array(positions, np.int64)
    p = pos + 8
    nxt = p + _u32(a, pos)
    q = p + 10 + a[p + 9]  # after the exchange
    ok = q < nxt
    rl = a[np.minimum(q, nxt - 1)].astype(np.int64)
    c = q + 1 + rl  # the properties' length field
    ok &= c + 4 <= nxt
    pl = _u32(a, np.minimum(c, nxt - 4))
    b = c + 4 + pl  # the body's length field
    ok &= b + 8 <= nxt
    bl = _u64(a, np.minimum(b, nxt - 8))
    ok &= bl == (nxt - b - 8).astype(np.uint64)
    good = len(pos) if ok.all() else int(np.argmin(ok))
    if good < len(pos):
        pos, p, q, rl, c, pl, b, nxt = (x[:good] for x in (pos, p, q, rl, c, pl, b, nxt))
    el = q - p - 10
    run = Run(
        position=pos,
        ts=_u64(a, p).astype(np.int64),
        flags=a[p + 8],
        exchange=_text(_binary(a, data, p + 10, el)),
        routing_key=_text(_binary(a, data, q + 1, rl)),
        props=_binary(a, data, c + 4, pl),
        body=_binary(a, data, b + 8, nxt - b - 8),
    )
    return run, good


def usable(size: int) -> bool:
    """Whether a file of `size` bytes can be read this way (Arrow views address at most 2 GiB)."""
    return size <= _MAX_VIEW_OFFSET
