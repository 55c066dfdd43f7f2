"""Test-mode checks of the indexes that spare the shard walks of every queue.

A channel close (and the consumer-timeout scan) visits only the queues channels touched
(shard/consumers.py ``ChannelRef.queues``), and the periodic sync only the stores that became dirty
(shard/dirty_stores.py). Both are right only if the index misses nothing a walk of every queue would
have found. With ``SHARDMQ_TEST_WALK_CHECK=1`` (tests/harness.py sets it on every test node) the
shard also does that walk at each such point and logs ``WALK_CHECK_FAILED`` when the index missed
something; tests/conftest.py fails the test on that line.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from shard.queue import Queue

WALK_CHECK_ENV = "SHARDMQ_TEST_WALK_CHECK"
WALK_CHECK_FAILED = "walk check failed"  # the log line's start (tests/conftest.py looks for it)
MAX_QUEUES = 20_000  # beyond, no check (as shard/stats.py's): a test of 100,000 queues must not walk them all

log = logging.getLogger("shardmq.shard")


class CheckedShard(Protocol):
    """What the checks read of the shard (shard/worker.py ShardWorker)."""

    index: int
    queues: dict[tuple[str, str], Queue]


def owners_found(shard: CheckedShard, visited: Iterable[Queue], match: Callable) -> None:
    """A close visits ``visited``: no other queue may hold a consumer or an unacked message ``match`` picks."""
    if len(shard.queues) > MAX_QUEUES:
        return
    seen = {id(q) for q in visited}
    for (vhost, name), q in shard.queues.items():
        if id(q) in seen or q.deleted:
            continue
        consumers = [c.tag for c in q.consumers if match(c)]
        owned = sum(1 for owner in q.unacked.values() if match(owner))
        if consumers or owned:
            log.error(WALK_CHECK_FAILED + ": shard %d: a close left queue %r in vhost %r out: consumers %s, "
                      "%d unacked", shard.index, name, vhost, consumers, owned)


def unacked_found(shard: CheckedShard, visited: Iterable[Queue]) -> None:
    """The consumer-timeout scan visits ``visited``: no other queue may hold an unacked message."""
    if len(shard.queues) > MAX_QUEUES:
        return
    seen = {id(q) for q in visited}
    for (vhost, name), q in shard.queues.items():
        if id(q) not in seen and q.unacked and not q.deleted:
            log.error(WALK_CHECK_FAILED + ": shard %d: queue %r in vhost %r holds %d unacked outside every "
                      "channel's queues", shard.index, name, vhost, len(q.unacked))


def dirty_found(shard: CheckedShard, visited: set, extra: Iterable = ()) -> None:
    """The periodic sync visited the stores in ``visited``: no other store of a queue (or in ``extra``)
    may be dirty (it would have waited for a sync that never came)."""
    if len(shard.queues) > MAX_QUEUES:
        return
    stores = [q.store for q in shard.queues.values() if not q.deleted]
    stores.extend(extra)
    for store in stores:
        for part in getattr(store, "parts", (store,)):
            if part.dirty and part not in visited and store not in visited:
                log.error(WALK_CHECK_FAILED + ": shard %d: store %s is dirty and was not visited by the "
                          "periodic sync", shard.index, part.path)
