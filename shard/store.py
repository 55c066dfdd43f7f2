"""Durable storage of one queue: append-only mmap'd segments plus ack files.

Memory does not depend on queue length: the store keeps a read cursor
(segment, position), a heap of requeued ids, per-segment counts and, for
segments with removed records, a small bitmap of removed positions. Outstanding
(delivered, unacked) messages are tracked by the caller: `ack` and `requeue`
take only ids that `shift` returned and that were neither acked nor requeued since.

Threading: everything runs on the owner's event loop thread except `sync()`,
which may run in a worker thread concurrently with appends and acks. The lock
covers only the bookkeeping of which files need syncing and which fds to close.
"""

from __future__ import annotations

import hashlib
import heapq
import logging
import os
import struct
import threading

from broker import temp_files, write_observer
from shard import dirty_stores, record, synced_mark
from shard.segment import (
    ACKS_MAGIC,
    DATA_START,
    FORMAT_VERSION,
    PLACEHOLDER,
    VERSION_HEADER,
    PositionSet,
    Segment,
    encode_acks,
    parse_name,
    read_ack_entries,
)
from shard.segment_dir import SegmentDir, claim_path, set_aside

log = logging.getLogger(__name__)

Message = tuple[int, bool, int, int, str, str, bytes, bytes]
Record = tuple[int, int, str, str, bytes, bytes]

_POS_MASK = 0xFFFFFFFF
# u64 LE msg id: the read cursor's highest position so far (see QueueStore.__init__).
DELIVERED_MARK = "delivered"
_encode_payload = record.encode_payload
_write_record = record.write
_read_record = record.read
_HEADER_SIZE = record.HEADER_SIZE


def _sha1(name: str) -> str:
    return hashlib.sha1(name.encode()).hexdigest()


def _write_name_file(path: str, name: str, new: bool = False) -> None:
    """tmp + rename, not fsynced here: the store's first sync (SegmentDir._sync_parents, in the sync
    thread, before the first confirm into the queue) makes it durable; a queue that never held a
    message may lose it in a crash, and queue_dir() writes it again at the next open. ``new``: the
    directory was just made, there is nothing to compare with."""
    if not new:
        # Opening 100,000 queues at boot checks this file for each: one stat, not open+read+close.
        # The file is only ever replaced whole (tmp + rename) and named by the sha1 of its content's
        # name, so the right size means the right name; an empty one (lost in a crash) is rewritten.
        try:
            if os.stat(path).st_size == len(name.encode()):
                return
        except OSError:
            pass
    # Per process: both shards write a new vhost's .vhost when each opens its first queue of it.
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(name)
    os.replace(tmp, path)
    if write_observer.current is not None:
        write_observer.current.replace(path, name.encode())


def _write_acks(seg: Segment, fd: int, blob: bytes) -> None:
    """Append ack positions to the segment's ack file (O_APPEND) and report where they went."""
    os.write(fd, blob)
    obs = write_observer.current
    if obs is not None:
        obs.append(seg.path("acks"), os.fstat(fd).st_size - len(blob), blob)


def _all_zero(path: str) -> bool:
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            if chunk.count(0) != len(chunk):
                return False
    return True


# Vhost dirs this process has made sure of (with their .vhost file): opening 100,000 queues of a
# vhost at boot checks the vhost dir once, not per queue.
_vhost_dirs: set[str] = set()
# (data dir, vhost) -> the vhost's directory: one sha1 and join per vhost, not per queue opened.
_vhost_paths: dict[tuple[str, str], str] = {}


def queue_dir(data_dir: str, vhost: str, name: str) -> str:
    """`<data_dir>/<sha1(vhost)>/<sha1(name)>/`, created, with its `.vhost` and `.queue` name files."""
    return make_queue_dir(data_dir, vhost, name)[0]


def make_queue_dir(data_dir: str, vhost: str, name: str, exists: bool = False,
                   new: bool = False, name_sha1: str | None = None, idle: bool = False) -> tuple[str, bool]:
    """queue_dir(), and whether the directory was made now (then it is empty: nothing to recover).
    exists: the caller has just seen the directory (a shard's boot lists each vhost dir once).
    new: a queue declared now, which starts empty: a directory already there was left by a deleted
    queue of that name whose removal never came (its shard died first) and is set aside, never
    taken over (its messages would come back). The node places such a declare on the deleted
    queue's shard while that shard may still use the directory (broker/queue_leftovers.py).
    name_sha1: sha1(name) when the caller has it (a boot: it looked the queue up in the listing).
    idle: the directory is unchanged since a clean stop found its name file in it (shard/idle_index.py):
    not checked again."""
    vdir = _vhost_paths.get((data_dir, vhost))
    if vdir is None:
        vdir = _vhost_paths[(data_dir, vhost)] = os.path.join(data_dir, _sha1(vhost))
    qdir = f"{vdir}/{name_sha1 or _sha1(name)}"  # os.path.join costs more, 100,000 times at a boot
    if vdir not in _vhost_dirs:
        os.makedirs(vdir, exist_ok=True)
        _write_name_file(os.path.join(vdir, ".vhost"), vhost)
        _vhost_dirs.add(vdir)
    made = False
    if not exists:
        claim_path(qdir)  # a deletion of the same name still waiting in the reaper goes first
        try:
            os.mkdir(qdir)
            made = True
        except FileExistsError:
            if new:
                log.warning("queue %r of vhost %r: set aside the directory a deleted queue of that name "
                            "left behind (%s)", name, vhost, qdir)
                set_aside(qdir)
                return make_queue_dir(data_dir, vhost, name, new=new)
        except FileNotFoundError:  # the vhost dir went away (vhost deleted) since we made sure of it
            _vhost_dirs.discard(vdir)
            return make_queue_dir(data_dir, vhost, name, new=new)
    if not idle:
        _write_name_file(f"{qdir}/.queue", name, new=made)
    return qdir, made


