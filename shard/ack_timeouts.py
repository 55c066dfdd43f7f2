"""Consumer timeouts checked by a periodic scan: the ``x-consumer-timeout`` consumer argument and
the node-wide default (``--consumer-timeout``, RabbitMQ's ``consumer_timeout``).

Why a scan and not a delivery time per message: the node default applies to
every queue, and stamping each delivery would put every queue on the
FeatureQueue path (a dict write per delivery and a dict delete per ack).
Instead, every tick the shard walks the unacked maps it already has (of the queues its channels
touched: ``ShardWorker.owned_queues``) and
remembers, per message, the first tick that saw it unacked. A message is
late once that stamp is older than its timeout. The plain deliver and ack
loops do not change at all; the cost is O(unacked) per tick, and the tick
is ``timeout / 8`` clamped to [50 ms, 15 s] for the smallest timeout in use,
so a channel is closed between ``timeout`` and ``timeout`` + two ticks
after the delivery, never before. RabbitMQ checks on a periodic tick too
(once a minute).

A message that is requeued and redelivered between two ticks would keep its
old stamp, so the store reports requeued ids (``QueueStore.requeue_watch``,
set only on queues this scan tracks) and their stamps are dropped.

Precedence follows RabbitMQ: consumer argument, then the queue's
``x-consumer-timeout`` / ``consumer-timeout`` policy (timed exactly by
FeatureQueue, so skipped here), then the node default.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from broker import contract
from shard.stream_queue import StreamQueue
from shard.timers import now_ms

if TYPE_CHECKING:
    import asyncio

    from shard.consumers import Consumer
    from shard.queue import Queue

MIN_TICK_MS = 50
MAX_TICK_MS = 15_000


def timeout_text(channel: int, timeout: int) -> str:
    """RabbitMQ's channel.close text for a delivery acknowledgement timeout.

    channel is the channel's key (broker/contract.py): its low 16 bits are the client's number.
    """
    return (f"PRECONDITION_FAILED - delivery acknowledgement on channel {channel & 0xFFFF} timed out. "
            f"Timeout value used: {timeout} ms. This timeout value can be configured, see "
            "consumers doc guide to learn more")


class TimeoutsShard(Protocol):
    """What the timeouts use of the shard that holds them (shard/worker.py ShardWorker)."""

    loop: asyncio.AbstractEventLoop
    stopping: bool
    queues: dict[tuple[str, str], Queue]
    consumers: dict[tuple[bytes, int, int, str], tuple[Queue, Consumer]]
    data: Any  # its data socket: put(identity, item)

    def fence_check(self) -> None: ...

    def owned_queues(self) -> list[Queue]:
        """The queues where a channel may hold unacked messages, in the order of ``queues``."""


class AckTimeouts:
    def __init__(self, shard: TimeoutsShard, default_ms: int) -> None:
        self.shard = shard
        self.default = default_ms if default_ms and default_ms > 0 else None
        self.ages: dict[int, dict[int, int]] = {}  # qid -> msg_id -> first tick that saw it unacked
        self._timer = None
        self._next_at = 0.0

    def _tick_ms(self) -> int | None:
        smallest = self.default
        for _q, c in self.shard.consumers.values():
            t = c.timeout
            if t and (smallest is None or t < smallest):
                smallest = t
        if smallest is None:
            return None
        return max(MIN_TICK_MS, min(smallest // 8, MAX_TICK_MS))

    def schedule(self) -> None:
        """(Re)arm the next scan; call when a consumer with its own timeout arrives."""
        tick = self._tick_ms()
        if tick is None:
            return
        loop = self.shard.loop
        at = loop.time() + tick / 1000
        if self._timer is not None:
            if self._next_at <= at:
                return
            self._timer.cancel()
        self._next_at = at
        self._timer = loop.call_at(at, self._scan)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _scan(self) -> None:
        self._timer = None
        shard = self.shard
        if shard.stopping:
            return
        shard.fence_check()  # a requeue may dead-letter (delivery limit): as of now (broker/defs_fence.py)
        now = now_ms()
        default = self.default
        old_ages = self.ages
        ages: dict[int, dict[int, int]] = {}
        closed: set[tuple[bytes, int, int]] = set()
        for q in shard.owned_queues():  # not every queue: 100,000 idle ones cost nothing here
            unacked = q.unacked
            if not unacked or q.deleted or q.__class__ is StreamQueue:
                continue  # stream deliveries are never requeued; RabbitMQ has no consumer timeout there
            # The queue's own consumer timeout is timed by FeatureQueue; only consumer arguments here.
            queue_default = None if getattr(q, "consumer_timeout", None) is not None else default
            old = old_ages.get(q.qid)
            store = q.store
            watch = store.requeue_watch
            if watch is None:
                store.requeue_watch = set()
            elif watch:
                if old:
                    for mid in watch:
                        old.pop(mid, None)
                watch.clear()
            seen: dict[int, int] = {}
            for mid, owner in unacked.items():
                t = owner.timeout
                if t is None:
                    t = queue_default
                if not t:
                    continue
                first = old.get(mid) if old else None
                if first is None:
                    first = now
                elif first + t <= now:
                    key = (owner.fe, owner.conn_id, owner.channel)
                    if key not in closed:
                        closed.add(key)
                        shard.data.put(owner.fe, [contract.CLOSE_CHANNEL, owner.conn_id, owner.channel, 406,
                                                  timeout_text(owner.channel, t)])
                    first = now  # the channel is closing; its CHANNEL_CLOSED requeues this message
                seen[mid] = first
            if seen:
                ages[q.qid] = seen
            else:
                store.requeue_watch = None
        self.ages = ages
        self.schedule()
