"""The node's data directory: exclusive lock, run dir, and start-up cleanup."""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import stat

from broker import temp_files

log = logging.getLogger("shardmq.datadir")

# Delay stores of delayed exchanges: <data>/delayed/<sha1(vhost)>/<sha1(exchange)>/ (shard/delayed.py).
# Outside the vhost directories, so no queue name can collide with them and remove_stale_queues
# leaves them alone.
DELAYED_DIR = "delayed"
# Each shard's outbox of dead letters sent to other shards and not yet confirmed by them:
# <data>/dead-letters/shard-N/ (shard/dead_letter_forwards.py).
DEAD_LETTERS_DIR = "dead-letters"


class DataDirLocked(RuntimeError):
    pass


class DataDirUnsafe(RuntimeError):
    """The data dir can be written by other users: they could plant files or reach run/ sockets."""


# Everything under the data dir is private to the node's user (definitions.json holds password
# hashes, segments hold message bodies): the node runs with this umask, whatever it inherited.
PRIVATE_UMASK = 0o077


def name_hash(name: str) -> str:
    """Directory name of a vhost or queue: the data layout does not depend on shard count."""
    return hashlib.sha1(name.encode()).hexdigest()


class DataDir:
    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(path)
        self.run_dir = os.path.join(self.path, "run")
        self._lock_fd: int | None = None

    def check_private(self) -> None:
        """Create the data dir 0700; refuse one others can write; take read access away from them."""
        os.makedirs(self.path, mode=0o700, exist_ok=True)
        st = os.stat(self.path)
        if st.st_mode & 0o022:
            raise DataDirUnsafe(
                f"data dir {self.path} is writable by other users (mode {stat.S_IMODE(st.st_mode):04o}); "
                f"refusing to start: run `chmod 700 {self.path}`"
            )
        if st.st_mode & 0o077 and st.st_uid == os.getuid():
            # A data dir of an older version (0755): its files were readable by every local user.
            os.chmod(self.path, 0o700)
            log.warning("data dir %s was mode %04o; changed to 0700", self.path, stat.S_IMODE(st.st_mode))

    def lock(self) -> None:
        self.check_private()
        fd = os.open(os.path.join(self.path, ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                owner = os.pread(fd, 32, 0).decode(errors="replace").strip()
            finally:
                os.close(fd)
            raise DataDirLocked(f"data dir {self.path} is in use by another shardmq node (pid {owner})") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd
        # Sockets of a previous (crashed) node are stale; workers bind fresh ones.
        shutil.rmtree(self.run_dir, ignore_errors=True)
        os.makedirs(self.run_dir, mode=0o700, exist_ok=True)

    def unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def write_pids(self, pids: dict) -> None:
        tmp = os.path.join(self.run_dir, "pids.json.tmp")
        with open(tmp, "w") as f:
            json.dump(pids, f)
        os.replace(tmp, os.path.join(self.run_dir, "pids.json"))

    def remove_stale_queues(self, keep: set[tuple[str, str]]) -> int:
        """Delete queue directories that no durable queue owns (transient queues of the last run)."""
        removed = _remove_unkept(self.path, keep, lambda e: len(e.name) == 40
                                 and os.path.exists(os.path.join(e.path, ".vhost")))
        if removed:
            log.info("removed %d queue directories of non-durable or deleted queues", removed)
        return removed

    def remove_stale_delay_stores(self, keep: set[tuple[str, str]]) -> int:
        """Delete delay stores whose exchange is gone (non-durable exchanges of the last run)."""
        root = os.path.join(self.path, DELAYED_DIR)
        if not os.path.isdir(root):
            return 0
        removed = _remove_unkept(root, keep, lambda _e: True)
        if removed:
            log.info("removed %d delay stores of non-durable or deleted exchanges", removed)
        return removed


def _remove_unkept(root: str, keep: set[tuple[str, str]], is_vhost_dir) -> int:
    """Under root/<sha1(vhost)>/<sha1(name)>/, delete the name directories not in keep."""
    wanted: dict[str, set[str]] = {}
    for vhost, name in keep:
        wanted.setdefault(name_hash(vhost), set()).add(name_hash(name))
    removed = 0
    for entry in os.scandir(root):
        if not entry.is_dir() or not is_vhost_dir(entry):
            continue
        kept = wanted.get(entry.name, set())
        for sub in os.scandir(entry.path):
            if sub.is_dir():
                if sub.name not in kept:
                    shutil.rmtree(sub.path, ignore_errors=True)
                    removed += 1
            elif temp_files.is_temp(sub.name):
                # A name file (.vhost) or idle index a killed shard left half written: the node's
                # boot lists every vhost dir here anyway, before any shard writes to one.
                temp_files.remove_found(entry.path, sub.name)
    return removed
