"""Spawning, watching and restarting the node's worker processes."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

from broker import contract

log = logging.getLogger("shardmq.supervisor")

_MODULES = {"frontend": "frontend.main", "shard": "shard.main"}
_PAIR_MODULE = "shard.pair_main"  # frontend K and shard K in one process (--colocate)
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
        # Set (by the node) when this worker's control-plane connection closed: in a paired process
        # the frontend part stops (node STOP) while the process, and its shard, go on.
        self.left = asyncio.Event()

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
        pairs: int = 0,
    ) -> None:
        self.run_dir = run_dir
        # Frontend i and shard i run in one process (shard/pair_main.py) for i < pairs (--colocate).
        self.pairs = pairs
        self.log_level = log_level
        self.on_exit = on_exit
        self.on_spawn = on_spawn
        self.workers: list[WorkerProcess] = []
        self.stopping = False
        self._watchers: set[asyncio.Task] = set()
        self._killed: list[asyncio.subprocess.Process] = []  # by kill_role, until forget_all reaps them
        # Roles whose dead workers are not restarted (a fenced leader's frontends); any thread may add.
        self.held: set[str] = set()

    def partner(self, worker: WorkerProcess) -> WorkerProcess | None:
        """The other role of ``worker``'s pair, when it is paired and that role is supervised."""
        if worker.index >= self.pairs:
            return None
        for w in self.workers:
            if w.index == worker.index and w.role != worker.role:
                return w
        return None

    async def spawn(self, worker: WorkerProcess) -> None:
        if worker not in self.workers:
            self.workers.append(worker)
        worker.connected = False
        worker.applied = -1
        worker.last_start = time.monotonic()
        worker.left = asyncio.Event()
        paired = worker.index < self.pairs
        if paired:
            other = self.partner(worker)
            if other is not None and other.proc is not None and other.proc.returncode is None:
                # The pair's process is up (spawned for the other role): this role runs in it too.
                worker.proc = other.proc
                log.info("%s runs in %s's process (pid %d)", worker.name, other.name, worker.proc.pid)
                try:
                    self.on_spawn(worker)
                except Exception:
                    log.exception("after starting %s: on_spawn failed (supervision goes on)", worker.name)
                return
        while True:
            try:
                worker.proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", _PAIR_MODULE if paired else _MODULES[worker.role],
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
        # A paired process is both its workers: both died, both are handled and restarted together.
        other = self.partner(worker)
        if other is not None and other.proc is proc:
            other.connected = False
        worker.connected = False
        if self.stopping:
            return
        if worker.index < self.pairs and "frontend" in self.held:
            # A fenced leader's paired shard: its restart would bring the frontend part back with it.
            log.error("%s (pid %d) exited with %s; not restarted (its pair's frontend is stopped)", worker.name,
                      proc.pid, _describe(code))
            return
        log.error("%s (pid %d) exited with %s; restarting", worker.name, proc.pid, _describe(code))
        if other is not None and other.proc is proc:
            # The frontend's loss first (its connections are gone), then the shard's new epoch.
            for w in sorted((worker, other), key=lambda w: w.role != "frontend"):
                self.on_exit(w, code)
        else:
            other = None
            self.on_exit(worker, code)
        # Crash loops back off; a worker that ran a while restarts at once.
        ran = time.monotonic() - worker.last_start
        worker.restarts = 0 if ran > 30 else worker.restarts + 1
        delay = min(_MAX_BACKOFF_S, 0.1 * (2 ** worker.restarts)) if worker.restarts > 1 else 0.0
        if delay:
            await asyncio.sleep(delay)
        if not self.stopping:
            await self.spawn(worker)
            if other is not None and not self.stopping:
                other.restarts, other.last_start = worker.restarts, worker.last_start
                await self.spawn(other)  # into the process just started

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

    def stop_frontends_now(self) -> tuple[list[int], list[int]]:
        """From any thread (the fence watchdog's, or the loop): every frontend stops at once and is not
        restarted. A frontend process of its own is SIGKILLed; a paired process (--colocate) gets
        ``contract.FRONTEND_STOP_SIGNAL``: its frontend part closes its listeners and every client
        connection as the process's death would, and its shard part lives on (a fence: the shards
        stream what they have to the followers until the node stops them). Touches no list but
        ``held`` (another thread may run this while the loop changes ``workers``). Returns the pids
        killed and the paired pids told to stop their frontend part (for the log)."""
        self.held.add("frontend")  # before the signals: the supervisor must not restart them
        killed: list[int] = []
        paired: list[int] = []
        for w in list(self.workers):
            proc = w.proc
            if w.role == "frontend" and proc is not None and proc.returncode is None:
                pair = w.index < self.pairs
                try:
                    os.kill(proc.pid, contract.FRONTEND_STOP_SIGNAL if pair else signal.SIGKILL)
                except ProcessLookupError:
                    continue
                (paired if pair else killed).append(proc.pid)
        return killed, paired

    def kill_role(self, role: str) -> None:
        """SIGKILL every worker of ``role`` now and forget them, without restarting them (a leader's
        fence, a step down). Frontends: ``stop_frontends_now`` (a pair's frontend part only)."""
        if role == "frontend":
            self.stop_frontends_now()
        self.held.add(role)
        for w in self.workers:
            if w.role == role and w.proc is not None and w.proc.returncode is None:
                w.connected = False
                if role == "frontend":
                    if w.index < self.pairs:
                        continue  # the process goes on with its shard part: killed with the shards, if at all
                else:
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
        """Wait until every worker of ``role`` has stopped: its process has exited or, in a pair whose
        other role still runs, its control-plane connection closed (``left``); kill what has not."""
        live = [w for w in self.workers if w.role == role and w.proc and w.proc.returncode is None]
        if not live:
            return
        procs = [w.proc for w in live]

        def stopped(w: WorkerProcess) -> Any:
            other = self.partner(w)
            if other is None or other.proc is not w.proc or other.proc.returncode is not None:
                return w.proc.wait()
            # What closed before this call was an earlier connection (the node sends STOP and calls
            # this without yielding in between): only a close from now on is this stop's.
            w.left.clear()
            return _first(w.proc.wait(), w.left.wait())

        try:
            async with asyncio.timeout(timeout):
                await asyncio.gather(*(stopped(w) for w in live))
        except TimeoutError:
            for p in procs:
                if p.returncode is None:
                    log.warning("pid %d did not stop in %.0f s; killing it", p.pid, timeout)
                    p.send_signal(signal.SIGKILL)
            await asyncio.gather(*(p.wait() for p in procs))


async def _first(*aws: Any) -> None:
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"status {code}"
