"""The stores that may have something to make durable: what the shard's periodic sync visits.

Acks and appends that no confirm waits for reach the disk within a second (shard/worker.py
``_periodic_sync``). Finding the stores with something to sync by asking every queue's store cost
~14 ms of shard CPU per second at 100,000 idle queues; instead a store notes itself here when it
goes from clean to dirty (``QueueStore.dirty`` and its kin: an append, the first ack or ack write
since the last sync, a created or removed file), and the periodic sync visits only these.

The rule that keeps it complete: a dirty store is always here. A store notes itself on each
clean -> dirty change (made on the loop thread); the periodic sync takes the set, and puts back each
store it finds still dirty (its sync is yet to run, or left something for later), so one leaves only
once seen clean. A group sync that fails puts its dirty flags back from the sync thread: the shard
notes that round's stores again (``ShardWorker._sync_done``). Tests check the rule against a walk of
every store (shard/walk_check.py).

One shard per process (as shard/queue.py ``held_total``): a module-level set, off (None) until the
shard turns it on, so stores opened elsewhere (tools, unit tests) note nothing.
"""

from __future__ import annotations

from typing import Any

_noted: set | None = None


def enable() -> None:
    """The shard process turns the registry on before it opens any store."""
    global _noted
    if _noted is None:
        _noted = set()


def disable() -> None:
    """Off again (the shard stopped; in-process tests run more than one shard in turn)."""
    global _noted
    _noted = None


def note(store: Any) -> None:
    """``store`` may have become dirty (called where a dirty flag goes from False to True)."""
    noted = _noted
    if noted is not None:
        noted.add(store)


def take() -> list:
    """The stores noted since the last take (the caller notes again those still dirty)."""
    global _noted
    noted = _noted
    if noted is None:
        return []
    _noted = set()
    return list(noted)  # notes come from the loop thread (the sync thread's flag restores: see above)


def enabled() -> bool:
    return _noted is not None
