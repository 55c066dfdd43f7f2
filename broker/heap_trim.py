"""Give the heap back to the kernel after a wave of closed connections (glibc ``malloc_trim``).

Two things kept a frontend 20-30 MB above its fresh size after 10,000 connections came and went.
A closed connection's objects (connection, channels, transport, timers: ~20 per connection) are
in reference cycles, and they had reached the oldest GC generation while open: an idle process
allocates too little to ever trigger a full collection, so they stayed. And what CPython
allocates through malloc (objects above 512 bytes, dict and list tables, buffers) goes back to
glibc, which keeps freed pages for reuse. So after a wave of closes: ``gc.collect()``, then
``malloc_trim(0)``, which releases every free page of every malloc arena. (CPython's own 1 MiB
arenas are unmapped only when every object in them is gone; a few survivors keep one resident,
which neither call can help.) Both walk the heap (a full collection: 60-75 ms in a
frontend holding the definitions of 100,000 queues), so they run off the hot path: after
``threshold`` closes, once the closes stop (see ``HeapTrimmer``), at most once per
``min_interval``. Objects frozen at boot (broker/gc_pause.py) are not walked.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import time
from collections.abc import Callable

log = logging.getLogger("shardmq.heap")


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        fn = ctypes.CDLL("libc.so.6").malloc_trim  # glibc only (musl has none: nothing to do there)
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


def trim() -> None:
    """``malloc_trim(0)`` now (nothing without glibc): after a one-off burst of big temporary
    buffers, such as the node's boot (the definitions file's text, its parse, the packed
    SNAPSHOT), whose free pages in the middle of the heap glibc would otherwise keep."""
    fn = _malloc_trim()
    if fn is not None:
        fn(0)


class HeapTrimmer:
    """Counts closes; once ``threshold`` have come since the last trim, trims when they stop coming.

    "Stop": no close for ``quiet`` seconds (the wave is over; a full collection then pauses no
    client that is opening or closing), or ``max_wait`` after the threshold was crossed under a
    steady churn (whose allocations make CPython run full collections by itself anyway). Never
    more often than once per ``min_interval``. ``collect``: run ``gc.collect()`` first (frontends:
    their closed connections are cyclic garbage; the node's connection rows are not, and a full
    collection over its definitions would pause it for nothing: 59 ms with 100,000 queues).
    """

    __slots__ = ("loop", "threshold", "quiet", "max_wait", "min_interval", "collect", "pending", "trims",
                 "_last", "_last_close", "_armed_at", "_handle", "_trim")

    def __init__(self, loop: asyncio.AbstractEventLoop, *, collect: bool, threshold: int = 1000,
                 quiet: float = 1.0, max_wait: float = 60.0, min_interval: float = 10.0) -> None:
        self.loop = loop
        self.threshold = threshold
        self.quiet = quiet
        self.max_wait = max_wait
        self.min_interval = min_interval
        self.collect = collect
        self.pending = 0  # closes since the last trim
        self.trims = 0  # trims done (the frontends report it: shardmq_frontend_heap_trims)
        self._last = float("-inf")  # monotonic time of the last trim
        self._last_close = 0.0
        self._armed_at = 0.0
        self._handle: asyncio.TimerHandle | None = None
        self._trim = _malloc_trim()

    def closed(self, n: int = 1) -> None:
        """``n`` connections (or what else held memory per client) are gone."""
        if not n or self._trim is None:
            return
        self.pending += n
        self._last_close = now = time.monotonic()
        if self.pending >= self.threshold and self._handle is None:
            self._armed_at = now
            self._handle = self.loop.call_later(max(self.quiet, self._last + self.min_interval - now), self._due)

    def _due(self) -> None:
        now = time.monotonic()
        wait = self._last_close + self.quiet - now  # closes still coming: wait for a quiet second
        if wait > 0 and now - self._armed_at < self.max_wait:
            self._handle = self.loop.call_later(wait, self._due)
            return
        self._handle = None
        self.pending = 0
        self._last = now
        t0 = time.perf_counter()
        freed = gc.collect() if self.collect else 0
        t1 = time.perf_counter()
        self._trim(0)
        self.trims += 1
        log.debug("after a wave of closes: gc.collect %.1f ms (%d objects), malloc_trim %.1f ms",
                  (t1 - t0) * 1000, freed, (time.perf_counter() - t1) * 1000)

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
