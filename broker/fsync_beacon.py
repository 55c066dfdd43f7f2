"""How long a shard's group fsync has been running, readable by the node without asking the shard.

Each shard maps ``run/fsync-shard-N`` (16 bytes: its pid, then the CLOCK_MONOTONIC time its
running group sync started, 0.0 when none runs). It writes the time when a group sync starts and
0.0 when it returns: two 8-byte stores into shared memory per group sync, nothing per message, no
system call. The cluster leader's fence watchdog (replication/cluster.py) reads the files: an
fsync that has not returned within the bound means the disk is stalled and the leader steps down
(LavinMQ #2151). A shard stuck in the kernel cannot answer STATS or any other message, hence a
file the node reads by itself. CLOCK_MONOTONIC is one clock for every process of the host.

The pid tells a live shard's beacon from the one a killed shard left behind: a restarted shard
clears the time before it writes its new pid, so a reader never sees the new pid with a stale time.

``SHARDMQ_TEST_STALL_FSYNC_WHILE=PATH`` is a fault injection for tests only: while PATH exists a
group sync blocks before its fsync, as a stalled disk would (SIGSTOP cannot show this: it stops
the watchdog's view of the shard too, and no test machine has dm-delay). Never set it in production.
``SHARDMQ_TEST_STALL_KV_FSYNC_WHILE=PATH`` does the same to the KV stores' sync round (shard/kvstore.py)
only, so a test can hold an MQTT QoS 2 mark un-synced while the queues sync.
"""

from __future__ import annotations

import mmap
import os
import struct
import time

from broker import contract

_FORMAT = struct.Struct("=qd")  # pid, started (monotonic seconds; 0.0 = no sync running)
_STALL_PATH = os.environ.get("SHARDMQ_TEST_STALL_FSYNC_WHILE") or None
_KV_STALL_PATH = os.environ.get("SHARDMQ_TEST_STALL_KV_FSYNC_WHILE") or None


class FsyncBeacon:
    """The shard's side: ``started()`` before a group sync, ``done()`` after it."""

    def __init__(self, run_dir: str, index: int) -> None:
        path = contract.fsync_beacon_path(run_dir, index)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < _FORMAT.size:
                os.ftruncate(fd, _FORMAT.size)
            self._map = mmap.mmap(fd, _FORMAT.size)
        finally:
            os.close(fd)
        struct.pack_into("=d", self._map, 8, 0.0)  # the time first (see the module doc)
        struct.pack_into("=q", self._map, 0, os.getpid())

    def started(self) -> None:
        struct.pack_into("=d", self._map, 8, time.monotonic())

    def done(self) -> None:
        struct.pack_into("=d", self._map, 8, 0.0)

    def close(self) -> None:
        self.done()
        self._map.close()


def running_since(run_dir: str, index: int) -> tuple[int, float]:
    """(pid, start time) of shard ``index``'s running group sync; (0, 0.0) when none or no file."""
    try:
        with open(contract.fsync_beacon_path(run_dir, index), "rb") as f:
            data = f.read(_FORMAT.size)
    except OSError:
        return 0, 0.0
    if len(data) < _FORMAT.size:
        return 0, 0.0
    return _FORMAT.unpack(data)


def stall_for_tests(kv: bool = False) -> None:
    """SHARDMQ_TEST_STALL_FSYNC_WHILE (kv: ..._KV_FSYNC_WHILE): block while the file exists (tests only)."""
    path = _KV_STALL_PATH if kv else _STALL_PATH
    if path is not None:
        while os.path.exists(path):
            time.sleep(0.02)
