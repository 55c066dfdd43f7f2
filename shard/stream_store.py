"""Durable storage of one stream queue: an append-only log of mmap'd segments read by many cursors.

Unlike `shard.store.QueueStore` nothing is ever acked away: a message stays until
retention removes its whole segment (oldest first). Every message has an offset
(0, 1, 2, ... in append order) that never changes; each segment records the
offset of its first message in a small `smeta` file so numbering survives
retention and restarts. Readers are `Cursor`s (segment, position, offset), one
per consumer, over the shared segment files: nothing is copied per consumer and
memory depends on the number of segments and cursors, not on the stream length.

Segment files (`msgs.N`) and records are exactly those of QueueStore
(`shard.segment.Segment`, `shard.record`); see docs/storage.md for the `smeta`
and `offsets` files.

Threading is QueueStore's: everything on the loop thread except `sync()`.
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import struct
import threading
import time
import zlib

from broker import temp_files, write_observer
from shard import dirty_stores, record, synced_mark
from shard.segment import DATA_START, FORMAT_VERSION, VERSION_HEADER, Segment, open_write_segments
from shard.segment_dir import SegmentDir

log = logging.getLogger(__name__)

# smeta: version, sealed, first offset, count, used, first ts, last ts, body bytes | crc32 of those
_SMETA = struct.Struct("<IIQQQQQQ")
_CRC = struct.Struct("<I")
SMETA_SIZE = _SMETA.size + _CRC.size
SMETA_VERSION = 1
OFFSETS_FILE = "offsets"
TRACK_INTERVAL_S = 1.0
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_unpack_u32 = _U32.unpack_from
_unpack_u64 = _U64.unpack_from
_HEADER_SIZE = record.HEADER_SIZE
_read_record = record.read
_FILLER = record.FLAG_FILLER

# (offset, ts_ms, flags, exchange, routing_key, props_raw, body)
StreamMessage = tuple[int, int, int, str, str, bytes, bytes]


def _name(kind: str, no: int) -> str:
    return f"{kind}.{no:010d}"


def _parse(name: str) -> tuple[str, int] | None:
    kind, dot, num = name.partition(".")
    if dot and kind in ("msgs", "smeta") and len(num) == 10 and num.isdigit():
        return kind, int(num)
    return None


class StreamSegment(Segment):
    """A Segment plus what a stream needs: its first offset and the timestamps of its ends."""

    __slots__ = ("first", "first_ts", "last_ts", "dropped")

    def __init__(self, dir_path: str, no: int) -> None:
        super().__init__(dir_path, no)
        self.first = 0
        self.first_ts = 0
        self.last_ts = 0
        self.dropped = False

    def smeta(self) -> bytes:
        fields = _SMETA.pack(SMETA_VERSION, int(self.sealed), self.first, self.count, self.used,
                             self.first_ts, self.last_ts, self.body_bytes)
        return fields + _CRC.pack(zlib.crc32(fields))

    def write_smeta(self) -> int:
        """Write the smeta file (unsynced); returns its fd for the next sync to fsync and close."""
        fd = os.open(self.path("smeta"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        data = self.smeta()
        os.write(fd, data)
        if write_observer.current is not None:
            write_observer.current.replace(self.path("smeta"), data)
        return fd

    def read_smeta(self) -> tuple | None:
        """(sealed, first, count, used, first_ts, last_ts, body_bytes), None unless valid."""
        try:
            with open(self.path("smeta"), "rb") as f:
                data = f.read(SMETA_SIZE + 1)
        except OSError:
            return None
        if len(data) != SMETA_SIZE:
            return None
        fields = data[:_SMETA.size]
        if _CRC.unpack_from(data, _SMETA.size)[0] != zlib.crc32(fields):
            return None
        version, *rest = _SMETA.unpack(fields)
        return tuple(rest) if version == SMETA_VERSION else None

    def unlink_all(self) -> None:
        for kind in ("msgs", "smeta"):
            try:
                os.unlink(self.path(kind))
            except FileNotFoundError:
                continue
            if write_observer.current is not None:
                write_observer.current.delete(self.path(kind))


class Cursor:
    """Where one reader is: the segment, the byte position and the offset of the next record."""

    __slots__ = ("seg", "pos", "offset")

    def __init__(self, seg: StreamSegment, pos: int, offset: int) -> None:
        self.seg = seg
        self.pos = pos
        self.offset = offset


class StreamStore(SegmentDir):
    """The log of one stream queue. See the module docstring and docs/storage.md."""

    SEGMENT_KINDS = ("msgs", "smeta")
    fsync = True  # streams are always durable (x-queue-type stream requires it): always fsynced

    def __init__(self, path: str, *, segment_size: int = 8 << 20, max_length: int | None = None,
                 max_bytes: int | None = None, max_age_s: int | None = None) -> None:
        self.path = path
        self._segment_size = max(int(segment_size), DATA_START + record.MIN_RECORD)
        self.max_length = max_length
        self.max_bytes = max_bytes
        self.max_age_s = max_age_s
        self._segs: list[StreamSegment] = []  # oldest first; the last one is the write segment
        self._firsts: list[int] = []  # first offsets of _segs, for bisect
        self.count = 0  # messages retained
        self.bytes = 0  # bytes of retained segment files (what x-max-length-bytes limits)
        self._cursors: set[Cursor] = set()
        self._closed = False
        # tracked consumer offsets: consumer tag -> next offset to deliver
        self.tracked: dict[str, int] = {}
        self._tracked_changed = False
        self._tracked_blob: bytes | None = None  # snapshot for the next sync to write
        self._tracked_at = -TRACK_INTERVAL_S  # monotonic time of the last snapshot
        self._lock = threading.Lock()
        self._wdirty = False
        self._dir_dirty = False
        self._sync_fds: list[int] = []
        self._syncing = 0
        self._deferred_close: list[int] | tuple[()] = ()
        self._synced = synced_mark.SyncedMark(self.path)  # the synced mark (shard/synced_mark.py)
        # Messages lost to damage since opened (skipped, bytes set aside; docs/storage.md).
        self.damaged_records = 0
        os.makedirs(path, exist_ok=True)
        self._dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self._recover()
        self._load_tracked()
        self.enforce_retention()
        if self.dirty:  # recovery repaired or rewrote something: the periodic sync makes it durable
            dirty_stores.note(self)

    # ------------------------------------------------------------ counters
    @property
    def ready(self) -> int:
        """Always 0: nothing waits to be taken off a stream (consumers read at their own cursors).

        The shard's delivery accounting and publisher pacing use `ready`; a stream is not
        a backlog to pace publishers by, as in RabbitMQ.
        """
        return 0

    @property
    def first_offset(self) -> int:
        return self._segs[0].first

    @property
    def next_offset(self) -> int:
        w = self._segs[-1]
        return w.first + w.count

    @property
    def dirty(self) -> bool:
        return (self._wdirty or self._dir_dirty or bool(self._sync_fds) or self._tracked_changed
                or self._tracked_blob is not None)

    # ------------------------------------------------------------ writing
    def append(self, ts_ms: int, flags: int, exchange: str, routing_key: str, props_raw: bytes,
               body: bytes) -> int:
        """Append a message; returns its offset."""
        payload = record.encode_payload(ts_ms, flags, exchange.encode(), routing_key.encode(), props_raw, body)
        total = _HEADER_SIZE + len(payload)
        seg = self._segs[-1]
        pos = seg.used
        if pos + total > seg.alloc_end:
            if pos + total > seg.size:
                seg = self._roll(total)
                pos = seg.used
            if pos + total > seg.alloc_end:
                seg.reserve(pos + total)
        record.write(seg.mm, pos, payload)
        seg.used = pos + total
        if write_observer.current is not None:
            write_observer.current.append(seg.msgs_path, pos, seg.mm[pos:pos + total])
        if not seg.count:
            seg.first_ts = ts_ms
        seg.last_ts = ts_ms
        seg.count += 1
        seg.body_bytes += len(body)
        self.count += 1
        self.bytes += total
        if not self._wdirty:
            self._wdirty = True
            dirty_stores.note(self)  # once per sync, not per append (shard/dirty_stores.py)
        return seg.first + seg.count - 1

    def _roll(self, total: int) -> StreamSegment:
        old = self._segs[-1]
        size = max(self._segment_size, DATA_START + total)
        if old.count == 0:
            old.regrow(size)  # nothing in it yet: make it big enough
            return old
        # Create first: if that fails (no space, no fds) the store is unchanged and can go on.
        new = self._create(old.no + 1, old.first + old.count, size)
        with self._lock:  # sync() reads the write segment's fd under this lock
            os.ftruncate(old.fd, old.used)
            old.sealed = True
            old.forget_write()
            self._sync_fds.append(old.fd)
            self._sync_fds.append(old.write_smeta())
            old.fd = -1
            self._segs.append(new)
            self._firsts.append(new.first)
            self._wdirty = True
            self._dir_dirty = True
        if not self._in_use(old):
            old.close_map()
        self.enforce_retention()
        return new

    def _create(self, no: int, first: int, size: int) -> StreamSegment:
        seg = StreamSegment(self.path, no)
        base = Segment.create(self.path, no, size)
        seg.fd, seg.mm, seg.size, seg.alloc_end = base.fd, base.mm, base.size, base.alloc_end
        base.forget_write()
        open_write_segments[seg.path("msgs")] = seg
        seg.first = first
        with self._lock:
            self._sync_fds.append(seg.write_smeta())  # the first offset must survive retention
            self._dir_dirty = True
        return seg

    # ------------------------------------------------------------ retention
    def configure(self, max_length: int | None, max_bytes: int | None, max_age_s: int | None) -> None:
        self.max_length, self.max_bytes, self.max_age_s = max_length, max_bytes, max_age_s
        self.enforce_retention()

    def enforce_retention(self, now_ms: int | None = None) -> int:
        """Remove whole sealed segments, oldest first, while a limit is exceeded; returns how many."""
        segs = self._segs
        max_length, max_bytes, max_age = self.max_length, self.max_bytes, self.max_age_s
        if max_length is None and max_bytes is None and max_age is None:
            return 0
        cutoff = -1
        if max_age is not None:
            cutoff = (now_ms if now_ms is not None else int(time.time() * 1000)) - max_age * 1000
        dropped = 0
        while len(segs) > 1:
            s = segs[0]
            if not ((max_length is not None and self.count > max_length)
                    or (max_bytes is not None and self.bytes > max_bytes)
                    or s.last_ts < cutoff):
                break
            self._drop_first()
            dropped += 1
        return dropped

    def age_deadline(self) -> int | None:
        """Wall-clock ms at which max-age next removes a segment (None: nothing can go)."""
        if self.max_age_s is None or len(self._segs) < 2:
            return None
        return self._segs[0].last_ts + self.max_age_s * 1000 + 1

    def _drop_first(self) -> None:
        seg = self._segs.pop(0)
        self._firsts.pop(0)
        nxt = self._segs[0]
        seg.dropped = True
        self.count -= seg.count
        self.bytes -= seg.used - DATA_START
        for c in self._cursors:
            if c.seg is seg:  # a reader behind retention continues at the oldest retained message
                self._place(c, nxt, DATA_START, nxt.first)
        seg.close_map()
        with self._lock:
            if seg.fd >= 0:
                self._release([seg.fd])
                seg.fd = -1
            self._dir_dirty = True
        seg.unlink_all()

    # ------------------------------------------------------------ reading
    def cursor(self, kind: str, value: int = 0) -> Cursor:
        """A new reader at "first", "last", "next", "offset" (value) or "timestamp" (value, ms)."""
        segs = self._segs
        w = segs[-1]
        if kind == "first":
            c = Cursor(segs[0], DATA_START, segs[0].first)
        elif kind == "last" and self.count:
            c = self._at_offset(self.next_offset - 1)
        elif kind == "offset" and value < self.next_offset:
            c = self._at_offset(max(value, self.first_offset))
        elif kind == "timestamp":
            c = self._at_time(value)
        else:
            c = Cursor(w, w.used, self.next_offset)
        self._map(c.seg)
        self._cursors.add(c)
        return c

    def seek(self, c: Cursor, offset: int) -> None:
        """Move an existing reader to `offset` (clamped to the retained range)."""
        if offset >= self.next_offset:
            w = self._segs[-1]
            self._place(c, w, w.used, self.next_offset)
        else:
            at = self._at_offset(max(offset, self.first_offset))
            self._place(c, at.seg, at.pos, at.offset)

    def release(self, c: Cursor) -> None:
        self._cursors.discard(c)
        seg = c.seg
        if seg.sealed and not self._in_use(seg):
            seg.close_map()

    def read(self, c: Cursor) -> StreamMessage | None:
        """The message at the cursor (the cursor moves past it), None at the end of the log."""
        seg = c.seg
        while c.pos >= seg.used:
            if not seg.sealed and not seg.dropped:
                return None
            nxt = self._after(seg)
            if nxt is None:
                return None
            self._place(c, nxt, DATA_START, nxt.first)
            seg = nxt
        ts, flags, ex, rk, props, body, nxt_pos = _read_record(seg.mm, c.pos)
        offset = c.offset
        c.pos = nxt_pos
        if flags & _FILLER:  # damaged records set aside by recovery: their offsets are skipped
            c.offset = offset + max(ts, 1)
            return self.read(c)
        c.offset = offset + 1
        return offset, ts, flags, ex, rk, props, body

    def _after(self, seg: StreamSegment) -> StreamSegment | None:
        segs = self._segs
        if seg.dropped:
            return segs[0]
        n = len(segs)
        for j in range(bisect.bisect_left(self._firsts, seg.first), n):
            if segs[j] is seg:
                return segs[j + 1] if j + 1 < n else None
        return None

    def _place(self, c: Cursor, seg: StreamSegment, pos: int, offset: int) -> None:
        old = c.seg
        c.seg, c.pos, c.offset = seg, pos, offset
        if old is not seg:
            self._map(seg)
            if old.sealed and not self._in_use(old):
                old.close_map()

    def _in_use(self, seg: StreamSegment) -> bool:
        for c in self._cursors:
            if c.seg is seg:
                return True
        return False

    def _map(self, seg: StreamSegment) -> None:
        """Map a sealed segment for reading; the first time, CRC-check it (lazy verification)."""
        if seg.mm is None and not seg.dropped:
            seg.map_readonly()
            if seg.unverified:
                seg.unverified = False
                self._verify_sealed(seg)

    def _verify_sealed(self, seg: StreamSegment) -> None:
        """Check every record of a segment its smeta vouched for; repair damage keeping its offsets."""
        count, used = seg.count, seg.used
        try:
            if not self._load(seg, used, True, count):
                return
        except OSError:  # no space to copy the damage aside: read it as it is, repair at the next start
            log.error("stream %s: segment %d: damage could not be set aside", self.path, seg.no, exc_info=True)
            return
        self.count += seg.count - count
        self.bytes += seg.used - used
        with self._lock:
            self._sync_fds.append(seg.write_smeta())
            self._dir_dirty = True

    @staticmethod
    def _skip(mm: object, pos: int) -> tuple[int, int]:
        """(position after the record at pos, how many offsets it takes: a filler can take several)."""
        length = _unpack_u32(mm, pos)[0]
        if mm[pos + _HEADER_SIZE + 8] & _FILLER:  # type: ignore[index]
            return pos + _HEADER_SIZE + length, max(_unpack_u64(mm, pos + _HEADER_SIZE)[0], 1)
        return pos + _HEADER_SIZE + length, 1

    def _at_offset(self, offset: int) -> Cursor:
        i = bisect.bisect_right(self._firsts, offset) - 1
        seg = self._segs[max(i, 0)]
        self._map(seg)
        pos = DATA_START
        mm = seg.mm
        at = seg.first
        skip = self._skip
        while at < offset and pos < seg.used:
            nxt, n = skip(mm, pos)
            if at + n > offset:  # inside damaged offsets: the next valid record after them
                break
            pos, at = nxt, at + n
        return Cursor(seg, pos, at)

    def _at_time(self, ts_ms: int) -> Cursor:
        """The first message stored at or after ts_ms (the end of the log when there is none)."""
        for seg in self._segs:
            if seg.count and seg.last_ts >= ts_ms:
                self._map(seg)
                mm = seg.mm
                pos = DATA_START
                offset = seg.first
                while pos < seg.used and (_unpack_u64(mm, pos + _HEADER_SIZE)[0] < ts_ms
                                          or mm[pos + _HEADER_SIZE + 8] & _FILLER):
                    pos, n = self._skip(mm, pos)
                    offset += n
                return Cursor(seg, pos, offset)
        w = self._segs[-1]
        return Cursor(w, w.used, self.next_offset)

    # ------------------------------------------------------------ tracked consumer offsets
    def track(self, tag: str, next_offset: int) -> None:
        if self.tracked.get(tag) != next_offset:
            self.tracked[tag] = next_offset
            if not self._tracked_changed:
                self._tracked_changed = True
                dirty_stores.note(self)

    def flush_acks(self) -> None:
        """Snapshot changed tracked offsets for the next sync (loop thread; the worker calls this per turn).

        At most one snapshot per TRACK_INTERVAL_S: the offsets file is rewritten and fsynced by
        the sync thread at that pace however fast consumers ack (close() writes the last one).
        """
        if self._tracked_changed:
            now = time.monotonic()
            if now - self._tracked_at < TRACK_INTERVAL_S:
                return
            self._tracked_at = now
            self._tracked_changed = False
            blob = self._tracked_json()
            with self._lock:
                self._tracked_blob = blob

    def _tracked_json(self) -> bytes:
        return json.dumps({"version": 1, "offsets": self.tracked}, separators=(",", ":")).encode()

    def _load_tracked(self) -> None:
        try:
            with open(os.path.join(self.path, OFFSETS_FILE), "rb") as f:
                data = json.loads(f.read())
            offsets = data["offsets"] if data.get("version") == 1 else {}
            self.tracked = {str(k): int(v) for k, v in offsets.items()}
        except FileNotFoundError:
            pass
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            log.warning("stream %s: unreadable %s file ignored", self.path, OFFSETS_FILE, exc_info=True)

    def _write_tracked(self, blob: bytes) -> None:
        target = os.path.join(self.path, OFFSETS_FILE)
        tmp = target + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, blob)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target)
        if write_observer.current is not None:
            write_observer.current.replace(target, blob)

    # ------------------------------------------------------------ durability
    def sync(self, acks: bool = True) -> None:
        """Make appends, new/removed segments and tracked offsets durable. Safe from a worker thread.
        ``acks`` is QueueStore.sync's: a stream has no ack files, every round syncs all of it."""
        with self._lock:
            if self._closed:
                return
            fds = self._sync_fds
            self._sync_fds = []
            owned = len(fds)
            wseg_no, wseg_used = None, 0
            if self._wdirty:
                wseg = self._segs[-1]
                fds.append(wseg.fd)
                self._wdirty = False
                wseg_no, wseg_used = wseg.no, wseg.used
            mark, mark_fd, mark_fsync, newly_named = self._synced.begin(wseg_no, wseg_used)
            if mark_fsync >= 0:
                fds.append(mark_fsync)
            self._dir_dirty = self._dir_dirty or newly_named
            blob = self._tracked_blob
            self._tracked_blob = None
            dir_dirty = self._dir_dirty or blob is not None
            self._dir_dirty = False
            self._syncing += 1
        done = False
        try:
            for fd in fds:
                os.fdatasync(fd)
            if blob is not None:
                self._write_tracked(blob)
            if dir_dirty:
                os.fsync(self._dir_fd)
            self._sync_parents()
            self._synced.write(mark, mark_fd)
            done = True
        finally:
            with self._lock:
                self._synced.end(mark, mark_fd, done)
                if done:
                    self._defer_close(fds[:owned])
                else:
                    self._sync_fds[:0] = fds[:owned]
                    self._wdirty = True
                    self._dir_dirty = self._dir_dirty or dir_dirty
                    if blob is not None and self._tracked_blob is None:
                        self._tracked_blob = blob
                self._syncing -= 1
                if not self._syncing:
                    self._close_deferred()
            if mark_fd >= 0:
                os.close(mark_fd)

    def close(self) -> None:
        """Release maps and fds. Does not sync the log, but writes tracked offsets not yet written."""
        if self._closed:
            return
        if self._tracked_changed or self._tracked_blob is not None:
            try:
                self._write_tracked(self._tracked_json())
            except OSError:
                log.warning("stream %s: tracked offsets not saved", self.path, exc_info=True)
            self._tracked_changed = False
            self._tracked_blob = None
        for seg in self._segs:
            seg.close_map()
        with self._lock:
            self._closed = True
            fds = [seg.fd for seg in self._segs if seg.fd >= 0]
            fds.extend(self._sync_fds)
            fds.append(self._dir_fd)
            self._sync_fds = []
            self._release(fds)
        self._cursors.clear()

    def delete(self) -> None:
        self._tracked_changed = False  # the directory goes: nothing to save on close
        self._tracked_blob = None
        super().delete()

    # ------------------------------------------------------------ recovery
    def _recover(self) -> None:
        """Load the segments; never raises on garbage files (the node must start)."""
        found: dict[str, set[int]] = {"msgs": set(), "smeta": set()}
        for name in os.listdir(self.path):
            parsed = _parse(name)
            if parsed is not None:
                found[parsed[0]].add(parsed[1])
            elif temp_files.is_temp(name):  # an offsets rewrite or a name file a killed writer left
                temp_files.remove_found(self.path, name)
        for no in found["smeta"] - found["msgs"]:
            self._unlink(_name("smeta", no))  # left by a crash while removing a segment
        msgs = sorted(found["msgs"])
        # First offsets from the smeta files: a segment's count is known from the next one's first
        # offset even when its own final smeta is missing, so damage there keeps the offsets.
        firsts: dict[int, int] = {}
        for no in msgs:
            meta = StreamSegment(self.path, no).read_smeta()
            if meta is not None:
                firsts[no] = meta[1]
        expect = 0  # first offset of the next segment, from the previous one
        for i, no in enumerate(msgs):
            last = i == len(msgs) - 1
            try:
                seg = self._recover_segment(no, last, expect, None if last else firsts.get(msgs[i + 1]))
            except Exception:
                log.warning("stream %s: segment %d unreadable, set aside", self.path, no, exc_info=True)
                self._set_aside(no)
                continue
            if seg is None:
                continue
            expect = seg.first + seg.count
            if not seg.sealed and not last:
                seg.sealed = True
            self._segs.append(seg)
        if not self._segs or self._segs[-1].sealed:
            no = (msgs[-1] if msgs else 0) + 1
            self._segs.append(self._create(no, expect, self._segment_size))
        mark = synced_mark.read(self.path)
        if mark is not None and mark[0] != self._segs[-1].no:
            self._unlink(synced_mark.NAME)  # stale (see QueueStore._recover)
            self._dir_dirty = True
        self._firsts = [s.first for s in self._segs]
        self.count = sum(s.count for s in self._segs)
        self.bytes = sum(s.used - DATA_START for s in self._segs)

    def _recover_segment(self, no: int, last: bool, expect: int, next_first: int | None) -> StreamSegment | None:
        seg = StreamSegment(self.path, no)
        msgs_path = seg.path("msgs")
        size = os.stat(msgs_path).st_size
        version = -1
        if size >= DATA_START:
            with open(msgs_path, "rb") as f:
                version = VERSION_HEADER.unpack(f.read(DATA_START))[0]
        meta = seg.read_smeta()
        first = meta[1] if meta is not None else expect
        if version != FORMAT_VERSION:
            if last and (size < DATA_START or version == 0):
                log.warning("stream %s: empty segment %d reinitialized", self.path, no)
                self._dir_dirty = True
                return self._create(no, first, self._segment_size)
            log.warning("stream %s: segment %d has unknown format version %d, set aside", self.path, no, version)
            self._set_aside(no)
            return None
        seg.first = first
        if meta is not None and meta[0] and DATA_START <= meta[3] <= size:
            _sealed, seg.first, seg.count, seg.used, seg.first_ts, seg.last_ts, seg.body_bytes = meta
            seg.sealed = True
            seg.size = seg.used
            seg.unverified = True  # CRC-checked when first read (_map), not at every start
            return seg
        if last:
            seg.open_mapped(writable=True)
            cut = self._load(seg, size, False, None, min(synced_mark.synced_end(self.path, no), size))
            if cut or size < self._segment_size:
                seg.regrow(max(size, self._segment_size))
                self._wdirty = True
            if meta is None:
                self._sync_fds.append(seg.write_smeta())
                self._dir_dirty = True
            return seg
        # Sealed (not the last) but its final smeta never got written: scan, cut, write it.
        seg.map_readonly()
        known = next_first - seg.first if next_first is not None and next_first >= seg.first else None
        self._load(seg, size, True, known)
        seg.close_map()
        if seg.used < size:
            os.truncate(msgs_path, seg.used)
        seg.sealed = True
        seg.size = seg.used
        self._sync_fds.append(seg.write_smeta())
        self._dir_dirty = True
        return seg

    def _load(self, seg: StreamSegment, end: int, sealed: bool, known: int | None, synced: int = 0) -> bool:
        """Scan `seg` up to `end` with CRC checks: count its offsets, repair damage, cut a torn tail.

        The rules are QueueStore's (docs/storage.md): a bad record followed by valid ones, or any
        bad record of a sealed segment, is damage: its bytes are copied aside and overwritten by
        one filler record that stands for as many offsets as the damaged bytes held (from their
        length fields, else from `known`, the segment's offset count from its smeta or the next
        segment's first offset, else one), so every valid record keeps its offset. A bad record of
        the write segment with nothing valid after it is a torn tail (never confirmed): cut, unless
        it starts before `synced` (the synced mark: confirmed), which makes it damage up to the mark,
        as is a clean end of data before the mark. Sets used, count, body_bytes and the timestamps; returns whether the file changed.
        """
        mm = seg.mm
        count = valid = body = 0
        first_ts = last_ts = 0
        regions: list[tuple[int, int, str, int | None, int]] = []  # start, stop, reason, records, offset
        pos = DATA_START
        cut = False
        while True:
            result = record.ScanResult()
            for p, flags, blen in record.scan(mm, pos, end, True, result):
                ts = _unpack_u64(mm, p + _HEADER_SIZE)[0]
                if flags & _FILLER:  # repaired by an earlier recovery: its ts field is its offset count
                    count += max(ts, 1)
                    continue
                if not valid:
                    first_ts = ts
                last_ts = ts
                valid += 1
                count += 1
                body += blen
            if not result.reason:
                if result.end >= synced:
                    break
                result.reason = f"end of data at {result.end} before the synced position {synced}"
            bad = result.end
            nxt = record.resync(mm, bad, end)
            stop = nxt if nxt >= 0 else end
            if nxt < 0 and not sealed and bad < synced:
                stop = synced  # damage up to the mark; what follows it was never synced: a tail
            if (nxt < 0 and not sealed and bad >= synced) or stop - bad < record.MIN_RECORD:
                if bad < synced:
                    # Synced bytes too few for a filler (the file was cut below the mark): lost, and said so.
                    self.damaged_records += 1
                    log.error("stream %s: segment %d: %s before the synced position %d; cut %d bytes from "
                              "there: confirmed data lost", self.path, seg.no, result.reason, synced, end - bad)
                else:
                    log.warning("stream %s: segment %d: %s; cut %d bytes from there (a torn tail: never "
                                "confirmed)", self.path, seg.no, result.reason, end - bad)
                cut = True
                break
            regions.append((bad, stop, result.reason, record.chain_count(mm, bad, stop), count))
            result.end = stop
            if nxt < 0:
                break
            pos = nxt
        if regions:
            unknown = [i for i, r in enumerate(regions) if r[3] is None]
            ks = [1 if r[3] is None else r[3] for r in regions]
            if known is not None:
                missing = known - count - sum(ks)
                if unknown:
                    ks[unknown[-1]] += max(0, missing)
                elif missing and len(ks) == 1:
                    ks[0] = max(1, ks[0] + missing)
            before = 0
            for (bad, stop, reason, _n, at), k in zip(regions, ks, strict=True):
                aside = self._replace_damaged(seg, bad, stop, record.filler(stop - bad, k))
                first = seg.first + at + before
                log.error("stream %s: segment %d: %s; damaged bytes %d..%d (%d) copied to %s and skipped: "
                          "offsets %d..%d lost", self.path, seg.no, reason, bad, stop, stop - bad, aside,
                          first, first + k - 1)
                before += k
            count += before
            self.damaged_records += before
            log.error("stream %s: segment %d: %d damaged record(s) lost in %d region(s)%s; %d valid records kept",
                      self.path, seg.no, before, len(regions),
                      "" if known is not None or not unknown else " (at least: a length field was damaged)", valid)
        seg.used = result.end
        seg.count, seg.body_bytes, seg.first_ts, seg.last_ts = count, body, first_ts, last_ts
        return cut or bool(regions)
