"""The definitions fence: the newest definitions version the node has broadcast, one shared word.

The node maps ``run/defs.fence`` (``contract.defs_fence_path``: 8 bytes, a native unsigned 64-bit
integer) read-write and is its only writer; every worker maps it read-only. For a change it answers
without waiting for the workers' ``APPLIED`` (a bind, an unbind, an exchange declare or delete:
``broker/node.py`` ``_request_at_once`` and ``_commit(fenced=True)``), the node raises the word to
the change's version *before* it puts the ``DEFS`` carrying that version for the workers' sockets,
and answers only after both. A worker, before it acts on input from a client (a frontend's
``data_received``, AMQP, MQTT and WebSocket alike) or from another worker (a shard's data-plane
batch, and before it routes a dead letter or a due delayed message), compares the word with the
version it has applied: one memory read, no system call. When the word is newer it reads and
applies its control plane at once until it has that version (``UnixDealer.read_until``), whatever
the 2 ms per-turn cap of control-plane reads says: the DEFS are in its socket, or about to be.

Why that keeps the guarantee "a publish on any connection right after bind-ok routes through the
binding": the node's store to the word happens before the ``REPLY``, which happens before the
frontend writes ``bind-ok``, which happens before the client can send anything that depends on it;
every step in between is a system call on a socket (write, then read in another process), which
orders memory on every CPU Linux runs on. So any input a worker reads after the client acted on the
``*-Ok`` finds the word already raised, and the worker applies the change before it routes that input.
Input read earlier was sent before the ``*-Ok``, so the client cannot expect it to see the change.

The word only grows while workers run: a node (re)starting its workers (its own boot, a cluster
promotion) writes 0 before it spawns them, and every worker's ``SNAPSHOT`` carries a version at least
the word's. A worker's versions only grow too (``SNAPSHOT``, then ``DEFS`` in order).

``SHARDMQ_TEST_CONTROL_DELAY_MS`` is for tests only: ``MS`` for every worker, or entries ``WHO:MS``
separated by commas for the workers named, by role or identity (``fe-1:300,shard:300``). Such a
worker holds what it reads on its control plane that many milliseconds before it handles it
(``broker/unixio.py`` ``_DelayedStream``), as a worker that the scheduler does not run for a while
would. The fence's catch-up reads the held bytes at once, so with the fence a publish right after
bind-ok still routes through the binding; without it, it would not. Never set it in production.
"""

from __future__ import annotations

import logging
import mmap
import os
from collections.abc import Callable
from typing import Any

from broker import contract

_SIZE = 8
# How long a worker waits for DEFS the word announces: the node writes them in the loop turn it
# raised the word in, so this is only reached when the node is stuck or gone (then the worker goes
# on with what it has, and says so).
CATCH_UP_TIMEOUT_S = 2.0
TEST_DELAY_ENV = "SHARDMQ_TEST_CONTROL_DELAY_MS"
log = logging.getLogger("shardmq.defs_fence")


class FenceWord:
    """The node's side: ``raise_to(version)`` before the DEFS of a fenced change are put."""

    def __init__(self, run_dir: str) -> None:
        fd = os.open(contract.defs_fence_path(run_dir), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < _SIZE:
                os.ftruncate(fd, _SIZE)
            self._map = mmap.mmap(fd, _SIZE)
        finally:
            os.close(fd)
        self._word = memoryview(self._map).cast("Q")
        self.version = 0
        self.reset()

    def raise_to(self, version: int) -> None:
        if version > self.version:
            self.version = version
            self._word[0] = version  # one aligned 8-byte store

    def reset(self) -> None:
        """Before (re)starting the workers: their snapshots start the versions again."""
        self.version = 0
        self._word[0] = 0

    def close(self) -> None:
        self._word.release()
        self._map.close()


def open_fence(run_dir: str) -> memoryview:
    """A worker's read-only view of the word: ``view[0]`` is the newest fenced version."""
    fd = os.open(contract.defs_fence_path(run_dir), os.O_RDONLY)
    try:
        m = mmap.mmap(fd, _SIZE, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    return memoryview(m).cast("Q")


def control_delay_for_tests_s(role: str, identity: str) -> float:
    """SHARDMQ_TEST_CONTROL_DELAY_MS for this worker, in seconds (tests only, see the module doc);
    0.0 when unset or when no entry names it."""
    for entry in os.environ.get(TEST_DELAY_ENV, "").split(","):
        who, named, ms = entry.strip().rpartition(":")
        if named and who not in (role, identity):
            continue
        try:
            return max(0.0, float(ms) / 1000)
        except ValueError:
            return 0.0
    return 0.0


def catch_up(node: Any, fence: memoryview, applied: Callable[[], int], gave_up: int, who: str) -> int:
    """A worker's catch-up (frontend and shard alike): read and apply ``node``'s control plane until
    ``applied()`` reaches the fence word. A version already waited for in vain is not waited for
    again (the input would stall for good); what has arrived since is still applied. Returns the
    version given up on, for the next call."""
    target = fence[0]
    timeout = 0.0 if target <= gave_up else CATCH_UP_TIMEOUT_S
    if not node.read_until(lambda: applied() >= target, timeout) and timeout:
        log.warning("%s: definitions version %d announced, still at %d after %.1f s",
                    who, target, applied(), CATCH_UP_TIMEOUT_S)
        return target
    return gave_up
