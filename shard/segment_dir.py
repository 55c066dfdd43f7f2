"""What the on-disk stores (QueueStore, StreamStore) share about their directory of segment files.

A sync runs in a worker thread and may still be using fds that the event loop has finished
with (a sealed or dropped segment): those are closed only once no sync is running. Unreadable
segments are renamed out of the way, never deleted, so they can be inspected.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from typing import Any

from broker import write_observer
from shard import dirty_stores

log = logging.getLogger(__name__)

# Removes deleted stores' directories off the event loop: deleting a vhost of 100,000 queues must
# not stall the shard's other queues for the seconds their renames and unlinks take.
# One thread, started on first use; a directory it has not removed yet when the process dies is
# removed at the next boot (broker/datadir.py removes every directory of a vhost directory that no
# durable queue owns, trash directories included). The thread takes everything queued at once,
# moves each directory into one fresh trash directory per vhost directory (`deleted-<pid>-<n>`,
# beside the queue directories) and hands the trash directories to `rm -rf`, a child process:
# shutil.rmtree's Python loop over the files held the shard's GIL against its event loop.
#
# Why a trash directory and not a renamed sibling (docs/benchmarks.md, "Vhost deletes: the cause"):
# on a file system mounted with `discard`, an rmdir/unlink that frees blocks can wait for a
# synchronous discard while it holds its parent directory's lock. `rm` removing renamed queue
# directories straight from the vhost directory held that lock for milliseconds at a time, and the
# reaper's next rename in that directory waited for it (4-23 ms each, measured) while it held the lock
# the event loop took for every deleted queue. Inside a trash directory, rm's removals lock the
# trash directory, which no rename touches.
# The loop never waits for the reaper: _remove_later takes no lock (a set add and a SimpleQueue put);
# only claim_path (a deleted queue's name declared again) takes _pending_lock, which the reaper
# holds for a few bytecodes per path, never across a syscall.
_reaper: threading.Thread | None = None
_work: queue.SimpleQueue[tuple[str, bool]] = queue.SimpleQueue()  # (path, already renamed aside)
_trash_seq = itertools.count()
# Directories handed to the reaper and not yet moved: a queue of the same name declared meanwhile
# takes them over first (claim_path), so it never sees the old files.
_pending: set[str] = set()
_pending_lock = threading.Lock()
_moved = threading.Condition(_pending_lock)  # notified when the reaper's rename of _moving is done
_moving: str | None = None  # the path the reaper is renaming now (out of _pending, not yet moved)
_RM_ARGS = 1000  # trash directories per `rm -rf`
# The reaper rests this long after each round: paced deletes (broker/delete_pacer.py) hand it a few
# directories every few ms, and a round per handful cost a mkdir, and a fork and two execs (`nice`,
# `rm`) each; resting lets a round gather ~100 ms of deletions instead.
_ROUND_PAUSE_S = 0.1
TRASH_PREFIX = "deleted-"
REAPER_NAME = "store-reaper"  # the thread's name, in Python and (Linux) in /proc/<pid>/task/<tid>/comm
REAPER_NICE = 10  # the reaper thread runs this much nicer than the shard on Linux (see _lower_priority)
_niced = False  # it does (its `rm` children inherit that)


def _submit(path: str, aside: bool) -> None:
    global _reaper
    _work.put((path, aside))
    if _reaper is None:
        _reaper = threading.Thread(target=_reap_forever, name=REAPER_NAME, daemon=True)
        _reaper.start()


def _trash_name(path: str) -> str:
    return os.path.join(os.path.dirname(path), f"{TRASH_PREFIX}{os.getpid()}-{next(_trash_seq)}")


def _rename_aside(path: str) -> str | None:
    """Rename path to a trash name next to it; the trash name, or None when path is gone."""
    trash = _trash_name(path)
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return None
    except OSError:
        shutil.rmtree(path, ignore_errors=True)
        return None
    return trash


def _move_to(trash_dirs: dict[str, str], path: str) -> None:
    """Move path into its vhost directory's trash directory of this round (made on first use)."""
    parent = os.path.dirname(path)
    trash = trash_dirs.get(parent)
    if trash is None:
        trash = _trash_name(path)
        try:
            os.mkdir(trash, 0o700)
        except OSError:  # the vhost dir is gone, or no space for a directory: remove it in place
            shutil.rmtree(path, ignore_errors=True)
            return
        trash_dirs[parent] = trash
    try:
        os.rename(path, os.path.join(trash, str(next(_trash_seq))))
    except FileNotFoundError:
        pass
    except OSError:
        shutil.rmtree(path, ignore_errors=True)


def _remove_trees(paths: list[str]) -> None:
    """Remove directory trees in a child `rm -rf` (no GIL held while it unlinks; niced, so the
    workers serving other queues on these cores go first); shutil.rmtree for what that left (no
    `nice`/`rm`, or it failed)."""
    for i in range(0, len(paths), _RM_ARGS):
        chunk = paths[i : i + _RM_ARGS]
        try:
            # A child inherits the niced reaper thread's nice value: `nice` only where that failed.
            rm = ["rm"] if _niced else ["nice", "-n", str(REAPER_NICE), "rm"]
            subprocess.run([*rm, "-rf", "--", *chunk], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, check=False)
        except OSError:
            pass
        for p in chunk:
            if os.path.lexists(p):
                shutil.rmtree(p, True)


