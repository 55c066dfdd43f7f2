"""Spawning, watching and restarting the node's worker processes."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from collections.abc import Callable

log = logging.getLogger("shardmq.supervisor")

_MODULES = {"frontend": "frontend.main", "shard": "shard.main"}
_MAX_BACKOFF_S = 5.0


class WorkerProcess:
    """One frontend or shard: its OS process and what the node knows of its state."""

    def __init__(self, role: str, index: int) -> None:
        self.role = role
        self.index = index
        self.proc: asyncio.subprocess.Process | None = None
        self.connected = False  # HELLO received and SNAPSHOT sent
        self.applied = -1  # highest definitions version it has applied
        self.restarts = 0
        self.last_start = 0.0

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def name(self) -> str:
        return f"{self.role} {self.index}"


class Supervisor:
    """Keeps every worker running; calls on_exit(worker, returncode) when one dies."""

    def __init__(
        self,
        run_dir: str,
        log_level: str,
        on_exit: Callable[[WorkerProcess, int], None],
        on_spawn: Callable[[WorkerProcess], None],
    ) -> None:
        self.run_dir = run_dir
        self.log_level = log_level
        self.on_exit = on_exit
        self.on_spawn = on_spawn
        self.workers: list[WorkerProcess] = []
        self.stopping = False
        self._watchers: set[asyncio.Task] = set()
        self._killed: list[asyncio.subprocess.Process] = []  # by kill_role, until forget_all reaps them
        # Roles whose dead workers are not restarted (a fenced leader's frontends); any thread may add.
        self.held: set[str] = set()

    async def spawn(self, worker: WorkerProcess) -> None:
        if worker not in self.workers:
            self.workers.append(worker)
        worker.connected = False
        worker.applied = -1
        worker.last_start = time.monotonic()
        while True:
            try:
                worker.proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", _MODULES[worker.role],
                    "--index", str(worker.index), "--run-dir", self.run_dir, "--log-level", self.log_level,
                )
                break
            except OSError as exc:
                # No fds, no memory, EAGAIN: a worker that could not be started is retried, never dropped.
                if self.stopping:
                    raise
                log.error("cannot start %s: %s; retrying in %.1f s", worker.name, exc, _MAX_BACKOFF_S)
                await asyncio.sleep(_MAX_BACKOFF_S)
        log.info("started %s (pid %d)", worker.name, worker.proc.pid)
        # Watch first: nothing that happens after the fork (on_spawn writes run/pids.json, which can
        # fail on a full disk) may leave a child unwatched, or its death would never be noticed.
        task = asyncio.get_running_loop().create_task(self._watch(worker, worker.proc))
        self._watchers.add(task)
        task.add_done_callback(self._watchers.discard)
        try:
            self.on_spawn(worker)
        except Exception:
            log.exception("after starting %s: on_spawn failed (supervision goes on)", worker.name)

    async def _watch(self, worker: WorkerProcess, proc: asyncio.subprocess.Process) -> None:
        code = await proc.wait()
        if proc is not worker.proc or worker not in self.workers or worker.role in self.held:
            return
        worker.connected = False
        if self.stopping:
            return
        log.error("%s (pid %d) exited with %s; restarting", worker.name, proc.pid, _describe(code))
        self.on_exit(worker, code)
        # Crash loops back off; a worker that ran a while restarts at once.
        ran = time.monotonic() - worker.last_start
        worker.restarts = 0 if ran > 30 else worker.restarts + 1
        delay = min(_MAX_BACKOFF_S, 0.1 * (2 ** worker.restarts)) if worker.restarts > 1 else 0.0
        if delay:
            await asyncio.sleep(delay)
        if not self.stopping:
            await self.spawn(worker)

    def pids(self) -> dict:
        out: dict = {"node": os.getpid(), "frontend": {}, "shard": {}}
        for w in self.workers:
            if w.pid is not None:
                out[w.role][str(w.index)] = w.pid
        return out

    def signal_role(self, role: str, sig: int) -> None:
        """Send ``sig`` to the running workers of one role (SIGHUP: frontends re-read TLS certificates)."""
        for w in self.workers:
            if w.role == role and w.proc is not None and w.proc.returncode is None:
                try:
                    w.proc.send_signal(sig)
                except ProcessLookupError:
                    pass
    def kill_role(self, role: str) -> None:
        """SIGKILL every worker of ``role`` now, without restarting them (a leader's fence)."""
        self.held.add(role)
        for w in self.workers:
            if w.role == role and w.proc is not None and w.proc.returncode is None:
                w.connected = False
                try:
                    w.proc.send_signal(signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self._killed.append(w.proc)
        # Forgotten workers are not restarted (_watch checks membership).
        self.workers = [w for w in self.workers if w.role != role]

    async def forget_all(self) -> None:
        """Kill and forget every worker and wait until all of them are gone (a node that steps down)."""
        self.kill_role("frontend")
        self.kill_role("shard")
        killed, self._killed = self._killed, []
        await asyncio.gather(*(p.wait() for p in killed), return_exceptions=True)

    async def stop_role(self, role: str, timeout: float) -> None:
        procs = [w.proc for w in self.workers if w.role == role and w.proc and w.proc.returncode is None]
        if not procs:
            return
        try:
            async with asyncio.timeout(timeout):
                await asyncio.gather(*(p.wait() for p in procs))
        except TimeoutError:
            for p in procs:
                if p.returncode is None:
                    log.warning("pid %d did not stop in %.0f s; killing it", p.pid, timeout)
                    p.send_signal(signal.SIGKILL)
            await asyncio.gather(*(p.wait() for p in procs))


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"status {code}"
