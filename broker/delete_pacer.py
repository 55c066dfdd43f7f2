"""Pacing of queue deletions in the node: a token bucket, so that deleting a vhost of 100,000
queues (or 100,000 pipelined queue.delete) does not take the machine's cores from publishing on
the other queues.

Every queue deletion costs work in several processes at once: the node plans, applies and
broadcasts it, every frontend and shard applies it, the owning shard closes the queue and its
reaper moves the directory aside and removes it. Unpaced, a delete of 30,000 queues ran at ~9,000/s
and kept the node, the frontend and the shard busy together for 3 s: on 2 cores a publisher on
another queue then waited for a core (probe round-trip p99 5 ms against RabbitMQ's 0.3 ms,
docs/benchmarks.md). Paced, the same work is spread thin: each slice the workers get is small
(tens of microseconds) and the cores stay free most of the time between slices.

A burst of ``burst`` deletions goes at once (an application deleting its few queues never waits);
beyond it deletions are granted at ``rate`` per second, in the order asked (FIFO), so one big
delete and a pipelined stream share the rate fairly and none is left unfinished. ``rate`` 0 turns
pacing off.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

# The bucket refills between grants at least this long: waiters are woken a few at a time (at 2,000/s,
# ~8 deletions per wake-up), so each worker gets one small DEFS batch per wake-up instead of one
# process wake-up per queue in every worker.
MIN_WAKE_S = 0.004


class _Grant:
    """A waiter that runs a function when granted (DeletePacer.when_granted): what the waiting deque
    asks of a future (done, set_result, cancelled), without a future, a task and a coroutine frame."""

    __slots__ = ("fn", "_done")

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn = fn
        self._done = False

    def done(self) -> bool:
        return self._done

    def cancelled(self) -> bool:
        return False

    def set_result(self, _result: None) -> None:
        self._done = True
        self.fn()


class DeletePacer:
    """Token bucket of queue deletions (see the module docstring)."""

    __slots__ = ("rate", "burst", "_tokens", "_stamp", "_waiters", "_timer", "_loop")

    def __init__(self, loop: asyncio.AbstractEventLoop, rate: float, burst: int = 32) -> None:
        self._loop = loop
        self.rate = float(rate)
        self.burst = max(1, int(burst))
        self._tokens = float(self.burst)
        self._stamp = time.monotonic()
        self._waiters: deque[tuple[int, asyncio.Future | _Grant]] = deque()
        self._timer: asyncio.TimerHandle | None = None

    def _refill(self) -> None:
        now = time.monotonic()
        self._tokens = min(float(self.burst), self._tokens + (now - self._stamp) * self.rate)
        self._stamp = now

    def try_take(self, n: int) -> bool:
        """Take n deletions now if nobody waits and the bucket allows it; False: await take(n)."""
        if self.rate <= 0 or n <= 0:
            return True
        if self._waiters:
            return False
        self._refill()
        # More than a burst at once (a slice bigger than the bucket): granted once the bucket is full,
        # the excess is owed (the tokens go negative) and paid by the next deletions' waits.
        if self._tokens >= min(n, self.burst):
            self._tokens -= n
            return True
        return False

    async def take(self, n: int) -> None:
        """Wait until n deletions may go (returns without yielding when they may go now)."""
        if self.try_take(n):
            return
        fut = self._loop.create_future()
        self._waiters.append((n, fut))
        self._arm()
        try:
            await fut
        except asyncio.CancelledError:
            # A cancelled waiter (its node stopping) gives way: the next ones are not held behind it.
            if not fut.done() or fut.cancelled():
                try:
                    self._waiters.remove((n, fut))
                except ValueError:
                    pass
                self._arm()
            raise

    def when_granted(self, n: int, fn: Callable[[], None]) -> None:
        """Call ``fn()`` once n deletions may go: now if they may (before this returns), else from the
        pacer's timer, in the same FIFO order as ``take``. 500 pipelined queue.delete waiting for
        their turn were 500 tasks (each a coroutine frame and futures) that every young garbage
        collection of the node walked: 2-3 ms per generation-1 collection."""
        if self.try_take(n):
            fn()
            return
        self._waiters.append((n, _Grant(fn)))
        self._arm()

    def waiting(self) -> int:
        """Deletions waiting for their turn (tests, stats)."""
        return sum(n for n, _ in self._waiters)

    def _arm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._waiters:
            return
        self._refill()
        n = self._waiters[0][0]
        missing = min(n, self.burst) - self._tokens
        delay = max(MIN_WAKE_S, missing / self.rate) if self.rate > 0 else 0.0
        self._timer = self._loop.call_later(delay, self._wake)

    def _wake(self) -> None:
        self._timer = None
        self._refill()
        waiters = self._waiters
        while waiters:
            n, fut = waiters[0]
            if fut.done():
                waiters.popleft()
                continue
            if self.rate > 0 and self._tokens < min(n, self.burst):
                break
            waiters.popleft()
            self._tokens -= n
            fut.set_result(None)
        self._arm()
