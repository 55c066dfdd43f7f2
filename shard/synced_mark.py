"""The synced mark: how far a store's write segment was durable at its last sync.

A bad record of the write segment with nothing valid after it is normally a torn tail (an append
a crash cut short, never confirmed) and recovery cuts it. A bad record that starts before the
position the last sync made durable was confirmed, so it is damage, not a tail: recovery sets it
aside and counts it (docs/storage.md). The mark is written after the data's fsync, so it never
claims more than was durable. Its own fsync joins a later sync's round at most once per
FLUSH_INTERVAL_S (an fdatasync per sync doubled a queue's sync cost, 160 -> 300 us): after a killed
process the page cache holds the latest mark; after a power loss it may lag up to that interval,
which only makes recovery treat a little more as a tail, as it did before the mark existed.

One small fixed-size file per store directory, `synced`: u64 (segment number << 32 | end
position) and a CRC32 of those 8 bytes. A leaf module: shard/verify.py reads it too.
"""

from __future__ import annotations

import os
import struct
import time
import zlib

from broker import write_observer

NAME = "synced"
_MARK = struct.Struct("<QI")
SIZE = _MARK.size
FLUSH_INTERVAL_S = 1.0


def encode(segment_no: int, pos: int) -> bytes:
    """The file's bytes for a segment and end position."""
    value = segment_no << 32 | pos
    packed = struct.pack("<Q", value)
    return _MARK.pack(value, zlib.crc32(packed))


def open_fd(dir_path: str) -> int:
    """An fd of the directory's mark (created if missing), -1 if it cannot be opened (a store being
    deleted, no fds left): the mark is then not moved, which is always safe."""
    try:
        return os.open(os.path.join(dir_path, NAME), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError:
        return -1


def read(dir_path: str) -> tuple[int, int] | None:
    """(segment number, synced end position) from the directory's mark, None if absent or damaged."""
    try:
        with open(os.path.join(dir_path, NAME), "rb") as f:
            data = f.read(SIZE + 1)
    except OSError:
        return None
    if len(data) != SIZE:
        return None
    value, crc = _MARK.unpack(data)
    if zlib.crc32(struct.pack("<Q", value)) != crc:
        return None
    return value >> 32, value & 0xFFFFFFFF


def synced_end(dir_path: str, segment_no: int) -> int:
    """Where the synced data of write segment `segment_no` ends (0: nothing of it is known synced)."""
    mark = read(dir_path)
    if mark is None or mark[0] != segment_no:
        return 0
    return mark[1]


class SyncedMark:
    """One store's mark across its sync rounds: both stores (queue and stream) drive it the same way.

    ``begin`` and ``end`` run under the store's lock, ``write`` between them after the data's fsync.
    """

    __slots__ = ("path", "_unflushed", "_named", "_flushed_at")

    def __init__(self, dir_path: str) -> None:
        self.path = dir_path
        self._unflushed = False  # written since the last fsync round, which then includes it
        self._named = False  # this process made the mark's directory entry durable (or will, this round)
        self._flushed_at = 0.0  # monotonic time the mark was last included in an fsync round

    def begin(self, segment_no: int | None, pos: int) -> tuple[bytes, int, int, bool]:
        """At the start of a sync (``segment_no`` None: the write segment has no new data).

        Returns (mark to write after the data's fsync, its fd to close after the round, an fd for
        this round to fsync or -1, whether the store directory must be fsynced for the mark's name).
        Opened per sync, not kept: a store holds no extra fd for it (100,000 queues).
        """
        mark = encode(segment_no, pos) if segment_no is not None else b""
        fd = open_fd(self.path) if mark or self._unflushed else -1
        if fd < 0:
            return b"", -1, -1, False
        fsync_fd = -1
        now = time.monotonic()
        if self._unflushed and now - self._flushed_at >= FLUSH_INTERVAL_S:
            fsync_fd = fd
            self._unflushed = False
            self._flushed_at = now
        newly_named = not self._named
        self._named = True
        return mark, fd, fsync_fd, newly_named

    def write(self, mark: bytes, fd: int) -> None:
        """Only after the data's fsync, so the mark never claims more than is durable. It is fsynced
        with a later round (no extra fsync here); until then a power loss may take it back, which only
        makes recovery call a little more a tail."""
        if not mark:
            return
        os.pwrite(fd, mark, 0)
        if write_observer.current is not None:
            write_observer.current.append(os.path.join(self.path, NAME), 0, mark)

    def end(self, mark: bytes, fd: int, done: bool) -> None:
        """After the round: a written mark (or one whose fsync may not have run) goes in the next one."""
        if (done and mark) or (not done and fd >= 0):
            self._unflushed = True
