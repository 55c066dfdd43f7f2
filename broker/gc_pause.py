"""Bulk loading without the cyclic garbage collector, and no full collections during bulk changes
(``BulkChanges``).

Loading 100,000 queue definitions (and opening their stores) allocates a few objects per queue
and nothing cyclic; with the collector on, every 700 allocations start a collection that walks
the young objects and, more and more often, the whole growing heap: a boot spent mostly in the
GC. ``paused()`` turns it off for the load; ``settle()`` then moves what was loaded (long-lived
by nature) into the permanent generation, so later collections do not walk it again either.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def paused() -> Iterator[None]:
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def settle() -> None:
    """After a bulk load: exempt what it allocated from later collections.

    No collection first: with the collector paused, everything allocated since sits in the
    youngest generation, so even a young collection walks all of it (a second per 100,000 queues
    in a shard), to find the few cycles a load leaves (none of the model's objects is cyclic).
    Those stay frozen, a small leak once per boot or snapshot."""
    gc.freeze()


# Definition changes (ops) applied within one window that make a bulk: a vhost delete, pipelined
# declares or deletes of many queues. An application declaring its few queues stays far below.
BULK_OPS = 200
BULK_WINDOW_S = 1.0
# Windows in a row below BULK_OPS that end a bulk. Bulks closer than this are one: a benchmark or an
# application that declares 30,000 queues and deletes them a second later had the collection that was
# due after the declares (30-57 ms of a pair's loop in one piece, over the 30,000 queues' objects)
# land at the start of the deletes whenever a window boundary fell in the gap; with two quiet
# windows it runs after the deletes, over the smaller heap (docs/benchmarks.md, "The pair's turns
# during a 30,000-queue delete").
QUIET_WINDOWS = 2
# The generation-2 threshold while a bulk lasts: full collections about never (one per this many
# generation-1 collections, i.e. minutes even under heavy traffic) instead of every second or so.
DEFERRED_FULL_THRESHOLD = 10_000


class BulkChanges:
    """Defers full collections while definitions change in bulk.

    A full (generation 2) collection walks every tracked object of the process in one piece: at
    30,000 queues 6-8 ms in a frontend and 10-20 ms in the node, 8-25 ms in a shard, measured
    during a delete of 30,000 queues (docs/benchmarks.md "Worst gap while 30,000 queues are
    deleted"). A bulk of changes makes them frequent: each pipelined request keeps a few objects
    alive for the ~250 ms it waits, they outlive the young collections, and once those survivors
    pass a quarter of the old generation CPython collects it all again (about every second in
    the node). While ``note``d ops reach ``BULK_OPS`` per ``BULK_WINDOW_S`` the third threshold is
    raised to ``DEFERRED_FULL_THRESHOLD``; ``QUIET_WINDOWS`` windows in a row below it put the
    process's own threshold back, so the collection that was due runs once, after the bulk (after a delete over a smaller
    heap). Young collections go on as usual; nothing is frozen, so no garbage is kept for good:
    cyclic garbage of the bulk's time waits for that one collection.
    """

    __slots__ = ("_loop", "_ops", "_quiet", "_saved", "_timer")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._ops = 0
        self._quiet = 0  # windows in a row below BULK_OPS while deferring
        self._saved: tuple[int, ...] | None = None  # the thresholds to restore, while deferring
        self._timer: asyncio.TimerHandle | None = None

    @property
    def deferring(self) -> bool:
        return self._saved is not None

    def note(self, n: int) -> None:
        """``n`` definition ops were applied now."""
        self._ops += n
        if self._timer is None:
            self._timer = self._loop.call_later(BULK_WINDOW_S, self._window)
        if self._saved is None and self._ops >= BULK_OPS:
            self._saved = gc.get_threshold()
            t = self._saved
            gc.set_threshold(t[0], t[1], max(t[2], DEFERRED_FULL_THRESHOLD))

    def _window(self) -> None:
        self._timer = None
        ops, self._ops = self._ops, 0
        if self._saved is None:
            return
        self._quiet = 0 if ops >= BULK_OPS else self._quiet + 1
        if self._quiet < QUIET_WINDOWS:
            self._timer = self._loop.call_later(BULK_WINDOW_S, self._window)
            return
        self._quiet = 0
        if gc.get_threshold()[2] == max(self._saved[2], DEFERRED_FULL_THRESHOLD):
            gc.set_threshold(*self._saved)  # else someone else set them meanwhile: theirs stand
        self._saved = None

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._saved is not None:
            gc.set_threshold(*self._saved)
            self._saved = None
        self._quiet = 0
