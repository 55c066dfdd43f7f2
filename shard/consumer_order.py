"""Which consumers of a queue may receive: consumer priorities and single active consumer.

A queue keeps ``consumers`` ordered by ``x-priority`` (highest first, oldest
first among equals), so appending is what happens whenever every consumer has
the same priority: such a queue has ``groups = None`` and its deliver loop is
the plain round-robin over ``consumers``.

Otherwise ``groups`` lists ``[consumers, rr]`` per priority, highest first,
and ``deliver_ranked`` runs the same loop over one group at a time: a lower
group only gets what is left once every consumer of the higher groups is
blocked (credit, prefetch). Nothing unblocks a consumer inside one deliver
call, so one pass from the top down is enough.

Single active consumer (queue argument ``x-single-active-consumer``): every
consumer stays in ``consumers`` (declare-ok counts, auto-delete and x-expires
see them all), the idle ones with ``active = False``, and ``groups`` holds
only the active one, so the loop never walks the idle ones. When the active
consumer goes, ``consumers[0]`` takes over: the highest priority, then the
oldest (RabbitMQ 3.12+).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from shard.consumers import Consumer


class OrderedQueue(Protocol):
    """What the ordering uses of a queue (shard/queue.py Queue, shard/feature_queue.py FeatureQueue)."""

    consumers: list[Consumer] | tuple[()]  # () until the first consumer (no list per idle queue)
    groups: list[list] | None
    sac: bool
    store: Any  # deliver_ranked stops once its ``ready`` is 0

    def deliver_to(self, consumers: list[Consumer], i: int, send: Callable[[bytes, list], None], now: int) -> int:
        """The queue's round-robin over one group from index i; the next index."""


def add(q: OrderedQueue, consumer: Consumer) -> None:
    consumers = q.consumers
    if consumers.__class__ is tuple:
        consumers = q.consumers = []
    i = len(consumers)
    prio = consumer.priority
    while i and consumers[i - 1].priority < prio:
        i -= 1
    consumers.insert(i, consumer)
    if q.sac:
        consumer.active = not any(c.active for c in consumers if c is not consumer)
    if q.groups is not None or q.sac or consumers[0].priority != consumers[-1].priority:
        regroup(q)


def remove(q: OrderedQueue, consumer: Consumer) -> bool:
    """Take a consumer off; on a single-active-consumer queue the next one takes over."""
    consumers = q.consumers
    if not consumers:
        return False
    try:
        consumers.remove(consumer)
    except ValueError:
        return False
    if q.sac and consumer.active and consumers:
        consumers[0].active = True
    if q.groups is not None:
        regroup(q)
    return True


def regroup(q: OrderedQueue) -> None:
    consumers = q.consumers
    if q.sac:
        active = [c for c in consumers if c.active]
        q.groups = [[active[:1], 0]] if active else None
        return
    if not consumers or consumers[0].priority == consumers[-1].priority:
        q.groups = None
        return
    old = {g[0][0].priority: g[1] for g in q.groups or () if g[0]}
    groups: list[list] = []
    for c in consumers:
        if groups and groups[-1][0][0].priority == c.priority:
            groups[-1][0].append(c)
        else:
            groups.append([[c], old.get(c.priority, 0)])
    q.groups = groups


def deliver_ranked(q: OrderedQueue, send: Callable[[bytes, list], None], now: int) -> None:
    store = q.store
    deliver_to = q.deliver_to
    for group in q.groups:
        group[1] = deliver_to(group[0], group[1], send, now)
        if not store.ready:
            break
