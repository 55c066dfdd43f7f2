"""The node notices a hung shard (alive, silent) by its control plane, and kills it to be restarted.

A shard that crashes is restarted by the supervisor (broker/supervisor.py). One that hangs - its
process stopped (SIGSTOP, a debugger), its event loop stuck in a call that never returns, a page
fault on a dead NFS mount - stays alive, holds its queues and answers nothing: publishes to them
wait forever, consumers get nothing, and in a cluster the node keeps its lease (the fence watchdog
sees a stalled *fsync* through the shard's beacon, broker/fsync_beacon.py, not a stalled loop).

Every running shard sends the node a STATS report each ``--stats-interval`` (and more: APPLIED,
REPL_STATUS, requests), from its event loop. The node notes when it last heard from each shard
(``heard``, one clock read per control batch); a shard that has loaded its snapshot and sent nothing
for ``--shard-hang-timeout`` seconds is hung: the node logs it and SIGKILLs it, and the supervisor
restarts it as after a crash (new epoch, queues recovered from disk, frontends nack what was in
flight on it; in a cluster its followers' streams are handed to the new process). No new contract
kind: the silence of a report that is due anyway is the signal.

What a silence does not mean: the node's own loop held (it reads the reports late) - a check that
runs late after such a pause starts every shard's clock again; a stop under way (a stopping shard
sends no more reports) - nothing is checked once the node stops its workers; a shard still loading
(100,000 queues take seconds in one piece before its first APPLIED) - only shards that applied their
snapshot are watched. The timeout is at least three report intervals.

RabbitMQ has no per-process hang detection inside a node (an Erlang process that is merely busy is
left alone); a node that stops answering its peers is cut off by net_ticktime (60 s), and a quorum
queue's Raft followers elect a new leader when its heartbeats stop. LavinMQ runs one process, whose
lease keep-alive thread outlives a stuck main loop (its #2151: a stalled disk kept "leading").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Callable, Iterable
from typing import Any, Protocol

log = logging.getLogger("shardmq.node")


class Watched(Protocol):
    """What the watchdog reads of a worker (broker/supervisor.py WorkerProcess)."""

    role: str
    index: int
    connected: bool  # HELLO received and SNAPSHOT sent
    applied: int  # -1 until it applied its SNAPSHOT
    proc: Any  # asyncio.subprocess.Process | None


class ShardWatchdog:
    def __init__(self, loop: asyncio.AbstractEventLoop, timeout: float, interval: float,
                 workers: Callable[[], Iterable[Watched]], stopping: Callable[[], bool]) -> None:
        self.loop = loop
        # Off at 0; else never within three reports (one that comes a little late is no hang).
        self.timeout = max(timeout, 3 * interval) if timeout > 0 else 0.0
        self.interval = interval
        self.period = max(0.05, min(1.0, self.timeout / 4))
        self._workers = workers
        self._stopping = stopping
        self.heard: dict[int, float] = {}  # shard pid -> loop time of its last control batch
        self.killed = 0
        self._checked = loop.time()
        self._timer: asyncio.TimerHandle | None = None

    def start(self) -> None:
        if self.timeout > 0 and self._timer is None:
            self._checked = self.loop.time()
            self._timer = self.loop.call_later(self.period, self._check)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def heard_from(self, pid: int | None) -> None:
        """A control batch from this worker's process (Node._on_control)."""
        if pid is not None:
            self.heard[pid] = self.loop.time()

    def _check(self) -> None:
        now = self.loop.time()
        late = now - self._checked > 2 * self.period + 1.0  # our own loop was held: we read late
        self._checked = now
        self._timer = self.loop.call_later(self.period, self._check)
        if self._stopping():
            self.heard.clear()
            return
        live: set[int] = set()
        for w in self._workers():
            proc = w.proc
            if w.role != "shard" or proc is None or proc.returncode is not None or not w.connected or w.applied < 0:
                continue
            pid = proc.pid
            live.add(pid)
            last = self.heard.get(pid)
            if last is None or late:
                self.heard[pid] = now  # watched from now on (or again, after our own pause)
                continue
            silent = now - last
            if silent > self.timeout:
                log.error("shard %d (pid %d) has sent nothing for %.1f s (it reports every %g s; "
                          "--shard-hang-timeout): hung, killed; the supervisor restarts it", w.index, pid, silent,
                          self.interval)
                self.killed += 1
                del self.heard[pid]
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for pid in [p for p in self.heard if p not in live]:
            del self.heard[pid]  # exited or restarted: a new process gets a new entry
