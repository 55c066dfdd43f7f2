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

The rate given is the most the pacer allows; it adapts below it (``adapt``). What a delete costs the
other queues is the cores it takes, and how much that hurts depends on what else runs on them: with
the fixed 2,000/s a confirming publisher's p99 during 30,000 deletes was 1.5-3.4 ms at load 3.5-5.6
on 2 cores, 0.8-0.9 ms at 700/s (docs/benchmarks.md, "Deletes paced by the round trips"). The node
feeds the pacer delays that should be near zero: the lateness of the pacer's own timer wake-ups (this
loop waited for a core, or behind its own long turns) and the round trip of each pipelined delete's
count query to the queue's shard process (a publisher's round trip to that process waits for the
same things: its turns and its cores). Over each ``ADAPT_WINDOW_S`` their mean above ``LATE_S``
halves the rate (not below ``MIN_SHARE`` of the rate given, nor ``MIN_RATE`` unless the rate given is
lower: a low rate does not adapt); below half of it the rate climbs back by
``STEP_SHARE`` of it per window. A run of deletes after a pause starts at the full rate.
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
# Adaptive rate (see the module docstring): one decision per window of delays ...
ADAPT_WINDOW_S = 0.25
# ... from their mean lateness: above this the rate halves, below half of it the rate climbs.
LATE_S = 0.002
MIN_SHARE = 0.125  # the slowest pace, a share of the rate given (2,000/s: 250/s) ...
# ... and never below this (nor the rate given, when lower): a node given a low rate is gentle already,
# and the rate's floor bounds how long a big delete may take (100,000 queues: 400 s at 250/s).
MIN_RATE = 250.0
STEP_SHARE = 0.125  # the climb per quiet window, a share of the rate given
IDLE_RESET_S = 1.0  # no wake-up for this long after a window's end: the next deletes start at the full rate


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

    __slots__ = ("rate", "max_rate", "adaptive", "burst", "_tokens", "_stamp", "_waiters", "_timer", "_loop",
                 "_due", "_late_sum", "_late_n", "_window_end", "on_adapt")

    def __init__(self, loop: asyncio.AbstractEventLoop, rate: float, burst: int = 32, adaptive: bool = True) -> None:
        self._loop = loop
        self.rate = float(rate)  # the pace now: max_rate, or less while the cores are busy (adapt)
        self.max_rate = float(rate)
        self.adaptive = adaptive
        self._due = 0.0  # when the armed timer should fire (time.monotonic)
        self._late_sum = 0.0
        self._late_n = 0
        self._window_end = 0.0
        # Called with (rate, mean lateness) after each window's decision (the turn probe's lines, tests).
        self.on_adapt: Callable[[float, float], None] | None = None
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
        if self._timer is None:  # else armed for the first waiter, which this one queues behind
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
        if self._timer is None:  # else armed for the first waiter: 500 pipelined deletes re-armed it 500 times
            self._arm()

    def adapt(self, late: float, now: float) -> None:
        """A delay that should be near zero was ``late`` seconds (seen at ``now``, time.monotonic): a
        wake-up's lateness or a delete's shard round trip. The rate changes once per ADAPT_WINDOW_S,
        from the window's mean delay (the module docstring)."""
        self._late_sum += max(0.0, late)
        self._late_n += 1
        if now < self._window_end:
            return
        if now > self._window_end + IDLE_RESET_S:
            # The first wake-up of a run of deletes (none for a while): a new window, at the full rate.
            self._late_sum, self._late_n = 0.0, 0
            self._window_end = now + ADAPT_WINDOW_S
            self.rate = self.max_rate
            return
        mean = self._late_sum / self._late_n
        self._late_sum, self._late_n = 0.0, 0
        self._window_end = now + ADAPT_WINDOW_S
        rate = self.rate
        if mean > LATE_S:
            floor = min(self.max_rate, max(MIN_RATE, self.max_rate * MIN_SHARE))
            rate = max(floor, rate * 0.5)
        elif mean < LATE_S / 2:
            rate = min(self.max_rate, rate + self.max_rate * STEP_SHARE)
        if rate != self.rate:
            self._refill()  # the tokens earned so far at the old pace
            self.rate = rate
        if self.on_adapt is not None:
            self.on_adapt(rate, mean)

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
        self._due = self._stamp + delay
        self._timer = self._loop.call_later(delay, self._wake)

    def _wake(self) -> None:
        self._timer = None
        self._refill()
        if self.adaptive and self.max_rate > 0:
            self.adapt(self._stamp - self._due, self._stamp)
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
