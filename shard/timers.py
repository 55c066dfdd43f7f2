"""One timer heap per shard: TTL expiry, queue expiry and consumer timeouts share it.

Deadlines are wall-clock milliseconds (record timestamps are wall clock, and
they survive a restart). The heap drives a single ``loop.call_at`` for the
earliest deadline, so the number of asyncio handles is one per shard however
many queues wait. Entries are never cancelled: a callback re-checks its own
state when it fires, so a stale entry costs one cheap call.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import time
from collections.abc import Callable

# Fire a little late rather than early: call_at rounds to the loop clock's resolution.
_SLACK_S = 0.001

log = logging.getLogger("shardmq.shard")


def now_ms() -> int:
    return int(time.time() * 1000)


class TimerHeap:
    __slots__ = ("_loop", "_heap", "_seq", "_handle", "_handle_at", "_before")

    def __init__(self, loop: asyncio.AbstractEventLoop, before: Callable[[], None] | None = None) -> None:
        self._loop = loop
        # Called before the due callbacks of each firing (the shard's definitions fence check): here,
        # not inside a callback, so whatever it applies never lands in the middle of a queue's work.
        self._before = before
        self._heap: list[tuple[int, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._handle: asyncio.TimerHandle | None = None
        self._handle_at = 0

    def __len__(self) -> int:
        return len(self._heap)

    def schedule(self, when_ms: int, callback: Callable[[], None]) -> None:
        """Call ``callback()`` once at (or just after) wall-clock ``when_ms``."""
        heapq.heappush(self._heap, (when_ms, next(self._seq), callback))
        if self._handle is None or when_ms < self._handle_at:
            self._arm(when_ms)

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._heap.clear()

    def _arm(self, when_ms: int) -> None:
        if self._handle is not None:
            self._handle.cancel()
        delay = max(0.0, when_ms / 1000.0 - time.time()) + _SLACK_S
        self._handle_at = when_ms
        self._handle = self._loop.call_at(self._loop.time() + delay, self._fire)

    def _fire(self) -> None:
        self._handle = None
        if self._before is not None:
            try:
                self._before()
            except Exception:
                log.exception("timer pre-check failed")
        heap = self._heap
        now = now_ms()
        while heap and heap[0][0] <= now:
            callback = heapq.heappop(heap)[2]
            try:
                callback()
            except Exception:  # one queue's bug must not stop every other timer
                log.exception("timer callback failed")
        if heap and self._handle is None:
            self._arm(heap[0][0])
