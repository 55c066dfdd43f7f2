"""Storage of a priority queue (``x-max-priority``): one QueueStore per priority level in use.

A priority queue keeps RabbitMQ classic-queue semantics: a message's level is
its ``priority`` property (absent = 0, above the queue's maximum = the
maximum); the next message is the oldest ready one of the highest non-empty
level, requeued ones first within their level (``QueueStore.shift``). So
``shift``, ``peek`` and ``drop_head`` all act on that same head, as RabbitMQ's
rabbit_priority_queue does (max-length drop-head drops the highest priority;
TTL expires only at that head).

Each level lives in ``<queue dir>/p-NNN/`` (NNN = level, 3 digits), a complete
QueueStore directory, created on the first message of that level and found
again at open by listing the queue directory; levels that are empty at open
are removed. Memory is levels-in-use x one QueueStore, independent of length.

Message ids: ``level << 56 | inner id`` where the inner id is the level
store's ``segment_no << 32 | position``. That fits the unsigned 64 bits
msgpack carries between shard and frontend while the segment number of a
level stays below 2**24 (8 MiB segments: 128 TiB written to one level of one
queue); ids of level 0 equal the inner ids. Ids are unique across levels but
do not grow with append order across levels: ``mark``/``after`` tell whether
a message was appended after a point in time (FeatureQueue's TTL-0 rule).

Threading as QueueStore: everything on the loop thread except ``sync``.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import threading

from broker import temp_files, write_observer
from broker.amqp.properties import priority as _priority
from shard.segment_dir import MarkerFiles
from shard.store import Message, QueueStore, Record

log = logging.getLogger(__name__)

LEVEL_SHIFT = 56
_INNER_MASK = (1 << LEVEL_SHIFT) - 1
_LAST_INNER_MARK = ((1 << (LEVEL_SHIFT - 32)) - 2) << 32 | 0xFFFFFFFF  # a roll may still add one segment
MAX_PRIORITY = 255
_LEVEL_DIR = re.compile(r"^p-(\d{3})$")


def level_dir(path: str, level: int) -> str:
    return os.path.join(path, f"p-{level:03d}")


def max_priority_of(arguments: dict | None) -> int | None:
    """The queue's x-max-priority (clamped to 0..255), or None for a queue without priorities."""
    v = (arguments or {}).get("x-max-priority")
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        return None
    return min(v, MAX_PRIORITY)


def open_store(path: str, arguments: dict | None, segment_size: int,
               empty_dir: bool = False, fsync: bool = True) -> QueueStore | PriorityStore:
    """The store a queue with these arguments uses: a PriorityStore only with x-max-priority.
    empty_dir: the directory was just made (QueueStore's); fsync=False: a non-durable queue's
    (QueueStore's)."""
    max_priority = max_priority_of(arguments)
    if max_priority is None:
        return QueueStore(path, segment_size=segment_size, empty_dir=empty_dir, fsync=fsync)
    return PriorityStore(path, max_priority, segment_size=segment_size, fsync=fsync)