def _lower_priority() -> None:
    """Nice the calling thread by REAPER_NICE (as `nice -n 10`, at most 19) and name it (Linux;
    nothing elsewhere).

    On Linux a thread's nice value is its own (setpriority with its thread id), so the shard's event
    loop keeps its priority while the reaper's renames, ~1 ms of kernel CPU at a time, yield the core
    to it and to the other workers, as its `rm` children already do. Not elsewhere: there the same
    call would nice the whole shard. The risk weighed: a niced thread preempted while it holds the
    GIL holds the loop up longer; it holds the GIL only for a few bytecodes between its syscalls,
    and an A/B of a main thread's gaps beside a renaming thread niced or not showed no difference
    (scripts/nice-gil.py; docs/benchmarks.md, "The reaper thread niced"). The other wait on it,
    claim_path's for the one rename of that very path the reaper may be doing, can last longer
    under CPU contention (the thread is runnable, not starved). The name ("store-reaper"
    in /proc, top, perf) is what tests and profiles find it by."""
    if not sys.platform.startswith("linux"):
        return
    global _niced
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + REAPER_NICE))
        _niced = True
    except OSError:  # never fatal: the reaper works at the shard's priority
        log.debug("could not nice the reaper thread", exc_info=True)
    try:
        with open(f"/proc/self/task/{tid}/comm", "w") as f:
            f.write(REAPER_NAME)
    except OSError:
        pass


def _reap_forever() -> None:
    """Reaper thread: take everything queued at once, move each queued directory (unless claimed
    meanwhile) into a trash directory and remove those, and again."""
    global _moving
    _lower_priority()
    while True:
        items = [_work.get()]
        while True:
            try:
                items.append(_work.get_nowait())
            except queue.Empty:
                break
        trash_dirs: dict[str, str] = {}
        aside = []
        for path, renamed in items:
            if renamed:
                aside.append(path)
                continue
            with _pending_lock:
                if path not in _pending:
                    continue  # claim_path() took it over (or an earlier entry of the same path did)
                # _moving first: claim_path, which reads both without the lock, must never see the
                # path in neither while it is still in place.
                _moving = path
                _pending.discard(path)
            try:
                _move_to(trash_dirs, path)
            finally:
                with _pending_lock:
                    _moving = None
                    _moved.notify_all()
        try:
            _remove_trees(list(trash_dirs.values()) + aside)
        except Exception:  # never let the thread die: what is left goes at the next boot
            log.exception("removing deleted queue directories failed")
        time.sleep(_ROUND_PAUSE_S)


def _remove_later(path: str) -> None:
    _pending.add(path)
    _submit(path, False)


def claim_path(path: str) -> None:
    """Before a store's directory is made again: a deletion of it still waiting in the reaper is
    done now (renamed aside here, removed by the reaper), so the new store starts empty; one the
    reaper is moving right now is waited for (one rename)."""
    if not _pending and _moving is None:
        return
    with _pending_lock:
        while _moving == path:
            _moved.wait()
        if path not in _pending:
            return
        trash = _rename_aside(path)
        _pending.discard(path)
    if trash is not None:
        _submit(trash, True)


def set_aside(path: str) -> None:
    """Rename a directory no store of this process owns aside now; the reaper removes it."""
    trash = _rename_aside(path)
    if trash is not None:
        _submit(trash, True)


class MarkerFiles:
    """Empty marker files in a store's directory (e.g. feature_queue.EXPIRING_MARK); needs ``path``
    and ``_dir_dirty`` (the next sync then fsyncs the directory, which makes a new marker durable)."""

    __slots__ = ()  # QueueStore has slots (100,000 queues): no instance dict from a base class
    path: str
    _dir_dirty_v: bool  # what _dir_dirty reads and writes (a slot in QueueStore)
    _closed: bool

    @property
    def _dir_dirty(self) -> bool:
        """Files created or removed since the last sync (the next one fsyncs the directory). Set in
        many places, rarely: a property, so that each False -> True notes the store for the periodic
        sync (shard/dirty_stores.py) wherever it is set."""
        return self._dir_dirty_v

    @_dir_dirty.setter
    def _dir_dirty(self, value: bool) -> None:
        if value and not self._dir_dirty_v:
            dirty_stores.note(self)
        self._dir_dirty_v = value

    @property
    def closed(self) -> bool:
        return self._closed

    def has_marker(self, name: str) -> bool:
        """Whether the empty marker file `name` exists in the directory."""
        return os.path.exists(os.path.join(self.path, name))

    def add_marker(self, name: str) -> None:
        """Create the empty marker file `name`; durable with the next sync."""
        path = os.path.join(self.path, name)
        if not os.path.exists(path):
            os.close(os.open(path, os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o600))
            self._dir_dirty = True
            if write_observer.current is not None:
                write_observer.current.replace(path, b"")


