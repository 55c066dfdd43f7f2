"""One segment of a queue: its msgs file (mmap'd), its acks file, its meta file.

A segment is either the *write* segment (mapped read-write at its full sparse
size, records appended at `used`) or *sealed* (truncated to `used`, counts in its
meta file, read only). File formats are described in docs/storage.md.
"""

from __future__ import annotations

import errno
import mmap
import os
import struct
import zlib

from broker import write_observer
from broker.crc import crc32 as _crc32  # zlib's values, ISA-L's speed (ack entries are one CRC per ack)

FORMAT_VERSION = 1
VERSION_HEADER = struct.Struct("<I")
DATA_START = VERSION_HEADER.size

# meta: version, record count, transient record count, used bytes, body bytes | crc32 of those 28 bytes
_META_FIELDS = struct.Struct("<IIIQQ")
_META_CRC = struct.Struct("<I")
META_SIZE = _META_FIELDS.size + _META_CRC.size
_U32 = struct.Struct("<I")
pack_u32 = _U32.pack


# Write segments open in this process by msgs path: replication's full sync lists their logical
# size (``used``), not the sparse file's mapped size.
open_write_segments: dict[str, Segment] = {}


def file_name(kind: str, no: int) -> str:
    return f"{kind}.{no:010d}"


def parse_name(name: str) -> tuple[str, int] | None:
    """("msgs"|"acks"|"meta", number) for a segment file name, else None."""
    kind, dot, num = name.partition(".")
    if dot and kind in ("msgs", "acks", "meta") and len(num) == 10 and num.isdigit():
        return kind, int(num)
    return None


class Meta:
    """Counts of a sealed segment, so boot need not rescan it."""

    __slots__ = ("count", "transient", "used", "body_bytes")

    def __init__(self, count: int, transient: int, used: int, body_bytes: int) -> None:
        self.count = count
        self.transient = transient
        self.used = used
        self.body_bytes = body_bytes

    def encode(self) -> bytes:
        fields = _META_FIELDS.pack(FORMAT_VERSION, self.count, self.transient, self.used, self.body_bytes)
        return fields + _META_CRC.pack(zlib.crc32(fields))

    @classmethod
    def decode(cls, data: bytes) -> Meta | None:
        """None unless `data` is a complete meta record of our version with a good CRC."""
        if len(data) != META_SIZE:
            return None
        fields = data[:_META_FIELDS.size]
        if _META_CRC.unpack_from(data, _META_FIELDS.size)[0] != zlib.crc32(fields):
            return None
        version, count, transient, used, body_bytes = _META_FIELDS.unpack(fields)
        if version != FORMAT_VERSION:
            return None
        return cls(count, transient, used, body_bytes)


class PositionSet:
    """Positions of removed records of one segment, as a bitmap.

    Records are at least record.MIN_RECORD (31) bytes, so two record starts never
    share a 16-byte slot: one bit per slot identifies a position. That is 64 KiB
    for an 8 MiB segment, however many records it holds.
    """

    __slots__ = ("bits",)

    def __init__(self, size: int) -> None:
        self.bits = bytearray((size >> 7) + 1)

    def __contains__(self, pos: int) -> bool:
        i = pos >> 7
        bits = self.bits
        return i < len(bits) and bool(bits[i] & (1 << ((pos >> 4) & 7)))

    def add(self, pos: int) -> None:
        i = pos >> 7
        bits = self.bits
        if i >= len(bits):
            bits.extend(bytes(i + 1 - len(bits)))
        bits[i] |= 1 << ((pos >> 4) & 7)


# Blocks are reserved ahead of the write position in steps of this size, not for the whole segment at
# once: an idle queue then costs one step of disk, not a whole (8 MiB) segment.
ALLOC_STEP = 1 << 20


