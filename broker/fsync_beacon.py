"""How long a shard's oldest running fsync has been running, readable by the node without asking.

Each shard maps ``run/fsync-shard-N`` (16 bytes: its pid, then the CLOCK_MONOTONIC time its
oldest running sync started, 0.0 when none runs). A shard has two kinds of sync that may run at
the same time, each at most one at a time: the queues' group sync (``"group"``) and the MQTT KV
stores' (``"kv"``, shard/kvstore.py). It writes the time when a sync starts and, when one returns,
the start of the other if it still runs, else 0.0: two 8-byte stores into shared memory per sync,
nothing per message, no system call. The cluster leader's fence watchdog (replication/cluster.py) reads the files: an
fsync that has not returned within the bound means the disk is stalled and the leader steps down
(LavinMQ #2151). A shard stuck in the kernel cannot answer STATS or any other message, hence a
file the node reads by itself. CLOCK_MONOTONIC is one clock for every process of the host.

The pid tells a live shard's beacon from the one a killed shard left behind: a restarted shard
clears the time before it writes its new pid, so a reader never sees the new pid with a stale time.

``SHARDMQ_TEST_STALL_FSYNC_WHILE=PATH`` is a fault injection for tests only: while PATH exists
every sync of either kind blocks before its fsync, as a stalled disk would (while ``PATH.<kind>``
exists, only that kind's; while ``PATH.shard-N`` exists, only shard N's group sync; SIGSTOP cannot show this: it stops the watchdog's view of the shard
too, and no test machine has dm-delay). Never set it in production.
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
    """The shard's side: ``started(kind)`` before a sync, ``done(kind)`` after it (loop thread)."""

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
        self._running: dict[str, float] = {}  # kind -> when its running sync started

    def started(self, kind: str = "group") -> None:
        now = time.monotonic()
        self._running[kind] = now
        struct.pack_into("=d", self._map, 8, min(self._running.values()))

    def done(self, kind: str = "group") -> None:
        self._running.pop(kind, None)
        struct.pack_into("=d", self._map, 8, min(self._running.values(), default=0.0))

    def close(self) -> None:
        self._running.clear()
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


def stall_for_tests(kind: str = "group", who: str = "") -> None:
    """Block while a test's stall file exists (tests only, see above): SHARDMQ_TEST_STALL_FSYNC_WHILE,
    its ``.<kind>`` twin or (``who``: "shard-N") its ``.shard-N`` twin, and for the KV sync also
    SHARDMQ_TEST_STALL_KV_FSYNC_WHILE."""
    paths = [] if _STALL_PATH is None else [_STALL_PATH, f"{_STALL_PATH}.{kind}"]
    if who and _STALL_PATH is not None:
        paths.append(f"{_STALL_PATH}.{who}")
    if kind == "kv" and _KV_STALL_PATH is not None:
        paths.append(_KV_STALL_PATH)
    if paths:
        while any(os.path.exists(path) for path in paths):
            time.sleep(0.02)
