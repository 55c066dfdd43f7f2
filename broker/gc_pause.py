"""Bulk loading without the cyclic garbage collector.

Loading 100,000 queue definitions (and opening their stores) allocates a few objects per queue
and nothing cyclic; with the collector on, every 700 allocations start a collection that walks
the young objects and, more and more often, the whole growing heap: a boot spent mostly in the
GC. ``paused()`` turns it off for the load; ``settle()`` then moves what was loaded (long-lived
by nature) into the permanent generation, so later collections do not walk it again either.
"""

from __future__ import annotations

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