def allocate(fd: int, size: int, reserve: int = ALLOC_STEP) -> int:
    """Make the file `size` bytes long with the blocks of its first `reserve` bytes allocated;
    returns the end of the allocated region.

    Segments are written through mmap: a store to a page whose block the file system cannot
    allocate (full disk) is a SIGBUS that kills the process. Allocating ahead of the writer
    (``Segment.reserve``) turns a full disk into an OSError there, where the caller nacks the
    publish and goes on.
    """
    os.ftruncate(fd, size)
    return fallocate(fd, 0, min(size, reserve), size)


def fallocate(fd: int, start: int, end: int, size: int) -> int:
    """Allocate the blocks of [start, end); returns the new allocated end (`size` where the file
    system cannot allocate ahead: sparse, as before)."""
    try:
        os.posix_fallocate(fd, start, end - start)
    except OSError as exc:
        if exc.errno == errno.EOPNOTSUPP:
            return size
        raise
    return end


def _no_fault_readahead(mm: mmap.mmap) -> None:
    """A new file's mapping: page faults bring in their own page only (MADV_RANDOM).

    A fresh segment has nothing to read ahead, yet with the default advice the first write fault on
    a new file's shared mapping cost 1-2.8 ms of the thread's CPU in one piece (its later faults a
    few us each; measured on this host's ext4, kernel 6.18): a purge or a roll that makes a segment
    paid it inside one loop turn (docs/benchmarks.md, "The pair's turns during a 30,000-queue
    delete"). With MADV_RANDOM that first fault costs ~20 us and the others about what they did.
    Only while a segment is written: ``seal`` puts the default back (a sealed segment is read, and
    once its pages are evicted read-ahead helps), and a segment opened at recovery keeps it."""
    _advise(mm, _MADV_RANDOM)


def _advise(mm: mmap.mmap, advice: int | None) -> None:
    if advice is not None:
        try:
            mm.madvise(advice)
        except (OSError, ValueError):  # advice only (ValueError: a closed or empty map)
            pass


_MADV_RANDOM = getattr(mmap, "MADV_RANDOM", None)
_MADV_NORMAL = getattr(mmap, "MADV_NORMAL", None)


# Ack files (docs/storage.md): version 2 starts with this header and holds (u32 position, u32
# CRC32 of the position's 4 bytes) entries, so a damaged entry is detected instead of silently
# naming another record (or none). Version 1 files (bare u32 positions) are read and rewritten
# as version 2 when their queue is opened.
ACKS_MAGIC = b"SMQACK2\0"
_ACK_ENTRY = struct.Struct("<II")


def encode_acks(positions: list[int]) -> bytes:
    crc32 = _crc32
    flat = []
    for pos in positions:
        flat.append(pos)
        flat.append(crc32(pos.to_bytes(4, "little")))
    return struct.pack(f"<{len(flat)}I", *flat)


def read_ack_entries(path: str, repair: bool = False) -> tuple[list[int], int, bool]:
    """(positions with a good checksum, number of damaged entries, whether the file is version 1).

    A torn trailing partial entry (a crash mid-append) is ignored, and with `repair` truncated
    away so appends stay aligned. A missing or unreadable file has no entries.
    """
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return [], 0, False
    if data[:len(ACKS_MAGIC)] != ACKS_MAGIC:
        n = len(data) // 4
        if repair and len(data) != n * 4:
            os.truncate(path, n * 4)
        return list(struct.unpack_from(f"<{n}I", data)), 0, n > 0
    body = len(data) - len(ACKS_MAGIC)
    n = body // 8
    if repair and body != n * 8:
        os.truncate(path, len(ACKS_MAGIC) + n * 8)
    flat = struct.unpack_from(f"<{2 * n}I", data, len(ACKS_MAGIC))
    crc32 = _crc32
    good = [flat[i] for i in range(0, 2 * n, 2) if crc32(flat[i].to_bytes(4, "little")) == flat[i + 1]]
    return good, n - len(good), False


def read_acks(path: str) -> set[int]:
    """Positions listed in an ack file (either version); damaged entries are left out."""
    return set(read_ack_entries(path, repair=True)[0])


