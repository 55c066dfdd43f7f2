"""Queues whose delivery pass raised, retried with back-off while the shard's other queues deliver on.

A queue's store can fail under a delivery pass: a sealed segment the read cursor cannot map (its
file gone or unreadable), an I/O error. That is the queue's trouble, not the shard's: the pass
(shard/worker.py ``_deliver``) goes on with the other queues it woke, and the failing queue is woken
again after a back-off (``_FIRST_RETRY_S`` doubling up to ``_MAX_RETRY_S``), so it resumes on its own
once the fault is gone, where it used to wait for something else to wake it (and the rest of the
pass, other queues' deliveries among it, was dropped). Logged once per episode with the queue's
name (the first failure with its traceback), and once when it delivers again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("shardmq.shard")

_FIRST_RETRY_S = 0.05
_MAX_RETRY_S = 5.0


class DeliveryFaults:
    """The failing queues of one shard: queue -> [next back-off, pending retry timer or None]."""

    __slots__ = ("_loop", "_index", "_wake", "failing")

    def __init__(self, loop: asyncio.AbstractEventLoop, index: int, wake: Callable[[Any], None]) -> None:
        self._loop = loop
        self._index = index
        self._wake = wake  # puts the queue back in the shard's next delivery pass
        # Read by the delivery pass directly (a dict's truth costs nothing per queue).
        self.failing: dict[Any, list] = {}

    def failed(self, q: Any, exc: BaseException) -> None:
        """The delivery pass of `q` raised `exc`: log it (once), wake `q` again after the back-off."""
        entry = self.failing.get(q)
        if entry is None:
            log.error("shard %d: queue '%s' in vhost '%s': delivery failed (%s: %s); retried with back-off "
                      "while the other queues deliver", self._index, q.name, q.vhost, type(exc).__name__, exc,
                      exc_info=exc)
            entry = self.failing[q] = [_FIRST_RETRY_S, None]
        self._schedule(q, entry)

    def _schedule(self, q: Any, entry: list) -> None:
        if entry[1] is None:  # (a publish that wakes it meanwhile is a retry too: one timer at a time)
            delay = entry[0]
            entry[0] = min(delay * 2, _MAX_RETRY_S)
            entry[1] = self._loop.call_later(delay, self._retry, q)

    def recovered(self, q: Any) -> None:
        """`q`'s pass delivered again (or had nothing left to deliver): no longer failing."""
        entry = self.failing.pop(q, None)
        if entry is not None:
            if entry[1] is not None:
                entry[1].cancel()
            log.warning("shard %d: queue '%s' in vhost '%s': delivers again", self._index, q.name, q.vhost)

    def forget(self, q: Any) -> None:
        """`q` is deleted (or replaced by `replace`): no retry."""
        entry = self.failing.pop(q, None)
        if entry is not None and entry[1] is not None:
            entry[1].cancel()

    def replace(self, old: Any, new: Any) -> None:
        """`old` is replaced by `new` (the same store, another class): the retries follow it."""
        entry = self.failing.pop(old, None)
        if entry is not None:
            if entry[1] is not None:
                entry[1].cancel()
                entry[1] = None
            self.failing[new] = entry
            self._schedule(new, entry)

    def close(self) -> None:
        """The shard stopped (its stores are closed): no more retries."""
        for entry in self.failing.values():
            if entry[1] is not None:
                entry[1].cancel()
        self.failing.clear()

    def _retry(self, q: Any) -> None:
        entry = self.failing.get(q)
        if entry is None:
            return
        entry[1] = None
        if q.deleted:
            del self.failing[q]
            return
        self._wake(q)
