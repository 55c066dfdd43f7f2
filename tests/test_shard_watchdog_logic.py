"""broker/shard_watchdog.py's rules, on a real child process standing in for a shard (no node)."""

from __future__ import annotations

import asyncio
import subprocess
import sys

from broker.shard_watchdog import ShardWatchdog


class _Worker:
    def __init__(self, proc: subprocess.Popen, role: str = "shard", applied: int = 3) -> None:
        self.role, self.index, self.connected, self.applied, self.proc = role, 1, True, applied, proc


def _child() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def _run(check) -> None:
    loop = asyncio.new_event_loop()
    try:
        check(loop)
    finally:
        loop.close()


def test_silence_past_the_timeout_kills_only_a_ready_shard_and_not_while_stopping_or_after_our_own_pause():
    procs = [_child() for _ in range(3)]
    try:
        shard, loading, frontend = _Worker(procs[0]), _Worker(procs[1], applied=-1), _Worker(procs[2], "frontend")
        stopping = [False]

        def check(loop: asyncio.AbstractEventLoop) -> None:
            dog = ShardWatchdog(loop, 2.0, 0.2, lambda: [shard, loading, frontend], lambda: stopping[0])
            now = loop.time()
            for p in procs:
                dog.heard[p.pid] = now - 10  # silent for 10 s
            dog._checked = now - 10  # ... but so were we (the node's loop was held): no kill
            dog._check()
            assert dog.killed == 0 and dog.heard[shard.proc.pid] >= now
            dog.heard[shard.proc.pid] = now - 10
            stopping[0] = True  # a stop under way: shards stop reporting
            dog._checked = loop.time()
            dog._check()
            assert dog.killed == 0
            stopping[0] = False
            dog.heard[shard.proc.pid] = loop.time() - 10
            dog._checked = loop.time()
            dog._check()
            assert dog.killed == 1
            dog.stop()

        _run(check)
        assert procs[0].wait(10) == -9
        assert procs[1].poll() is None and procs[2].poll() is None  # still loading; not a shard
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_the_timeout_is_never_under_three_reports_and_0_is_off():
    def check(loop: asyncio.AbstractEventLoop) -> None:
        assert ShardWatchdog(loop, 1.0, 5.0, list, lambda: False).timeout == 15.0
        assert ShardWatchdog(loop, 30.0, 5.0, list, lambda: False).timeout == 30.0
        off = ShardWatchdog(loop, 0.0, 5.0, list, lambda: False)
        off.start()
        assert off.timeout == 0 and off._timer is None

    _run(check)