# Every QueueStore of the process shares one lock: its critical sections are a few attribute updates
# (and an open() at most) between the event loop and the sync thread, and never nest, so one lock
# serves as well as 100,000 (88 bytes each).
_STORE_LOCK = threading.Lock()
# What an idle store holds instead of containers of its own (an empty queue must cost little: issue
# #15 measured ~4 KB per empty queue in a shard). Never mutated: the code replaces them with a new
# dict/list/set on first use (see ack, requeue, _track_fd, _sync_later).
_NO_ACKS: dict = {}
_NO_SEGS: dict = {}  # the segments of a store that never held a message (its write segment: a placeholder)
# A purge replaces the write segment by a fresh one (rather than ack its ready records one by one)
# from this many on: below it, the walk costs less than making a segment file and deleting one.
_PURGE_WHOLE_MIN = 256
_FIRST_END = PLACEHOLDER.no << 32 | PLACEHOLDER.used  # an empty store's mark: one int for all of them


class QueueStore(SegmentDir):
    """The messages of one queue on disk. See the module docstring and docs/storage.md."""

    SEGMENT_KINDS = ("msgs", "acks", "meta")
    # Slots, not an instance dict: with more than 30 attributes CPython gives each instance a dict
    # of its own (no shared keys), ~1.5 KB per queue.
    __slots__ = (
        "path", "fsync", "_segment_size", "_keep_transient", "_segs", "_requeued", "requeue_watch",
        "_ready", "_ready_bytes", "n_redelivered", "_closed", "_lock", "_wdirty", "_acks_dirty",
        "_dir_dirty_v", "_sync_fds", "_ack_fds", "_ack_pending", "_syncing", "_deferred_close", "_synced",
        "damaged_records", "damaged_acks", "_dir_fd", "_wseg", "_rseg", "_rpos", "_mark_fd", "_mark",
        "_redeliver_below", "_parents_synced", "_mark_failed",
    )

    def __init__(self, path: str, *, segment_size: int = 8 << 20, keep_transient: bool = False,
                 empty_dir: bool = False, fsync: bool = True) -> None:
        """empty_dir: the caller has just made the (empty) directory: skip looking for files in it
        (a declare of a new queue then costs its mkdir and name file only).
        fsync=False: a non-durable queue's store, whose sync() only closes what it may close and
        never fsyncs: the node deletes such a queue's directory at its next start (a power loss
        takes nothing anyone could get back), and a killed shard finds its writes in the page
        cache without an fsync."""
        self.path = path
        self.fsync = fsync
        self._segment_size = max(int(segment_size), DATA_START + record.MIN_RECORD)
        self._keep_transient = keep_transient
        self._segs: dict[int, Segment] = {}
        self._requeued: list[int] | tuple[()] = ()  # heap of msg ids (a list from the first requeue)
        # Ids requeued since the last consumer-timeout scan, while shard/ack_timeouts.py tracks this queue.
        self.requeue_watch: set[int] | None = None
        self._ready = 0
        self._ready_bytes = 0
        self.n_redelivered = 0  # requeued messages taken again, in total (shard/stats.py)
        self._closed = False
        # sync bookkeeping, guarded by _lock (flags are set lock-free, cleared under it before syncing)
        self._lock = _STORE_LOCK
        self._wdirty = False  # appends to the write segment since the last sync
        self._acks_dirty = False  # acks written since the last sync
        self._dir_dirty = False  # files created or removed since the last sync
        # Sealed msgs fds and meta fds: sync them, then close them (a list once there is one).
        self._sync_fds: list[int] | tuple[()] = ()
        self._ack_fds: set[int] | tuple[()] = ()  # ack files and the delivered mark (a set once opened)
        self._ack_pending: dict[Segment, list[int]] = _NO_ACKS  # acks not yet written (see flush_acks)
        self._syncing = 0
        self._deferred_close: list[int] | tuple[()] = ()
        # The synced mark (shard/synced_mark.py), made by the first sync that fsyncs.
        self._synced: synced_mark.SyncedMark | None = None
        self._parents_synced = False
        # Records lost to damage (skipped, their bytes set aside; see docs/storage.md) since opened.
        self.damaged_records = 0
        self.damaged_acks = 0  # ack entries that failed their checksum
        # Opened when a sync has a directory change to make durable: 100,000 idle queues hold no fd.
        self._dir_fd = -1
        if empty_dir:
            self._wseg = PLACEHOLDER  # an empty store's (see _recover)
            self._segs = _NO_SEGS
        else:
            self._recover()
        # The read cursor: segment and position of the next unread record.
        self._rseg = self._segs[min(self._segs)] if self._segs else self._wseg
        self._rpos = DATA_START
        if self._rseg.mm is None and self._wseg.fd >= 0:  # fd -1: the placeholder, no file to map
            self._map(self._rseg)
        # Where the read cursor was when this store was last used (DELIVERED_MARK): every message
        # before it may have been delivered and not acked when the shard stopped, so it comes back
        # with redelivered=true, as RabbitMQ's queue index marks delivered messages. Clamped to the
        # end of the data: ids of messages appended from now on are never below it.
        self._mark_fd = -1
        self._mark_failed = False  # the last mark write failed: the store stays dirty until one succeeds
        end = self._wseg.no << 32 | self._wseg.used
        if end == _FIRST_END:
            end = _FIRST_END
        if self._wseg.fd < 0:
            # No message was ever stored (placeholder segment): nothing to redeliver, no mark to
            # write (writing it would hold a file open per idle queue).
            self._mark = self._redeliver_below = end
        else:
            self._mark = self._redeliver_below = min(self._read_mark(), end)  # the mark never moves back
        if self.dirty:  # recovery repaired or rewrote something: the periodic sync makes it durable
            dirty_stores.note(self)

    @property
    def never_written(self) -> bool:
        """Empty and without a file of its own: opened empty (its placeholder write segment) and
        nothing appended since (shard/idle_index.py)."""
        return self._wseg is PLACEHOLDER and self._segs is _NO_SEGS

    # ------------------------------------------------------------ counters
    @property
    def ready(self) -> int:
        return self._ready

    @property
    def ready_bytes(self) -> int:
        return self._ready_bytes

    @property
    def dirty(self) -> bool:
        return (self._wdirty or self._acks_dirty or self._dir_dirty or bool(self._sync_fds)
                or bool(self._ack_pending) or self._mark_failed)

    # ------------------------------------------------------------ hot path
    def append(
        self, ts_ms: int, flags: int, exchange: str, routing_key: str, props_raw: bytes, body: bytes
    ) -> int:
        """Store a message; returns its msg_id (segment_no << 32 | position)."""
        payload = _encode_payload(ts_ms, flags, exchange.encode(), routing_key.encode(), props_raw, body)
        total = _HEADER_SIZE + len(payload)
        seg = self._wseg
        pos = seg.used
        if pos + total > seg.alloc_end:
            if seg.fd < 0:  # a fresh queue's first message: its segment file is made now
                seg = self._materialize(total)
            if pos + total > seg.size:
                seg = self._roll(total)
                pos = seg.used
            if pos + total > seg.alloc_end:
                seg.reserve(pos + total)
        _write_record(seg.mm, pos, payload)
        seg.used = pos + total
        obs = write_observer.current
        if obs is not None:
            obs.append(seg.msgs_path, pos, seg.mm[pos:pos + total])
        seg.count += 1
        seg.live += 1
        n = len(body)
        seg.body_bytes += n
        if not flags & 1:
            seg.transient += 1
        self._ready += 1
        self._ready_bytes += n
        if not self._wdirty:
            self._wdirty = True
            dirty_stores.note(self)  # once per sync, not per append (shard/dirty_stores.py)
        return seg.no << 32 | pos

    def shift(self) -> Message | None:
        """Take the next ready message (requeued first, in id order; then in append order)."""
        if self._requeued:
            msg_id = heapq.heappop(self._requeued)
            seg = self._segs[msg_id >> 32]
            if seg.mm is None:
                self._map(seg)
            ts, flags, ex, rk, props, body, _ = _read_record(seg.mm, msg_id & _POS_MASK)
            redelivered = True
            self.n_redelivered += 1  # message_stats.redeliver (requeued ones; not those marked at boot)
        else:
            seg = self._rseg
            pos = self._rpos
            if pos >= seg.used or seg.skip_acked:
                msg_id = self._head()
                if msg_id < 0:
                    return None
                seg = self._rseg
                pos = self._rpos
            else:
                msg_id = seg.no << 32 | pos
            ts, flags, ex, rk, props, body, self._rpos = _read_record(seg.mm, pos)
            redelivered = msg_id < self._redeliver_below
        self._ready -= 1
        self._ready_bytes -= len(body)
        return msg_id, redelivered, ts, flags, ex, rk, props, body

    def append_taken(
        self, ts_ms: int, flags: int, exchange: str, routing_key: str, props_raw: bytes, body: bytes
    ) -> int:
        """Store a message that was delivered without being stored and is still unacked
        (shard/queue.py ``materialize``): appended behind everything and taken by the read cursor at
        once, so it is outstanding, as ``append`` then ``shift`` would have left it. Only valid while
        no unread record is stored (requeued ones may be): the caller stores these before any later
        message is appended. Returns its msg_id."""
        msg_id = self.append(ts_ms, flags, exchange, routing_key, props_raw, body)
        seg = self._rseg
        pos = self._rpos
        if pos >= seg.used or seg.skip_acked:
            head = self._head()
            seg = self._rseg
            pos = self._rpos
        else:
            head = seg.no << 32 | pos
        if head != msg_id:  # an unread record before it: the caller broke the rule above
            raise RuntimeError(f"queue {self.path}: append_taken behind unread record {head:#x}")
        self._rpos = record.skip(seg.mm, pos)
        self._ready -= 1
        self._ready_bytes -= len(body)
        return msg_id

    def ack(self, msg_id: int) -> bool:
        """Remove an outstanding message for good. False if it was not delivered or is already gone."""
        seg = self._segs.get(msg_id >> 32)
        if seg is None or msg_id >= (self._rseg.no << 32 | self._rpos):
            return False
        pos = msg_id & _POS_MASK
        acked = seg.acked
        if acked is None:
            acked = seg.acked = PositionSet(seg.size)
        elif pos in acked:
            return False
        acked.add(pos)
        # Positions reach the ack file in flush_acks (once per loop turn), not one write per ack.
        pending = self._ack_pending
        pend = pending.get(seg)
        if pend is None:
            if pending is _NO_ACKS:
                pending = self._ack_pending = {}
            pending[seg] = [pos]
            dirty_stores.note(self)  # the first ack of this segment since flush_acks
        else:
            pend.append(pos)
        seg.live -= 1
        if seg.live == 0 and seg.sealed:
            self._drop(seg)
        return True

    def requeue(self, msg_id: int) -> bool:
        """Make an outstanding message ready again (delivered before the cursor, redelivered=True)."""
        seg = self._segs.get(msg_id >> 32)
        if seg is None or msg_id >= (self._rseg.no << 32 | self._rpos):
            return False
        pos = msg_id & _POS_MASK
        if seg.acked is not None and pos in seg.acked:
            return False
        if seg.mm is None:
            self._map(seg)
        requeued = self._requeued
        if not requeued:
            requeued = self._requeued = []
        heapq.heappush(requeued, msg_id)
        if self.requeue_watch is not None:
            self.requeue_watch.add(msg_id)
        self._ready += 1
        self._ready_bytes += record.body_len(seg.mm, pos)
        return True

    # ------------------------------------------------------------ other operations
    def peek(self) -> Message | None:
        """The message `shift` would return, without taking it."""
        if self._requeued:
            msg_id = self._requeued[0]
            redelivered = True
        else:
            msg_id = self._head()
            if msg_id < 0:
                return None
            redelivered = msg_id < self._redeliver_below
        return (msg_id, redelivered, *self.read(msg_id))

    def drop_head(self) -> Message | None:
        """Remove the head ready message for good and return it (for max-length overflow)."""
        msg = self.shift()
        if msg is not None:
            self.ack(msg[0])
        return msg

    def holds(self, msg_id: int) -> bool:
        """True while the message is stored and not removed (ready or outstanding)."""
        seg = self._segs.get(msg_id >> 32)
        if seg is None:
            return False
        pos = msg_id & _POS_MASK
        if pos < DATA_START or pos >= seg.used:
            return False
        return seg.acked is None or pos not in seg.acked

    def mark(self) -> int:
        """A point in append order: messages appended later have ids >= it (see `after`)."""
        wseg = self._wseg
        return wseg.no << 32 | wseg.used

    def after(self, msg_id: int, mark: int) -> bool:
        """Whether `msg_id` was appended after `mark` was taken (PriorityStore needs more than `>=`)."""
        return msg_id >= mark

    def read(self, msg_id: int) -> Record:
        """(ts_ms, flags, exchange, routing_key, props_raw, body) of a stored record; KeyError if gone."""
        seg = self._segs[msg_id >> 32]
        pos = msg_id & _POS_MASK
        if pos < DATA_START or pos >= seg.used:
            raise KeyError(msg_id)
        if seg.mm is None:
            self._map(seg)
        return _read_record(seg.mm, pos)[:6]

    def purge(self) -> int:
        """Remove every ready message (outstanding ones stay); returns how many were removed.

        A segment that holds ready messages only goes whole (its files deleted; the write segment
        is replaced by a fresh one first, when it holds at least _PURGE_WHOLE_MIN): no ack per
        record, no walk over its records. The bench's delete-stall probe purges 10,000 ready messages
        of its write segment: 6-19 ms of the shard's loop CPU in one piece (a walk, 10,000 ack
        positions written), now 1.5-1.7 ms (a file made, one deleted; docs/storage.md). Only a
        segment that also holds outstanding (delivered, unacked) messages is walked, from the read
        cursor on, as before."""
        removed = 0
        by_seg: dict[int, list[int]] = {}
        for msg_id in self._requeued:
            by_seg.setdefault(msg_id >> 32, []).append(msg_id & _POS_MASK)
        self._requeued = ()
        for no, positions in by_seg.items():
            removed += self._remove_many(self._segs[no], positions)
        first = self._rseg
        pos = self._rpos
        segs = self._segs
        nos = sorted(no for no in segs if no >= first.no)
        for no in nos:
            if segs[no].unverified:
                self._map(segs[no])  # CRC-checked first: damage found corrects its count before it is read
        # Ready records from the cursor on: those of `first` after it, and every live one of the later
        # segments. When they are all of first's live records, nothing outstanding is in it.
        later = sum(segs[no].live for no in nos if no > first.no)
        first_whole = first.live == self._ready - removed - later
        for no in nos:
            seg = segs.get(no)
            if seg is None:
                continue
            whole = seg is not first or first_whole
            if whole and seg is self._wseg:
                whole = seg.live >= _PURGE_WHOLE_MIN and self._replace_write_segment()
            if whole:
                removed += seg.live
                seg.live = 0
                self._drop(seg)
                continue
            positions = []
            acked = seg.acked
            if seg.mm is None:
                self._map(seg)
            mm = seg.mm
            used = seg.used
            p = pos if seg is first else DATA_START
            while p < used:
                if acked is None or p not in acked:
                    positions.append(p)
                p = record.skip(mm, p)
            removed += self._remove_many(seg, positions)
        wseg = self._wseg
        self._rseg = wseg
        self._rpos = wseg.used
        self._ready = 0
        self._ready_bytes = 0
        return removed

    def _replace_write_segment(self) -> bool:
        """A fresh write segment in place of the current one, whose records all go (purge). False
        when it cannot be made (no space): the caller removes them one by one instead."""
        old = self._wseg
        if old.fd < 0:
            return False  # the placeholder: nothing stored
        try:
            new = Segment.create(self.path, old.no + 1, self._segment_size)
        except OSError:
            return False
        with self._lock:
            self._segs[new.no] = new
            self._wseg = new
            self._wdirty = True
            self._dir_dirty = True  # notes the store (shard/segment_dir.py)
        return True

    # ------------------------------------------------------------ durability
    def sync(self, acks: bool = True) -> None:
        """Make appends (and with ``acks``, acks and the delivered mark) so far durable. Safe to call
        from a worker thread. acks=False is the confirm path's round: a confirm needs only the
        records durable; ack files stay dirty for a later round with acks (see docs/storage.md)."""
        if not self.fsync:
            self._settle()
            return
        with self._lock:
            if self._closed:
                return
            fds = [*self._sync_fds]
            self._sync_fds = ()
            owned = len(fds)  # these fds are ours to close once synced
            wseg_no, wseg_used = None, 0
            if self._wdirty:
                wseg = self._wseg
                fds.append(wseg.fd)
                self._wdirty = False
                # Everything below `used` is in the page cache now; durable once the fsyncs below ran.
                wseg_no, wseg_used = wseg.no, wseg.used
            synced = self._synced
            if synced is None:
                synced = self._synced = synced_mark.SyncedMark(self.path)
            mark, mark_fd, mark_fsync, newly_named = synced.begin(wseg_no, wseg_used)
            if mark_fsync >= 0:
                fds.append(mark_fsync)
            self._dir_dirty = self._dir_dirty or newly_named
            acks_synced = acks and self._acks_dirty
            if acks_synced:
                fds.extend(self._ack_fds)
                self._acks_dirty = False
            dir_dirty = self._dir_dirty
            self._dir_dirty = False
            # Opened under the lock, so a close() racing with this sync closes it (after the sync).
            dir_fd = self._dirfd() if dir_dirty else -1
            self._syncing += 1
        done = False
        try:
            for fd in fds:
                os.fdatasync(fd)
            if dir_fd >= 0:
                os.fsync(dir_fd)
            self._sync_parents()
            synced.write(mark, mark_fd)
            done = True
        finally:
            with self._lock:
                synced.end(mark, mark_fd, done)
                if done:
                    self._defer_close(fds[:owned])
                else:
                    # Put it all back so the next sync tries again.
                    self._sync_fds = [*fds[:owned], *self._sync_fds]
                    self._wdirty = True
                    self._acks_dirty = self._acks_dirty or acks_synced
                    self._dir_dirty = self._dir_dirty or dir_dirty
                self._syncing -= 1
                if not self._syncing:
                    self._close_deferred()
            if mark_fd >= 0:
                os.close(mark_fd)

    def _settle(self) -> None:
        """sync() of a store that is not fsynced: what a sync does besides the fsyncs (close the
        sealed segments' fds, clear the dirty flags), cheap enough for the event loop. No synced
        mark: it would vouch for data that was never made durable; recovery after a killed shard
        then treats a bad last record as a torn tail, as it did before the mark existed."""
        with self._lock:
            if self._closed:
                return
            self._defer_close(self._sync_fds)
            self._sync_fds = ()
            self._wdirty = self._acks_dirty = self._dir_dirty = False
            if not self._syncing:
                self._close_deferred()

    def close(self) -> None:
        """Release maps and fds. Does not sync: call sync() first for a clean shutdown."""
        if self._closed:
            return
        self.flush_acks()
        self._closed = True
        for seg in self._segs.values():
            seg.close_map()
        with self._lock:
            self._closed = True
            fds = [seg.fd for seg in self._segs.values() if seg.fd >= 0]
            fds.extend(self._ack_fds)
            fds.extend(self._sync_fds)
            if self._dir_fd >= 0:
                fds.append(self._dir_fd)
                self._dir_fd = -1
            self._ack_fds = ()
            self._sync_fds = ()
            self._release(fds)
        self._requeued = ()
        self._ready = self._ready_bytes = 0

    # ------------------------------------------------------------ internals
    def _head(self) -> int:
        """Move the cursor onto the next unremoved record; its msg_id, or -1 when there is none."""
        seg = self._rseg
        pos = self._rpos
        wseg = self._wseg
        while True:
            if pos >= seg.used:
                if seg is wseg:
                    self._rseg, self._rpos = seg, pos
                    return -1
                # Read through: unmap it (requeues map it again) so resident memory stays flat.
                seg.close_map()
                seg = self._next_seg(seg)
                pos = DATA_START
                continue
            acked = seg.acked
            if acked is not None and pos in acked:
                pos = record.skip(seg.mm, pos)
                continue
            self._rseg, self._rpos = seg, pos
            return seg.no << 32 | pos

    def _next_seg(self, seg: Segment) -> Segment:
        segs = self._segs
        for no in range(seg.no + 1, self._wseg.no + 1):
            nxt = segs.get(no)
            if nxt is not None:
                if nxt.mm is None:
                    self._map(nxt)
                return nxt
        raise AssertionError("write segment missing")  # the write segment is never dropped

    def _roll(self, total: int) -> Segment:
        """Seal the write segment and start a new one big enough for a `total`-byte record."""
        old = self._wseg
        need = DATA_START + total
        size = max(self._segment_size, need)
        if old.count == 0:
            # Nothing in it yet (fresh queue, huge first record): just make it bigger.
            old.regrow(size)
            return old
        # Create first: if that fails (no space, no fds) the store is unchanged and can go on.
        new = Segment.create(self.path, old.no + 1, size)
        with self._lock:
            meta_fd = old.seal()
            self._sync_later(old.fd)
            if meta_fd >= 0:
                self._sync_later(meta_fd)
            old.fd = -1
            self._segs[new.no] = new
            self._wseg = new
            self._wdirty = True
            self._dir_dirty = True  # notes the store (shard/segment_dir.py)
        if old.live == 0:
            self._drop(old)
        elif old is not self._rseg:
            old.close_map()  # mapped again when the cursor or a requeue gets to it
        return new

    def _materialize(self, total: int) -> Segment:
        """Create the file of the placeholder write segment (the only segment of an empty store)."""
        old = self._wseg
        size = max(self._segment_size, DATA_START + total)
        try:
            new = Segment.create(self.path, old.no, size)
        except OSError:
            # A full disk: a segment with room for nothing, so this append (and every one until
            # there is space) is refused by the usual growth path, as for a full segment.
            new = Segment.create(self.path, old.no, DATA_START)
        with self._lock:
            if self._segs is _NO_SEGS:
                self._segs = {}
            self._segs[new.no] = new
            self._wseg = new
            self._dir_dirty = True
        if self._rseg is old:
            self._rseg, self._rpos = new, DATA_START
        return new

    def _open_acks(self, seg: Segment) -> int:
        with self._lock:
            fd = seg.open_acks()
            self._track_fd(fd)
            self._dir_dirty = True
        return fd

    def flush_acks(self) -> None:
        """Write the ack positions collected since the last call (loop thread; before sync()), and
        the delivered mark when the cursor moved (before this turn's deliveries leave the shard)."""
        cursor = self._rseg.no << 32 | self._rpos
        if cursor > self._mark and not self._closed:
            self._write_mark(cursor)
        if not self._ack_pending:
            return
        pending = self._ack_pending
        self._ack_pending = _NO_ACKS
        for seg, positions in pending.items():
            try:
                fd = seg.ack_fd
                if fd < 0:
                    fd = self._open_acks(seg)
                _write_acks(seg, fd, encode_acks(positions))
            except OSError as exc:
                # A full disk: the messages stay removed in memory; their acks are written on a later
                # turn (after a crash meanwhile they come back: at least once, never lost).
                log.warning("queue %s: cannot write acks of segment %d: %s", self.path, seg.no, exc)
                if self._ack_pending is _NO_ACKS:
                    self._ack_pending = {}
                self._ack_pending.setdefault(seg, []).extend(positions)
        if not self._acks_dirty:
            self._acks_dirty = True
            dirty_stores.note(self)

    def _read_mark(self) -> int:
        try:
            with open(os.path.join(self.path, DELIVERED_MARK), "rb") as fh:
                data = fh.read(8)
        except OSError:
            return 0
        return struct.unpack("<Q", data)[0] if len(data) == 8 else 0

    def _write_mark(self, cursor: int) -> None:
        """One pwrite to the page cache (it survives a killed shard); fsynced with the ack files.

        A failing write (the file cannot be opened, EIO) is not fatal, as an ack write's is not: the
        deliveries stand, the mark stays where it was and the store stays dirty, so the periodic sync
        (its flush_acks) tries again each second if no delivery pass does first. Until then a crash
        brings those deliveries back without redelivered set, the one thing the mark is for. It used
        to raise: out of the delivery pass (ending it), out of a basic.get (541), and out of the
        shard's group sync start, which then never ran again (no confirm on the shard any more)."""
        data = struct.pack("<Q", cursor)
        try:
            fd = self._mark_fd
            if fd < 0:
                fd = os.open(os.path.join(self.path, DELIVERED_MARK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                self._mark_fd = fd
                with self._lock:
                    self._track_fd(fd)  # closed by close() with the ack files
                self._dir_dirty = True
            os.pwrite(fd, data, 0)
        except OSError as exc:
            if not self._mark_failed:  # once until a write succeeds: every turn would log it again
                self._mark_failed = True
                log.warning("queue %s: cannot write the delivered mark (%s); retried each second", self.path, exc)
                dirty_stores.note(self)
            return
        if self._mark_failed:
            self._mark_failed = False
            log.warning("queue %s: delivered mark written again", self.path)
        self._mark = cursor
        if write_observer.current is not None:
            write_observer.current.append(os.path.join(self.path, DELIVERED_MARK), 0, data)

    def _remove_many(self, seg: Segment, positions: list[int]) -> int:
        if not positions:
            return 0
        acked = seg.acked
        if acked is None:
            acked = seg.acked = PositionSet(seg.size)
        for pos in positions:
            acked.add(pos)
        fd = seg.ack_fd
        if fd < 0:
            fd = self._open_acks(seg)
        _write_acks(seg, fd, encode_acks(positions))
        if not self._acks_dirty:
            self._acks_dirty = True
            dirty_stores.note(self)
        seg.live -= len(positions)
        if seg.live == 0 and seg.sealed:
            self._drop(seg)
        return len(positions)

    def _drop(self, seg: Segment) -> None:
        """Forget a sealed segment with no live records and delete its files."""
        del self._segs[seg.no]
        self._ack_pending.pop(seg, None)
        if seg is self._rseg:
            self._rseg = self._next_seg(seg)
            self._rpos = DATA_START
        seg.close_map()
        with self._lock:
            fds = []
            if seg.ack_fd >= 0 and self._ack_fds:
                self._ack_fds.discard(seg.ack_fd)
                fds.append(seg.ack_fd)
            if seg.fd >= 0:
                fds.append(seg.fd)
            seg.ack_fd = seg.fd = -1
            self._release(fds)
            self._dir_dirty = True
        seg.unlink()

    # ------------------------------------------------------------ recovery
    def _recover(self) -> None:
        """Load the segments in the dir; never raises on garbage files (the node must start)."""
        found: dict[str, set[int]] = {"msgs": set(), "acks": set(), "meta": set()}
        try:
            names = os.listdir(self.path)
        except FileNotFoundError:
            os.makedirs(self.path)
            names = []
        for name in names:
            parsed = parse_name(name)
            if parsed is not None:
                found[parsed[0]].add(parsed[1])
            elif temp_files.is_temp(name):  # a rewrite of the acks or the name file a killed writer left
                temp_files.remove_found(self.path, name)  # (no writer of this directory runs during recovery)
        msgs = sorted(found["msgs"])
        for kind in ("acks", "meta"):
            for no in found[kind] - found["msgs"]:
                # Left behind by a crash while deleting a fully acked segment.
                self._unlink(f"{kind}.{no:010d}")
        wseg: Segment | None = None
        for i, no in enumerate(msgs):
            last = i == len(msgs) - 1
            try:
                seg = self._recover_segment(no, last)
            except Exception:
                log.warning("queue %s: segment %d unreadable, set aside", self.path, no, exc_info=True)
                self._set_aside(no)
                continue
            if seg is None:
                continue
            if seg.sealed and seg.live == 0:
                seg.close_map()
                if seg.fd >= 0:
                    os.close(seg.fd)
                seg.unlink()
                self._dir_dirty = True
                continue
            self._segs[no] = seg
            if not seg.sealed:
                wseg = seg
        if wseg is None and not self._segs:
            # Empty queue: a placeholder write segment without a file (fd -1, nothing allocated),
            # not in _segs; the first append creates the file (_materialize). Declaring a queue
            # then costs a directory and its name file, no segment, no allocation and no sync.
            no = (msgs[-1] if msgs else 0) + 1
            wseg = PLACEHOLDER if no == PLACEHOLDER.no else Segment(self.path, no)
            self._segs = _NO_SEGS
        if wseg is None:
            no = (msgs[-1] if msgs else 0) + 1
            try:
                wseg = Segment.create(self.path, no, self._segment_size)
            except OSError as exc:
                # A full disk must not make a queue unusable (or its declare fail): a segment with
                # room for nothing, so every append tries to grow it and is refused until there is space.
                log.warning("queue %s: cannot allocate segment %d (%s): publishes are refused until "
                            "there is space", self.path, no, exc)
                wseg = Segment.create(self.path, no, DATA_START)
            self._segs[no] = wseg
            self._dir_dirty = True
        self._wseg = wseg
        mark = synced_mark.read(self.path) if synced_mark.NAME in names else None
        if mark is not None and (mark[0] != wseg.no or wseg.fd < 0):
            # Names a segment that is no longer the write segment: useless, and harmful once segment
            # numbers start again from 1 (an emptied queue) and reach that number with other data.
            self._unlink(synced_mark.NAME)
            self._dir_dirty = True

    def _recover_segment(self, no: int, last: bool) -> Segment | None:
        seg = Segment(self.path, no)
        size = os.stat(seg.path("msgs")).st_size
        version = -1
        if size >= DATA_START:
            with open(seg.path("msgs"), "rb") as f:
                version = VERSION_HEADER.unpack(f.read(DATA_START))[0]
        if version != FORMAT_VERSION:
            if last and (size < DATA_START or (version == 0 and _all_zero(seg.path("msgs")))):
                # Created but never written (crash right after creation): start it afresh.
                log.warning("queue %s: empty segment %d reinitialized", self.path, no)
                for kind in ("acks", "meta"):
                    self._unlink(f"{kind}.{no:010d}")
                self._dir_dirty = True
                return Segment.create(self.path, no, self._segment_size)
            log.warning("queue %s: segment %d has unknown format version %d, set aside", self.path, no, version)
            self._set_aside(no)
            return None
        meta = seg.read_meta()
        if meta is not None and not (DATA_START <= meta.used <= size and meta.count <= meta.used):
            meta = None
        entries, bad, old_format = read_ack_entries(seg.path("acks"), repair=True)
        raw_acks = set(entries)
        if bad:
            # Which records those entries named is unknown: they stay (at least once, never lost).
            self.damaged_acks += bad
            log.error("queue %s: segment %d: %d damaged ack entries ignored (their messages may be "
                      "delivered again)", self.path, no, bad)
        if bad or old_format:
            self._rewrite_acks(seg, sorted(raw_acks))  # version 2, without the damaged entries
        if meta is not None:
            seg.sealed = True
            seg.used = meta.used
            seg.count, seg.transient, seg.body_bytes = meta.count, meta.transient, meta.body_bytes
            if not raw_acks and (self._keep_transient or not meta.transient):
                seg.size = meta.used
                seg.live = meta.count
                seg.unverified = True  # CRC-checked when first read (_map), not at every start
                self._ready += meta.count
                self._ready_bytes += meta.body_bytes
                return seg
            seg.map_readonly()
            if self._load_records(seg, raw_acks, verify=True, end=meta.used, expected=meta.count):
                self._rewrite_meta(seg)
            return seg
        if last:
            seg.open_mapped(writable=True)
            cut = self._load_records(seg, raw_acks, verify=True, end=size,
                                     synced=min(synced_mark.synced_end(self.path, no), size))
            try:
                # Always (re)allocate: a write segment of an older version is sparse, and a store
                # into an unallocated page on a full disk would be a SIGBUS.
                seg.regrow(max(size, self._segment_size))
                self._wdirty = self._wdirty or cut or size < self._segment_size
            except OSError as exc:
                log.warning("queue %s: cannot allocate segment %d (%s): publishes are refused until "
                            "there is space", self.path, no, exc)
            return seg
        # Sealed (it is not the last) but its meta never got written: scan it, then write the meta.
        seg.map_readonly()
        seg.sealed = True
        self._load_records(seg, raw_acks, verify=True, end=size)
        if seg.used < size:
            os.truncate(seg.path("msgs"), seg.used)
        meta_fd = seg.write_meta()
        if meta_fd >= 0:
            self._sync_later(meta_fd)
        self._dir_dirty = True
        return seg

    def _load_records(self, seg: Segment, raw_acks: set[int], verify: bool, end: int,
                      expected: int | None = None, synced: int = 0) -> bool:
        """Count live records of `seg`, mark acked and (unless kept) transient ones as removed.

        A bad record followed by valid ones (or any bad record of a sealed segment) is damage: its
        bytes are copied aside, overwritten by a filler record (removed, never delivered) and
        counted; every valid record after it is kept. So is a bad record of the write segment that
        starts before `synced` (the synced mark: those bytes were confirmed), and a clean end of
        data before it (synced records gone to zeros). A bad record of the write segment at or
        after the mark with nothing valid after it is a torn tail: cut. Returns whether the segment
        changed.
        """
        keep_transient = self._keep_transient
        acked = PositionSet(end)
        dropped: list[int] = []
        count = transient = body_bytes = live = live_bytes = fillers = regions = 0
        changed = False
        pos = DATA_START
        mm = seg.mm
        while True:
            result = record.ScanResult()
            for p, flags, blen in record.scan(mm, pos, end, verify, result):
                count += 1
                body_bytes += blen
                persistent = flags & record.FLAG_PERSISTENT
                if not persistent:
                    transient += 1
                if flags & record.FLAG_FILLER:
                    fillers += 1
                if p in raw_acks:
                    acked.add(p)
                elif not persistent and (not keep_transient or flags & record.FLAG_FILLER):
                    acked.add(p)
                    dropped.append(p)
                else:
                    live += 1
                    live_bytes += blen
            if not result.reason:
                if result.end >= synced:
                    break
                result.reason = f"end of data at {result.end} before the synced position {synced}"
            bad = result.end
            nxt = record.resync(mm, bad, end)
            stop = nxt if nxt >= 0 else end
            if nxt < 0 and not seg.sealed and bad < synced:
                stop = synced  # damage up to the mark; what follows it was never synced: a tail
            if (nxt < 0 and not seg.sealed and bad >= synced) or stop - bad < record.MIN_RECORD:
                if bad < synced:
                    # Synced bytes too few for a filler (the file was cut below the mark): lost, and said so.
                    self.damaged_records += 1
                    log.error("queue %s: segment %d: %s before the synced position %d; cut %d bytes from "
                              "there: confirmed data lost", self.path, seg.no, result.reason, synced, end - bad)
                else:
                    log.warning("queue %s: segment %d: %s; cut %d bytes from there (a torn tail: never "
                                "confirmed)", self.path, seg.no, result.reason, end - bad)
                changed = True
                break
            self._repair(seg, bad, stop, result.reason)
            regions += 1
            changed = True
            count += 1
            fillers += 1
            transient += 1
            body_bytes += stop - bad - record.MIN_RECORD
            acked.add(bad)
            dropped.append(bad)
            result.end = stop
            if nxt < 0:
                break
            pos = nxt
        if regions:
            # With a meta count we know how many records the damage took, else at least one each.
            lost = max(regions, expected - (count - fillers)) if expected is not None else regions
            self.damaged_records += lost
            log.error("queue %s: segment %d: %d damaged record(s) lost in %d region(s); %d valid records kept",
                      self.path, seg.no, lost, regions, count - fillers)
        seg.used = result.end
        seg.count, seg.transient, seg.body_bytes = count, transient, body_bytes
        seg.live = live
        if count > live:
            seg.acked = acked
        self._ready += live
        self._ready_bytes += live_bytes
        if count > live:
            seg.skip_acked = True
        tail_acks = any(pos >= seg.used for pos in raw_acks) and not seg.sealed
        if tail_acks:
            # Acks of records that did not survive (power loss): new records will reuse those positions.
            log.warning("queue %s: segment %d: dropped acks past the end of data", self.path, seg.no)
            self._rewrite_acks(seg, sorted(pos for pos in raw_acks if pos < seg.used) + dropped)
        elif dropped and (live or not seg.sealed):
            self._acks_dirty = True
            fd = seg.open_acks()
            self._track_fd(fd)
            _write_acks(seg, fd, encode_acks(dropped))
        return changed

    def _repair(self, seg: Segment, start: int, stop: int, reason: str) -> None:
        """Copy damaged bytes [start, stop) aside (durably), then overwrite them with a filler record."""
        aside = self._replace_damaged(seg, start, stop, record.filler(stop - start))
        log.error("queue %s: segment %d: %s; damaged bytes %d..%d (%d) copied to %s and skipped",
                  self.path, seg.no, reason, start, stop, stop - start, aside)

    def _rewrite_meta(self, seg: Segment) -> None:
        fd = seg.write_meta()
        if fd >= 0:
            self._sync_later(fd)
        self._dir_dirty = True

    def _sync_later(self, fd: int) -> None:
        """An fd for the next sync to fsync and then close (lock held, or no sync thread yet)."""
        self._sync_fds = [*self._sync_fds, fd]

    def _track_fd(self, fd: int) -> None:
        """An ack file's or the delivered mark's fd: fsynced by syncs with acks, closed by close()."""
        fds = self._ack_fds
        if not fds:
            fds = self._ack_fds = set()
        fds.add(fd)

    def _map(self, seg: Segment) -> None:
        """Map a sealed segment for reading; the first time, CRC-check it (lazy verification)."""
        seg.map_readonly()
        if not seg.unverified:
            return
        seg.unverified = False
        result = record.ScanResult()
        found = sum(1 for _ in record.scan(seg.mm, DATA_START, seg.used, True, result))
        if not result.reason and found == seg.count:
            return
        # Damage in a segment whose meta vouched for it: every record of it is still ready
        # (unverified segments are mapped first by the read cursor), so recount from scratch.
        self._ready -= seg.live
        self._ready_bytes -= seg.body_bytes
        expected = seg.count
        self._load_records(seg, set(), verify=True, end=seg.used, expected=expected)
        self._rewrite_meta(seg)

    def _rewrite_acks(self, seg: Segment, positions: list[int]) -> None:
        tmp = seg.path("acks") + ".tmp"
        with open(tmp, "wb") as f:
            f.write(ACKS_MAGIC + encode_acks(positions))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, seg.path("acks"))
        self._dir_dirty = True
        if write_observer.current is not None:
            write_observer.current.replace(seg.path("acks"), ACKS_MAGIC + encode_acks(positions))
