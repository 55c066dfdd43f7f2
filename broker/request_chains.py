"""A channel's pipelined declare/bind/delete requests, planned by the node in the order sent.

A frontend sends a channel's next declare, bind or delete before the node has answered the previous
one (frontend/amqp/pipeline.py), so a client that pipelines many of them does not pay a round trip
per item. The node spawns one task per request, and a task may wait (a queue.delete asks the shard
for its counts before planning). A chain keeps one channel's requests in order: each waits until
the one before it has been applied (or has failed) before it plans, and a request behind a failed
one is skipped: that error closes the channel, and RabbitMQ never runs what a channel received
after the method that closed it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable

# Channels whose request failed, kept so that requests still in flight behind the failure are skipped
# (a channel's key is never used again once an error closed it: a reopened channel has a new key).
# They only matter for milliseconds; the oldest are forgotten past this many.
MAX_FAILED = 4096


class RequestChains:
    """The last request of every channel with requests in flight (key -> a future of its outcome),
    and the channels a failure closed. Keys start with the sending worker's identity."""

    __slots__ = ("_loop", "_tails", "_failed")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._tails: dict[tuple, asyncio.Future] = {}
        self._failed: dict[tuple, None] = {}  # insertion-ordered: the oldest are dropped first

    def __len__(self) -> int:
        return len(self._tails)

    def failed(self, key: tuple) -> bool:
        """A request of this channel failed: skip this one."""
        return key in self._failed

    def busy(self, key: tuple) -> bool:
        """A request of this channel is in flight (not applied yet)."""
        return key in self._tails

    def fail(self, key: tuple | None) -> None:
        """A request handled without a link (Node._request_at_once) failed: skip the channel's next ones."""
        if key is not None:
            self._failed[key] = None
            if len(self._failed) > MAX_FAILED:
                del self._failed[next(iter(self._failed))]

    def link(self, key: tuple) -> tuple[asyncio.Future | None, asyncio.Future]:
        """Append a request to its channel's chain: (the previous request's outcome or None, ours)."""
        prev = self._tails.get(key)
        mine = self._loop.create_future()
        self._tails[key] = mine
        return prev, mine

    def settle(self, key: tuple, mine: asyncio.Future, ok: bool) -> None:
        """Our request was applied (ok) or failed/skipped: the next one of the channel may go on."""
        if not mine.done():
            mine.set_result(ok)
            if not ok:
                self._failed[key] = None
                if len(self._failed) > MAX_FAILED:
                    del self._failed[next(iter(self._failed))]
        if self._tails.get(key) is mine:
            del self._tails[key]

    def forget(self, ident: Hashable) -> None:
        """A worker exited: a restarted one numbers its connections again from the start."""
        for key in [k for k in self._failed if k[0] == ident]:
            del self._failed[key]
