"""Give the heap back to the kernel after a wave of closed connections (glibc ``malloc_trim``).

Two things kept a frontend 20-30 MB above its fresh size after 10,000 connections came and went.
A closed connection's objects (connection, channels, transport, timers: ~20 per connection) are
in reference cycles, and they had reached the oldest GC generation while open: an idle process
allocates too little to ever trigger a full collection, so they stayed. And what CPython
allocates through malloc (objects above 512 bytes, dict and list tables, buffers) goes back to
glibc, which keeps freed pages for reuse. So after a wave of closes: ``gc.collect()``, then
``malloc_trim(0)``, which releases every free page of every malloc arena. (CPython's own 1 MiB
arenas are unmapped only when every object in them is gone; a few survivors keep one resident,
which neither call can help.) Both walk the heap, so they run off the hot path: only after
``threshold`` closes, ``delay`` seconds after the wave crossed it (most of it is over by then), at
most once per ``min_interval``. Objects frozen at boot (broker/gc_pause.py) are not walked.
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


class HeapTrimmer:
    __slots__ = ("loop", "threshold", "delay", "min_interval", "pending", "trims", "_last", "_handle", "_trim")

    def __init__(self, loop: asyncio.AbstractEventLoop, threshold: int = 1000, delay: float = 1.0,
                 min_interval: float = 10.0) -> None:
        self.loop = loop
        self.threshold = threshold
        self.delay = delay
        self.min_interval = min_interval
        self.pending = 0  # closes since the last trim
        self.trims = 0  # trims done (tests and the debug state read it)
        self._last = float("-inf")
        self._handle: asyncio.TimerHandle | None = None
        self._trim = _malloc_trim()

    def closed(self, n: int = 1) -> None:
        """``n`` connections (or what else held memory per client) are gone."""
        self.pending += n
        if self.pending >= self.threshold and self._handle is None and self._trim is not None:
            wait = max(self.delay, self._last + self.min_interval - time.monotonic())
            self._handle = self.loop.call_later(wait, self._run)

    def _run(self) -> None:
        self._handle = None
        self.pending = 0
        self._last = time.monotonic()
        t0 = time.perf_counter()
        freed = gc.collect()
        t1 = time.perf_counter()
        self._trim(0)
        self.trims += 1
        log.debug("after a wave of closes: gc.collect %.1f ms (%d objects), malloc_trim %.1f ms",
                  (t1 - t0) * 1000, freed, (time.perf_counter() - t1) * 1000)

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
