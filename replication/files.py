"""What the leader and the follower do with data-dir files: which stream owns a file, listing with
CRC32 (over the logical size of sparse segments, cached), and applying received data.

Ownership: every queue directory (``<sha1(vhost)>/<sha1(queue)>/``) and delay store directory
(``delayed/<sha1(vhost)>/<sha1(exchange)>/``) belongs to the shard that owns that queue or
exchange; everything else in the data dir except ``run/`` and ``.lock`` belongs to the node
(definitions, ``.vhost`` name files, ...).
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
from collections.abc import Callable, Iterable

from broker.crc import crc32
from broker.temp_files import is_temp as _is_temp

_HEX40 = re.compile(r"^[0-9a-f]{40}$")
NODE_SKIP = frozenset(("run", ".lock"))
_READ = 1 << 20


def is_store_dir(rel: str) -> bool:
    """Whether ``rel`` (relative, '/'-separated) is a queue or delay store directory."""
    parts = rel.split("/")
    if len(parts) == 2:
        return bool(_HEX40.match(parts[0]) and _HEX40.match(parts[1]))
    if len(parts) == 3 and parts[0] == "delayed":
        return bool(_HEX40.match(parts[1]) and _HEX40.match(parts[2]))
    return False


def store_dir_of(rel: str) -> str | None:
    """The store directory ``rel`` (a relative, '/'-separated path) is in or is, or None."""
    parts = rel.split("/")
    n = 3 if parts[0] == "delayed" else 2
    if len(parts) < n:
        return None
    d = "/".join(parts[:n])
    return d if is_store_dir(d) else None


def store_dirs(root: str) -> list[str]:
    """Queue and delay store directories present under ``root`` (relative paths)."""
    found = []
    for top in _listdir(root):
        if _HEX40.match(top) and os.path.isdir(os.path.join(root, top)):
            found.extend(f"{top}/{sub}" for sub in _listdir(os.path.join(root, top))
                         if _HEX40.match(sub) and os.path.isdir(os.path.join(root, top, sub)))
    droot = os.path.join(root, "delayed")
    for vh in _listdir(droot):
        if _HEX40.match(vh):
            found.extend(f"delayed/{vh}/{x}" for x in _listdir(os.path.join(droot, vh))
                         if _HEX40.match(x) and os.path.isdir(os.path.join(droot, vh, x)))
    return found


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def walk(root: str, rel_dirs: Iterable[str] | None) -> list[str]:
    """Relative paths of the regular files in ``rel_dirs`` (recursively), or, with None, of every file
    the node owns (outside store dirs, run/ and .lock). Temporary files (``*.tmp``, ``*.tmp-<pid>``:
    broker/temp_files.py) are skipped: a writer killed before its rename leaves one, never data."""
    out: list[str] = []
    if rel_dirs is None:
        stack = [""]
        while stack:
            rel = stack.pop()
            for name in _listdir(os.path.join(root, rel)):
                child = f"{rel}/{name}" if rel else name
                if not rel and name in NODE_SKIP:
                    continue
                full = os.path.join(root, child)
                if os.path.isdir(full):
                    if not is_store_dir(child):
                        stack.append(child)
                elif os.path.isfile(full) and not _is_temp(name):
                    out.append(child)
        return out
    for d in rel_dirs:
        base = os.path.join(root, d)
        if os.path.isfile(base):  # a single file a stream owns (a shard's open KV store)
            out.append(d)
            continue
        for dirpath, _dirs, names in os.walk(base):
            reld = os.path.relpath(dirpath, root).replace(os.sep, "/")
            out.extend(f"{reld}/{n}" for n in names if not _is_temp(n))
    return out


def remove_temps(root: str) -> list[str]:
    """Delete every temp file (``*.tmp``, ``*.tmp-<pid>``) under ``root`` but ``run/`` and ``.lock``;
    their relative paths.

    A follower writes a file the full sync rewrites to ``<path>.tmp`` and renames it over the path
    at its last chunk (``FileWriter.write_chunk``), and a replaced file likewise (``replace``); the
    node writes ``definitions.json`` and its kin the same way (broker/defstore.py). Every end of a
    stream drops its unfinished ones (``FileWriter.close``), but a process killed in between
    leaves its ``.tmp``, and nothing else would remove it: listings skip temp files (never
    replicated, never compared), and when the leader has since deleted the path no full sync
    rewrites it. Only where nothing writes to the data dir: a follower's start, before its first
    session (its node runs no workers then; replication/follower.py). A standalone node or a
    leader has each writer's owner remove them instead, where it lists or opens anyway (see
    broker/temp_files.py): no walk of the whole data dir at its boot."""
    removed: list[str] = []
    stack = [""]
    while stack:
        rel = stack.pop()
        try:
            entries = list(os.scandir(os.path.join(root, rel)))
        except OSError:
            continue
        for entry in entries:
            if not rel and entry.name in NODE_SKIP:
                continue
            child = f"{rel}/{entry.name}" if rel else entry.name
            try:
                if entry.is_dir(follow_symlinks=False):
                    stack.append(child)
                elif _is_temp(entry.name):
                    os.unlink(entry.path)
                    removed.append(child)
            except OSError:
                continue  # gone meanwhile, or not ours to remove: left as it was
    return removed


def crc_file(path: str, size: int) -> int:
    """CRC32 of the first ``size`` bytes of ``path`` (zero-padded if the file is shorter)."""
    crc = 0
    left = size
    with open(path, "rb") as f:
        while left > 0:
            chunk = f.read(min(_READ, left))
            if not chunk:
                chunk = bytes(min(_READ, left))
            crc = crc32(chunk, crc)
            left -= len(chunk)
    return crc


class CrcCache:
    """CRC32s of files keyed by (path, size, mtime_ns): sealed segments are hashed once."""

    def __init__(self) -> None:
        self._cache: dict[str, tuple[int, int, int]] = {}

    def listing(self, root: str, rels: list[str],
                logical: Callable[[str], int | None] = lambda _p: None) -> list[tuple[str, int, int]]:
        """(path, size, crc32) of each file; ``logical(abs_path)`` gives the used size of a sparse
        write segment (None: the file's size). Files that vanish meanwhile are left out."""
        out = []
        seen = set()
        for rel in rels:
            full = os.path.join(root, rel)
            try:
                st = os.stat(full)
            except OSError:
                continue
            size = logical(full)
            if size is None:
                size = st.st_size
            key = (size, st.st_mtime_ns)
            hit = self._cache.get(rel)
            if hit is not None and hit[:2] == key:
                crc = hit[2]
            else:
                try:
                    crc = crc_file(full, size)
                except OSError:
                    continue
                self._cache[rel] = (*key, crc)
            out.append((rel, size, crc))
            seen.add(rel)
        for rel in [r for r in self._cache if r not in seen]:
            del self._cache[rel]
        return out

    def fresh(self, root: str, rel: str) -> bool:
        """Whether the cached CRC of ``rel`` still matches its size and mtime."""
        hit = self._cache.get(rel)
        if hit is None:
            return False
        try:
            st = os.stat(os.path.join(root, rel))
        except OSError:
            return False
        return hit[:2] == (st.st_size, st.st_mtime_ns)

    @staticmethod
    def compute(root: str, rels: list[str]) -> dict[str, tuple[int, int, int]]:
        """CRC32s of whole files, for :meth:`merge`: safe in a worker thread (touches no cache)."""
        out = {}
        for rel in rels:
            full = os.path.join(root, rel)
            try:
                st = os.stat(full)
                out[rel] = (st.st_size, st.st_mtime_ns, crc_file(full, st.st_size))
            except OSError:
                continue
        return out

    def merge(self, entries: dict[str, tuple[int, int, int]]) -> None:
        self._cache.update(entries)


# ------------------------------------------------------------------ follower side
class FileWriter:
    """Applies received data to a data dir (plain writes, no mmap) and knows what to make durable.

    Keeps a small cache of open fds; ``dirty()`` hands the fds and directories written since the
    last call to the syncer (fdatasync each, fsync the directories), once per batch.
    """

    MAX_FDS = 128

    def __init__(self, root: str) -> None:
        self.root = root
        # Asked before a file is opened for writing (not per write: an open fd is written without a
        # look-up), replaced or deleted, with the path and whether it is a delete: False drops the
        # action (replication/follower.py: a store directory another stream has taken over).
        self.admit: Callable[[str, bool], bool] | None = None
        # Store directories whose actions this stream's writer drops until its DELETE of the
        # directory itself (see ReplicationFollower._admit); their fds are closed when fenced, so
        # every write to them passes admit().
        self.fenced: set[str] = set()
        self._fds: dict[str, int] = {}
        self._dirty_fds: set[str] = set()
        self._dirty_dirs: set[str] = set()
        # Files a full sync is sending whole whose copy here is not a prefix of the leader's (see
        # write_chunk): path -> fd of ``<path>.tmp``, renamed over the path at the last chunk.
        self._rewrites: dict[str, int] = {}

    def _fd(self, rel: str, truncate: bool = False) -> int:
        fd = self._fds.get(rel)
        if fd is not None and not truncate:
            return fd
        if fd is not None:
            os.ftruncate(fd, 0)
            return fd
        if self.admit is not None and not self.admit(rel, False):
            return -1
        full = os.path.join(self.root, rel)
        # Read too: write_chunk compares a full sync's chunks with the copy.
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | (os.O_TRUNC if truncate else 0)
        try:
            fd = os.open(full, flags, 0o644)
        except FileNotFoundError:
            os.makedirs(os.path.dirname(full), exist_ok=True)
            self._dirty_dirs.add(os.path.dirname(os.path.dirname(full)))
            fd = os.open(full, flags, 0o644)
        self._dirty_dirs.add(os.path.dirname(full))
        if len(self._fds) >= self.MAX_FDS:
            self._evict()
        self._fds[rel] = fd
        return fd

    def _evict(self) -> None:
        # Close the clean ones (dirty ones must survive until synced).
        for rel in [r for r in self._fds if r not in self._dirty_fds][: self.MAX_FDS // 2]:
            os.close(self._fds.pop(rel))

    def write_at(self, rel: str, offset: int, data: bytes, truncate: bool = False) -> None:
        if self._rewrites:
            self._drop_rewrite(rel)
        fd = self._fd(rel, truncate)
        if fd < 0:
            return  # not admitted
        if data:
            os.pwrite(fd, data, offset)
        self._dirty_fds.add(rel)

    def write_chunk(self, rel: str, offset: int, data: bytes, total: int) -> None:
        """A chunk of a whole file sent by a full sync (the chunks of one file come in order, with no
        other frame between them), the file cut to ``total`` at its last chunk.

        While the chunks only repeat or extend the follower's copy, they are written over it in
        place: a copy that is a prefix of the leader's (a write segment that grew, an acks file)
        keeps its confirmed records all along. Emptied at the first chunk (as it once was), it lost
        them until the transfer ended, and for good if this follower was promoted meanwhile (the
        leader gone while the ISR in etcd still listed it). At the first chunk that differs from
        the copy (a file the leader rewrote: definitions.json, a meta or smeta file, a compacted
        acks file or KV log, a segment whose unacked tail the leader cut), the rest goes to
        ``<path>.tmp``, begun with the copy's first ``offset`` bytes (equal to the leader's so far),
        and is renamed over the path at the last chunk: a follower promoted or restarted in
        between finds the old copy whole, never half old and half new. The renamed file is made
        durable with the batch, as an in-place write is."""
        tmp_fd = self._rewrites.get(rel)
        if tmp_fd is None:
            fd = self._fd(rel)
            if fd < 0:
                return  # not admitted
            if data and not data.startswith(os.pread(fd, len(data), offset)):
                tmp_fd = self._start_rewrite(rel, fd, offset)
            else:
                if data:
                    os.pwrite(fd, data, offset)
                if offset + len(data) >= total:
                    os.ftruncate(fd, total)
                self._dirty_fds.add(rel)
                return
        if data:
            os.pwrite(tmp_fd, data, offset)
        if offset + len(data) >= total:
            self._finish_rewrite(rel, tmp_fd, total)

    def _start_rewrite(self, rel: str, fd: int, offset: int) -> int:
        """Begin ``<rel>.tmp`` with the first ``offset`` bytes of the copy (see write_chunk)."""
        tmp_fd = os.open(os.path.join(self.root, rel) + ".tmp",
                         os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            done = 0
            while done < offset:
                try:
                    n = os.copy_file_range(fd, tmp_fd, offset - done, done, done)
                except OSError:  # a file system without it: read and write
                    piece = os.pread(fd, min(_READ, offset - done), done)
                    n = os.pwrite(tmp_fd, piece, done) if piece else 0
                if n == 0:
                    break  # the copy is shorter (cannot be: the earlier chunks extended it)
                done += n
        except OSError:
            os.close(tmp_fd)
            raise
        self._rewrites[rel] = tmp_fd
        return tmp_fd

    def _finish_rewrite(self, rel: str, tmp_fd: int, total: int) -> None:
        """Cut ``<rel>.tmp`` to ``total`` and rename it over ``rel``; its fd becomes the path's (made
        durable with the batch, with the directory: the rename)."""
        del self._rewrites[rel]
        os.ftruncate(tmp_fd, total)
        full = os.path.join(self.root, rel)
        try:
            os.replace(full + ".tmp", full)
        except OSError:
            os.close(tmp_fd)
            raise
        self.close_fd(rel)  # the old copy's fd: appends after this go to the new file
        if len(self._fds) >= self.MAX_FDS:
            self._evict()
        self._fds[rel] = tmp_fd
        self._dirty_fds.add(rel)
        self._dirty_dirs.add(os.path.dirname(full))

    def _drop_rewrite(self, rel: str) -> None:
        """Abandon an unfinished rewrite of ``rel`` (or of the files under it): the copy stays as it was."""
        for key in [r for r in self._rewrites if r == rel or r.startswith(rel + "/")]:
            os.close(self._rewrites.pop(key))
            try:
                os.unlink(os.path.join(self.root, key) + ".tmp")
            except FileNotFoundError:
                pass

    def replace(self, rel: str, data: bytes) -> None:
        if self.admit is not None and not self.admit(rel, False):
            return
        if self._rewrites:
            self._drop_rewrite(rel)
        self.close_fd(rel)
        full = os.path.join(self.root, rel)
        tmp = full + ".tmp"
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fdatasync(f.fileno())
        os.replace(tmp, full)
        self._dirty_dirs.add(os.path.dirname(full))

    def delete(self, rel: str) -> None:
        if self.admit is not None and not self.admit(rel, True):
            return
        self.remove(rel)

    def fence(self, store_dir: str) -> None:
        """Drop this writer's actions on ``store_dir`` until its DELETE of it (see ``fenced``)."""
        self.fenced.add(store_dir)
        # list(): copied in one step (this may run while the stream's full sync deletes in a thread).
        for key in [r for r in list(self._fds) if r.startswith(store_dir + "/")]:
            self.close_fd(key)
        if self._rewrites:
            self._drop_rewrite(store_dir)

    def remove(self, rel: str) -> None:
        """Delete a file or directory tree, not asking admit()."""
        full = os.path.join(self.root, rel)
        if self._rewrites:
            self._drop_rewrite(rel)
        for key in [r for r in self._fds if r == rel or r.startswith(rel + "/")]:
            self.close_fd(key)
        if os.path.isdir(full):
            shutil.rmtree(full, ignore_errors=True)
        else:
            try:
                os.unlink(full)
            except FileNotFoundError:
                return
        self._dirty_dirs.add(os.path.dirname(full))

    def close_fd(self, rel: str) -> None:
        fd = self._fds.pop(rel, None)
        self._dirty_fds.discard(rel)
        if fd is not None:
            os.close(fd)

    def take_dirty(self) -> tuple[list[int], list[str]]:
        """Fds to fdatasync (dup'ed: the caller closes them) and directories to fsync since the last call."""
        fds = [os.dup(self._fds[r]) for r in self._dirty_fds if r in self._fds]
        dirs = [d for d in self._dirty_dirs if os.path.isdir(d)]
        self._dirty_fds = set()
        self._dirty_dirs = set()
        return fds, dirs

    def close(self) -> None:
        for rel in list(self._rewrites):
            self._drop_rewrite(rel)  # a transfer cut short: the old copy stays whole
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}
        self._dirty_fds = set()


def _sync_file_range() -> Callable[[int], None] | None:
    """``fd -> start writeback of its dirty pages`` (Linux sync_file_range, SYNC_FILE_RANGE_WRITE),
    or None where libc has no such call."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return lambda fd: fn(fd, 0, 0, 2)  # 2 = SYNC_FILE_RANGE_WRITE; a failure only loses the hint


_start_writeback = _sync_file_range()


def make_durable(fds: list[int], dirs: list[str]) -> None:
    """fdatasync the fds (and close them), fsync the directories. Runs in a worker thread.

    With several files, writeback of all of them is started first: ext4 allocates their blocks
    then, so the first fdatasync's journal commit carries every file's metadata and the next ones
    only wait for their data, instead of one journal commit per file, one after the other."""
    try:
        if len(fds) > 1 and _start_writeback is not None:
            for fd in fds:
                _start_writeback(fd)
        for fd in fds:
            os.fdatasync(fd)
    finally:
        for fd in fds:
            os.close(fd)
    for d in dirs:
        try:
            dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            continue
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
