"""Reading a node's segment files directly (a stopped node's data dir, a follower's copy, a backup).

Spark-free: `plan()` lists the segment files under a path, `read_segment()` yields their records.
Records are found, checked and decoded with the storage's own reader (`shard.record.scan_records`: CRC32 and
field lengths of every record, the stop rules of `shard.record.scan`); files are mapped read-only and never changed (the
node's recovery cuts and rewrites files, so its stores are not opened here).

A record that fails its check is never returned as data. In PERMISSIVE mode it is counted and
skipped: when its length field is intact the next record follows it (a flipped byte in a body),
otherwise the reader searches forward, byte by byte, for the next position holding a record whose
CRC matches. In FAILFAST mode the first bad record raises `CorruptRecord`.

Layouts (docs/storage.md): a queue directory holds `msgs.N` (+ `acks.N`, `meta.N` for classic
queues, `smeta.N` for streams); a priority queue's directory holds one such store per level in
`p-NNN/`; a data dir holds `<sha1(vhost)>/<sha1(queue)>/` with `.vhost` / `.queue` name files.
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field

from shard import record
from shard.segment import DATA_START, FORMAT_VERSION, META_SIZE, VERSION_HEADER, Meta, read_ack_entries
from shard.stream_store import StreamSegment

log = logging.getLogger(__name__)

MODES = ("PERMISSIVE", "FAILFAST")
_HEADER = struct.Struct("<II")
_U32 = struct.Struct("<I")

# (offset or None, ts_ms, flags, exchange, routing_key, props_raw, body, position, acked)
SegmentRecord = tuple[int | None, int, int, str, str, bytes, bytes, int, bool]


class CorruptRecord(Exception):
    """A record failed its CRC32 or length checks (FAILFAST mode)."""


@dataclass(frozen=True)
class SegmentFile:
    """One `msgs.N` file to read, with what is known about it before reading."""

    path: str  # the msgs file
    queue_dir: str
    vhost: str | None
    queue: str | None
    kind: str  # "stream" or "classic"
    no: int
    first_offset: int | None = None  # streams: offset of the first record


@dataclass
class ScanStats:
    """What reading one or more segment files found."""

    records: int = 0  # good records read (acked ones included)
    acked: int = 0
    corrupt: int = 0
    problems: list[str] = field(default_factory=list)

    def add(self, other: ScanStats) -> None:
        self.records += other.records
        self.acked += other.acked
        self.corrupt += other.corrupt
        self.problems.extend(other.problems)


def _read_name(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError:
        return None


def _segment_numbers(qdir: str) -> tuple[list[int], bool]:
    """(msgs file numbers in order, whether it is a stream: it has smeta files)."""
    nums = []
    stream = False
    for name in os.listdir(qdir):
        kind, dot, num = name.partition(".")
        if not dot or len(num) != 10 or not num.isdigit():
            continue
        if kind == "msgs":
            nums.append(int(num))
        elif kind == "smeta":
            stream = True
    return sorted(nums), stream


def _is_store_dir(path: str) -> bool:
    return any(n.startswith("msgs.") for n in os.listdir(path))


def _count_records(path: str) -> int:
    """Records in a msgs file, walked by length (only to number a stream segment whose smeta is gone)."""
    n = 0
    for _ in _scan_file(path, verify=False):
        n += 1
    return n


def _scan_file(path: str, verify: bool) -> Iterator[tuple[int, int, int]]:
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size <= DATA_START:
            return
        mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)
    try:
        yield from record.scan(mm, DATA_START, size, verify, record.ScanResult())
    finally:
        mm.close()


def _store_files(qdir: str, vhost: str | None, queue: str | None) -> list[SegmentFile]:
    nums, stream = _segment_numbers(qdir)
    files = []
    expect = 0
    for no in nums:
        path = os.path.join(qdir, f"msgs.{no:010d}")
        first = None
        if stream:
            meta = StreamSegment(qdir, no).read_smeta()
            # (sealed, first, count, used, first_ts, last_ts, body_bytes)
            first = meta[1] if meta is not None else expect
            count = meta[2] if meta is not None and meta[0] else _count_records(path)
            expect = first + count
        files.append(SegmentFile(path, qdir, vhost, queue, "stream" if stream else "classic", no, first))
    return files


def _queue_files(qdir: str, vhost: str | None, queue: str | None) -> list[SegmentFile]:
    if queue is None:
        queue = _read_name(os.path.join(qdir, ".queue"))
    if vhost is None:
        vhost = _read_name(os.path.join(os.path.dirname(qdir), ".vhost"))
    files = _store_files(qdir, vhost, queue) if _is_store_dir(qdir) else []
    for name in sorted(os.listdir(qdir)):  # priority levels
        sub = os.path.join(qdir, name)
        if len(name) == 5 and name.startswith("p-") and name[2:].isdigit() and os.path.isdir(sub):
            files.extend(_store_files(sub, vhost, queue))
    return files


def plan(path: str, vhost: str | None = None, queue: str | None = None) -> list[SegmentFile]:
    """Every segment file under `path` (a data dir, a vhost dir or a queue dir), optionally of one vhost/queue.

    FileNotFoundError if `path` does not exist; ValueError if it holds no queue at all.
    """
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no such directory: {path}")
    if os.path.exists(os.path.join(path, ".queue")) or _is_store_dir(path):
        files = _queue_files(path, None, None)
    else:
        vdirs = [path] if os.path.exists(os.path.join(path, ".vhost")) else [
            os.path.join(path, n) for n in sorted(os.listdir(path))
            if os.path.exists(os.path.join(path, n, ".vhost"))]
        if not vdirs:
            raise ValueError(f"{path} is not a ShardMQ data dir, vhost dir or queue dir "
                             "(no .vhost/.queue name files, no msgs.* segment files)")
        files = []
        for vdir in vdirs:
            vname = _read_name(os.path.join(vdir, ".vhost"))
            if vhost is not None and vname != vhost:
                continue
            for n in sorted(os.listdir(vdir)):
                qdir = os.path.join(vdir, n)
                if not os.path.exists(os.path.join(qdir, ".queue")):
                    continue
                qname = _read_name(os.path.join(qdir, ".queue"))
                if queue is not None and qname != queue:
                    continue
                files.extend(_queue_files(qdir, vname, qname))
    return files


def read_acks(path: str) -> set[int]:
    """Positions in an ack file (either version), read-only: shard.segment.read_acks truncates a torn
    tail, a reader must not. Entries that fail their checksum are left out."""
    return set(read_ack_entries(path)[0])


def _meta_used(seg: SegmentFile) -> int | None:
    if seg.kind != "classic":
        return None
    try:
        with open(os.path.join(seg.queue_dir, f"meta.{seg.no:010d}"), "rb") as f:
            meta = Meta.decode(f.read(META_SIZE + 1))
    except OSError:
        return None
    return meta.used if meta is not None else None


def _resync(mm: mmap.mmap, pos: int, end: int) -> int:
    """The next position after a bad record at `pos` where a CRC-valid record starts (end if none)."""
    length = _U32.unpack_from(mm, pos)[0] if pos + 4 <= end else 0
    nxt = pos + record.HEADER_SIZE + length
    if length >= record.MIN_PAYLOAD and nxt <= end and _good_at(mm, nxt, end):
        return nxt
    p = pos + 1
    limit = end - record.MIN_RECORD
    while p <= limit:
        length = _U32.unpack_from(mm, p)[0]
        if length >= record.MIN_PAYLOAD and p + record.HEADER_SIZE + length <= end and _good_at(mm, p, end):
            return p
        p += 1
    return end


def _good_at(mm: mmap.mmap, pos: int, end: int) -> bool:
    """A valid record (CRC and lengths, checked by shard.record.scan) or a clean end of data at `pos`."""
    if pos + record.HEADER_SIZE > end:
        return pos == end
    if _HEADER.unpack_from(mm, pos) == (0, 0):
        return True
    return next(record.scan(mm, pos, end, True, record.ScanResult()), None) is not None


def read_segment(seg: SegmentFile, mode: str = "PERMISSIVE", include_acked: bool = False,
                 stats: ScanStats | None = None) -> Iterator[SegmentRecord]:
    """The records of one segment file, checked; see the module docstring for bad records."""
    if mode not in MODES:
        raise ValueError(f"mode must be PERMISSIVE or FAILFAST, not {mode!r}")
    st = stats if stats is not None else ScanStats()
    try:
        f = open(seg.path, "rb")
    except FileNotFoundError:
        return  # removed (acked away, retention) since planning
    with f:
        size = os.fstat(f.fileno()).st_size
        if size < DATA_START:
            return
        mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)
    try:
        version = VERSION_HEADER.unpack_from(mm, 0)[0]
        if version != FORMAT_VERSION:
            if version == 0 and not any(mm[:min(size, 1 << 16)]):
                return  # created, never written
            problem = f"{seg.path}: unknown segment format version {version}"
            if mode == "FAILFAST":
                raise CorruptRecord(problem)
            st.corrupt += 1
            st.problems.append(problem)
            log.warning("shardmq-segments: %s; file skipped", problem)
            return
        used = _meta_used(seg)
        end = min(size, used) if used is not None and used >= DATA_START else size
        acks = read_acks(os.path.join(seg.queue_dir, f"acks.{seg.no:010d}")) if seg.kind == "classic" else set()
        yield from _records(mm, seg, end, mode, include_acked, acks, st)
    finally:
        mm.close()


def _records(mm: mmap.mmap, seg: SegmentFile, end: int, mode: str, include_acked: bool, acks: set[int],
             st: ScanStats) -> Iterator[SegmentRecord]:
    offset = seg.first_offset
    pos = DATA_START
    while True:
        result = record.ScanResult()
        if not acks and offset is not None:  # a stream: nothing acked, offsets count on
            for p, ts, flags, ex, rk, props, body in record.scan_records(mm, pos, end, result):
                if flags & record.FLAG_FILLER:  # damaged records set aside by recovery: ts = their offsets
                    offset += max(ts, 1)
                    continue
                yield offset, ts, flags, ex, rk, props, body, p, False
                offset += 1
                st.records += 1
        else:
            for p, ts, flags, ex, rk, props, body in record.scan_records(mm, pos, end, result):
                st.records += 1
                if offset is not None:
                    offset += 1
                acked = p in acks
                if acked:
                    st.acked += 1
                    if not include_acked:
                        continue
                yield (offset - 1 if offset is not None else None), ts, flags, ex, rk, props, body, p, acked
        if not result.reason:
            return
        problem = f"{seg.path}: {result.reason}"
        if mode == "FAILFAST":
            raise CorruptRecord(problem)
        st.corrupt += 1
        st.problems.append(problem)
        nxt = _resync(mm, result.end, end)
        length = _U32.unpack_from(mm, result.end)[0] if result.end + 4 <= end else 0
        if nxt == result.end + record.HEADER_SIZE + length and offset is not None:
            offset += 1  # exactly one record skipped: later offsets stay right
        elif offset is not None and nxt < end:
            log.warning("shardmq-segments: %s: offsets after position %d are unknown", seg.path, nxt)
            offset = None
        log.warning("shardmq-segments: %s; skipped %d bytes", problem, nxt - result.end)
        if nxt >= end:
            return
        pos = nxt