class Segment:
    """State of one segment. Attributes are public: the store's hot path reads them directly."""

    __slots__ = (
        "no", "dir", "fd", "mm", "size", "used", "sealed",
        "count", "transient", "body_bytes", "live", "acked", "ack_fd", "skip_acked", "unverified",
        "_msgs_path", "alloc_end",
    )

    def __init__(self, dir_path: str, no: int) -> None:
        self.no = no
        self.dir = dir_path
        self.fd = -1
        self.mm: mmap.mmap | None = None
        self.size = 0  # mapped length
        # End of the region whose blocks are allocated (ALLOC_STEP ahead of `used`); 0 = unknown (an
        # existing file): the first append allocates from the start again, which costs nothing.
        self.alloc_end = 0
        self.used = DATA_START  # end of the last good record
        self.sealed = False
        self.count = 0  # records in the file (for meta)
        self.transient = 0  # of which non-persistent (for meta)
        self.body_bytes = 0  # sum of body sizes of all records (for meta)
        self.live = 0  # records not removed (ready or outstanding)
        self.acked: PositionSet | None = None  # created on first removal
        self.ack_fd = -1
        # Removed records may lie ahead of the read cursor (only after recovery): shift must check.
        self.skip_acked = False
        # Sealed with a valid meta and loaded without reading it: CRC-checked when first mapped.
        self.unverified = False
        self._msgs_path: str | None = None  # see msgs_path

    @property
    def msgs_path(self) -> str:
        """The msgs file's path, reported per append when replicating: made on first use, so the
        placeholder segment of an empty queue holds no copy of it (100,000 queues)."""
        p = self._msgs_path
        if p is None:
            p = self._msgs_path = os.path.join(self.dir, file_name("msgs", self.no))
        return p

    def path(self, kind: str) -> str:
        return os.path.join(self.dir, file_name(kind, self.no))

    # ------------------------------------------------------------ lifecycle
    @classmethod
    def create(cls, dir_path: str, no: int, size: int) -> Segment:
        """A new write segment of `size` bytes, its blocks allocated, with the version header.

        OSError (ENOSPC above all) leaves no file behind: the caller's store is unchanged.
        """
        seg = cls(dir_path, no)
        seg.fd = os.open(seg.path("msgs"), os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            seg.alloc_end = allocate(seg.fd, size)
            seg.mm = mmap.mmap(seg.fd, size)
            _no_fault_readahead(seg.mm)
        except BaseException:
            os.close(seg.fd)
            seg.fd = -1
            try:
                os.unlink(seg.path("msgs"))
            except OSError:
                pass
            raise
        VERSION_HEADER.pack_into(seg.mm, 0, FORMAT_VERSION)
        seg.size = size
        open_write_segments[seg.path("msgs")] = seg
        if write_observer.current is not None:
            write_observer.current.append(seg.path("msgs"), 0, seg.mm[:DATA_START])
        return seg

    def open_mapped(self, writable: bool) -> None:
        """Open and map the existing msgs file at its current size (caller checked it is >= 4 bytes)."""
        flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC
        self.fd = os.open(self.path("msgs"), flags)
        try:
            self.size = os.fstat(self.fd).st_size
            access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
            self.mm = mmap.mmap(self.fd, self.size, access=access)
        except BaseException:
            os.close(self.fd)
            self.fd = -1
            raise
        if writable:
            open_write_segments[self.path("msgs")] = self

    def regrow(self, size: int) -> None:
        """Cut the file at `used` (zeroing anything after it) and extend it to `size` (write segment).

        When the blocks cannot be allocated (OSError, the file is then `used` bytes long) the
        segment is left mapped at `used` bytes: nothing fits, so the next append tries to roll.
        """
        if self.mm is not None:
            self.mm.close()
            self.mm = None
        os.ftruncate(self.fd, self.used)
        try:
            self.alloc_end = allocate(self.fd, size, max(ALLOC_STEP, self.used))
        except OSError:
            os.ftruncate(self.fd, self.used)
            self.size = self.used
            self.mm = mmap.mmap(self.fd, self.used)
            raise
        self.mm = mmap.mmap(self.fd, size)
        self.size = size

    def reserve(self, end: int) -> None:
        """Allocate blocks up to at least `end` (<= size) before the mapped bytes there are written.

        OSError (ENOSPC) leaves the segment as it was: the record is not written.
        """
        self.alloc_end = fallocate(self.fd, self.alloc_end, min(self.size, max(end, self.alloc_end + ALLOC_STEP)),
                                   self.size)

    def seal(self) -> int:
        """Truncate to the used length and write the meta file; returns the meta file's fd (unsynced)."""
        os.ftruncate(self.fd, self.used)
        self.sealed = True
        self.forget_write()
        if self.mm is not None:
            _advise(self.mm, _MADV_NORMAL)  # read from now on: read-ahead helps once its pages are evicted
        return self.write_meta()

    def forget_write(self) -> None:
        """No longer the write segment (sealed, closed or deleted)."""
        path = self.path("msgs")
        if open_write_segments.get(path) is self:
            del open_write_segments[path]

    def write_meta(self) -> int:
        """Write the meta file; its fd (unsynced), or -1 when it could not be written (full disk):
        a segment without meta is scanned at the next start, which is slower but loses nothing."""
        data = Meta(self.count, self.transient, self.used, self.body_bytes).encode()
        try:
            fd = os.open(self.path("meta"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        except OSError:
            return -1
        try:
            if os.write(fd, data) == META_SIZE:
                if write_observer.current is not None:
                    write_observer.current.replace(self.path("meta"), data)
                return fd
        except OSError:
            pass
        os.close(fd)
        try:
            os.unlink(self.path("meta"))
        except OSError:
            pass
        return -1

    def read_meta(self) -> Meta | None:
        try:
            with open(self.path("meta"), "rb") as f:
                return Meta.decode(f.read(META_SIZE + 1))
        except OSError:
            return None

    def open_acks(self) -> int:
        if self.ack_fd < 0:
            fd = os.open(self.path("acks"), os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
            try:
                if os.fstat(fd).st_size == 0:
                    os.write(fd, ACKS_MAGIC)
                    if write_observer.current is not None:
                        write_observer.current.append(self.path("acks"), 0, ACKS_MAGIC)
            except BaseException:
                os.close(fd)
                raise
            self.ack_fd = fd
        return self.ack_fd

    def map_readonly(self) -> None:
        """Map a sealed segment for reading; the mapping keeps its own fd, ours is closed."""
        fd = os.open(self.path("msgs"), os.O_RDONLY | os.O_CLOEXEC)
        try:
            self.size = os.fstat(fd).st_size
            self.mm = mmap.mmap(fd, self.size, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)

    def close_map(self) -> None:
        """Unmap (fds are closed by the store, which may have to wait for a running sync)."""
        if self.mm is not None:
            self.mm.close()
            self.mm = None
        if not self.sealed:
            self.forget_write()

    def unlink(self) -> None:
        self.forget_write()
        obs = write_observer.current
        for kind in ("msgs", "acks", "meta"):
            try:
                os.unlink(self.path(kind))
            except FileNotFoundError:
                continue
            if obs is not None:
                obs.delete(self.path(kind))


class _Placeholder(Segment):
    """The write segment of a store that never held a message: no file, nothing mapped. One object
    shared by every such store (100,000 idle queues), so it refuses any change: a store replaces it
    with a real segment before writing (QueueStore._materialize)."""

    __slots__ = ()

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"the shared placeholder segment is read-only (set {name})")


def _placeholder() -> Segment:
    seg = Segment("", 1)
    seg.__class__ = _Placeholder
    return seg


# Segment number 1 of no directory (its file is made by Segment.create under the store's path).
PLACEHOLDER: Segment = _placeholder()