class PriorityStore(MarkerFiles):
    """QueueStore's interface over one QueueStore per priority level (see the module docstring)."""

    def __init__(self, path: str, max_priority: int, *, segment_size: int = 8 << 20,
                 keep_transient: bool = False, fsync: bool = True) -> None:
        self.path = path
        self.fsync = fsync
        self.max_priority = max(0, min(int(max_priority), MAX_PRIORITY))
        self._segment_size = segment_size
        self._keep_transient = keep_transient
        self._levels: dict[int, QueueStore] = {}
        self._order: list[tuple[int, QueueStore]] = []  # highest level first
        self._all: tuple[QueueStore, ...] = ()  # replaced, never mutated: the sync thread reads it
        self._ready = 0
        self._ready_bytes = 0
        # Ids requeued while the consumer-timeout scan watches (see QueueStore.requeue_watch).
        self.requeue_watch: set[int] | None = None
        self._lock = threading.Lock()
        self._dir_dirty = False  # a level directory was created or removed since the last sync
        self._closed = False
        os.makedirs(path, exist_ok=True)
        self._recover()

    # ------------------------------------------------------------ counters
    @property
    def ready(self) -> int:
        return self._ready

    @property
    def damaged_records(self) -> int:
        return sum(store.damaged_records for store in self._levels.values())

    @property
    def damaged_acks(self) -> int:
        return sum(store.damaged_acks for store in self._levels.values())

    @property
    def ready_bytes(self) -> int:
        return self._ready_bytes

    @property
    def n_redelivered(self) -> int:
        return sum(store.n_redelivered for store in self._levels.values())

    @property
    def dirty(self) -> bool:
        if self._dir_dirty:
            return True
        for s in self._all:
            if s.dirty:
                return True
        return False

    @property
    def parts(self) -> tuple[QueueStore, ...]:
        """The level stores (each notes itself for the periodic sync: shard/dirty_stores.py)."""
        return self._all

    @property
    def levels(self) -> list[int]:
        """Levels with a store, highest first."""
        return [p for p, _ in self._order]

    # ------------------------------------------------------------ hot path
    def append(
        self, ts_ms: int, flags: int, exchange: str, routing_key: str, props_raw: bytes, body: bytes
    ) -> int:
        level = 0
        if len(props_raw) > 1 and props_raw[0] & 0x08:  # priority flag: read the octet only then
            try:
                level = _priority(props_raw)
            except ValueError:
                level = 0
            if level > self.max_priority:
                level = self.max_priority
        store = self._levels.get(level)
        if store is None:
            store = self._add_level(level)
        if store.mark() > _LAST_INNER_MARK:
            # Segment numbers of this level reached 2**24 - 1: an id would run into the level bits.
            raise OverflowError(f"priority queue {self.path}: level {level} has used all its segment numbers")
        inner = store.append(ts_ms, flags, exchange, routing_key, props_raw, body)
        self._ready += 1
        self._ready_bytes += len(body)
        return level << LEVEL_SHIFT | inner

    def shift(self) -> Message | None:
        for level, store in self._order:
            if store.ready:
                msg = store.shift()
                if msg is None:
                    continue
                self._ready -= 1
                self._ready_bytes -= len(msg[7])
                if level:
                    return (level << LEVEL_SHIFT | msg[0], *msg[1:])
                return msg
        return None

    def ack(self, msg_id: int) -> bool:
        store = self._levels.get(msg_id >> LEVEL_SHIFT)
        return store is not None and store.ack(msg_id & _INNER_MASK)

    def requeue(self, msg_id: int) -> bool:
        store = self._levels.get(msg_id >> LEVEL_SHIFT)
        if store is None:
            return False
        before = store.ready_bytes
        if not store.requeue(msg_id & _INNER_MASK):
            return False
        self._ready += 1
        self._ready_bytes += store.ready_bytes - before
        if self.requeue_watch is not None:
            self.requeue_watch.add(msg_id)
        return True

    # ------------------------------------------------------------ other operations
    def peek(self) -> Message | None:
        for level, store in self._order:
            if store.ready:
                msg = store.peek()
                if msg is None:
                    continue
                if level:
                    return (level << LEVEL_SHIFT | msg[0], *msg[1:])
                return msg
        return None

    def drop_head(self) -> Message | None:
        msg = self.shift()
        if msg is not None:
            self.ack(msg[0])
        return msg

    def holds(self, msg_id: int) -> bool:
        """True while the message is stored and not removed (ready or outstanding)."""
        store = self._levels.get(msg_id >> LEVEL_SHIFT)
        return store is not None and store.holds(msg_id & _INNER_MASK)

    def read(self, msg_id: int) -> Record:
        store = self._levels.get(msg_id >> LEVEL_SHIFT)
        if store is None:
            raise KeyError(msg_id)
        return store.read(msg_id & _INNER_MASK)

    def purge(self) -> int:
        removed = 0
        for store in self._all:
            removed += store.purge()
        self._recount()
        return removed

    def mark(self) -> dict[int, int]:
        """A point in append order (see `after`)."""
        return {level: store.mark() for level, store in self._levels.items()}

    def after(self, msg_id: int, mark: dict[int, int]) -> bool:
        """Whether `msg_id` was appended after `mark` was taken."""
        m = mark.get(msg_id >> LEVEL_SHIFT)
        return m is None or (msg_id & _INNER_MASK) >= m

    # ------------------------------------------------------------ durability
    def flush_acks(self) -> None:
        for store in self._all:
            store.flush_acks()

    def sync(self, acks: bool = True) -> None:
        """Make appends (and with ``acks``, acks) of every level durable. Safe to call from a worker
        thread (QueueStore.sync)."""
        with self._lock:
            if self._closed:
                return
            stores = self._all
            dir_dirty = self._dir_dirty
            self._dir_dirty = False
        done = False
        try:
            for store in stores:
                store.sync(acks)
            if dir_dirty and self.fsync:
                self._fsync_dir()
            done = True
        finally:
            if not done and dir_dirty:
                self._dir_dirty = True

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for store in self._all:
            store.close()
        self._ready = self._ready_bytes = 0

    def delete(self) -> None:
        self.close()
        shutil.rmtree(self.path, ignore_errors=True)
        if write_observer.current is not None:
            write_observer.current.delete(self.path)

    # ------------------------------------------------------------ internals
    def _add_level(self, level: int) -> QueueStore:
        store = QueueStore(level_dir(self.path, level), segment_size=self._segment_size,
                           keep_transient=self._keep_transient, fsync=self.fsync)
        self._levels[level] = store
        self._order = sorted(self._levels.items(), key=lambda kv: kv[0], reverse=True)
        self._all = tuple(self._levels.values())
        self._dir_dirty = True
        return store

    def _recount(self) -> None:
        self._ready = sum(s.ready for s in self._all)
        self._ready_bytes = sum(s.ready_bytes for s in self._all)

    def _fsync_dir(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            if self._closed:
                return  # deleted meanwhile
            raise
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _recover(self) -> None:
        for name in sorted(os.listdir(self.path)):
            m = _LEVEL_DIR.match(name)
            if m is None:
                if temp_files.is_temp(name):  # delivery counts or the name file a killed writer left
                    temp_files.remove_found(self.path, name)
                elif name.startswith("msgs."):
                    log.warning("queue %s: segment %s outside a priority level directory ignored",
                                self.path, name)
                continue
            level = int(m.group(1))
            if level > MAX_PRIORITY:
                continue
            store = self._add_level(level)
            if not store.ready:
                # Nothing left at this level: do not keep its files and fds open until it is used again.
                store.delete()
                del self._levels[level]
        self._order = sorted(self._levels.items(), key=lambda kv: kv[0], reverse=True)
        self._all = tuple(self._levels.values())
        self._recount()