class SegmentDir(MarkerFiles):
    """Base of a store owning one directory. Subclasses set ``path``, ``_dir_dirty``, ``_closed``,
    ``_syncing`` and ``_deferred_close`` (the last two guarded by their ``_lock``), implement
    ``close`` and name their per-segment file kinds in ``SEGMENT_KINDS``."""

    __slots__ = ()
    SEGMENT_KINDS: tuple[str, ...] = ()
    path: str
    _syncing: int
    _deferred_close: list[int] | tuple[()]
    _dir_fd: int

    _closed: bool
    # Set once the directories above ours have been fsynced (see _sync_parents). QueueStore has
    # it as a slot set in __init__; StreamStore reads this default until it sets its own.
    _parents_synced = False

    def close(self) -> None:
        raise NotImplementedError

    def delete(self, later: bool = False) -> None:
        """Close and remove the directory with all its files.

        later (a queue's own directory, directly under its vhost dir): a background thread renames
        it aside and removes its files; a queue of the same name declared before that takes the
        directory over empty (claim_path, called by shard/store.py make_queue_dir).
        """
        self.close()
        if not later:
            shutil.rmtree(self.path, ignore_errors=True)
            if write_observer.current is not None:
                write_observer.current.delete(self.path)
            return
        _remove_later(self.path)
        if write_observer.current is not None:
            write_observer.current.delete(self.path)

    def __del__(self) -> None:
        # Dropping an unclosed store is like a crash: written data is in the page cache, only fds leak.
        try:
            if not self._closed:
                self.close()
        except Exception:
            pass

    def _sync_parents(self) -> None:
        """fsync the three directories above ours, once per store (sync thread).

        A new queue dir is only durable once the entries naming it (in its vhost dir, and the vhost
        dir's in the data dir; for priority levels and delay stores one level more) are, so the
        first sync of a store, which comes before the first confirm into it, makes them durable
        (and its ``.queue`` name file, written without an fsync).
        """
        if self._parents_synced:
            return
        # The name files were renamed into place without an fsync (shard/store.py queue_dir).
        for name_file in (os.path.join(self.path, ".queue"), os.path.join(os.path.dirname(self.path), ".vhost")):
            try:
                fd = os.open(name_file, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        path = self.path
        for _ in range(3):
            path = os.path.dirname(path)
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        self._parents_synced = True

    def _dirfd(self) -> int:
        """The directory's fd, opened on first use (QueueStore opens it lazily: under the lock in
        sync(), on the loop in recovery; StreamStore at creation)."""
        fd = self._dir_fd
        if fd < 0:
            fd = self._dir_fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        return fd

    def _release(self, fds: list[int]) -> None:
        """Close fds now, or after the running sync (which may be using them). Call with the lock held."""
        self._defer_close(fds)
        if not self._syncing:
            self._close_deferred()

    def _defer_close(self, fds: list[int]) -> None:
        """Add fds for _close_deferred (lock held). ``_deferred_close`` is an empty tuple, not a list of
        its own, whenever nothing waits: an idle queue holds no list for it."""
        if fds:
            self._deferred_close = [*self._deferred_close, *fds]

    def _close_deferred(self) -> None:
        fds = self._deferred_close
        if not fds:
            return
        self._deferred_close = ()
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass

    def _replace_damaged(self, seg: Any, start: int, stop: int, fill: bytes) -> str:
        """Copy seg's damaged bytes [start, stop) to `msgs.N.damaged-<start>` (fsynced with the
        directory) before anything changes, then overwrite them in place with `fill` (a filler
        record of the same size) and fdatasync; returns the name of the copy."""
        aside = f"{seg.path('msgs')}.damaged-{start}"
        data = bytes(seg.mm[start:stop])
        tmp = aside + ".tmp"
        with open(tmp, "wb", opener=lambda path, flags: os.open(path, flags | os.O_CLOEXEC, 0o600)) as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, aside)
        os.fsync(self._dirfd())
        fd = os.open(seg.path("msgs"), os.O_RDWR | os.O_CLOEXEC)
        try:
            os.pwrite(fd, fill, start)
            os.fdatasync(fd)
        finally:
            os.close(fd)
        obs = write_observer.current
        if obs is not None:
            obs.replace(aside, data)
            obs.append(seg.path("msgs"), start, fill)
        return os.path.basename(aside)

    def _set_aside(self, no: int) -> None:
        """Rename an unreadable segment out of the way (kept for inspection, never loaded again)."""
        for kind in self.SEGMENT_KINDS:
            name = f"{kind}.{no:010d}"
            try:
                os.replace(os.path.join(self.path, name), os.path.join(self.path, name + ".corrupt"))
            except OSError:
                pass
        self._dir_dirty = True

    def _unlink(self, name: str) -> None:
        try:
            os.unlink(os.path.join(self.path, name))
        except OSError:
            return
        if write_observer.current is not None:
            write_observer.current.delete(os.path.join(self.path, name))
