"""Strict per-channel ordering around requests that need another process.

A channel handles its events one after the other. When a handler sends a
request to the node or a shard, the channel blocks: later events wait in a
deque until the reply unblocks it, so a publish that follows a (even nowait)
queue.bind is routed through that binding. Other channels are unaffected.
Declares, binds and deletes may go out while earlier ones are in flight
(frontend/amqp/pipeline.py, Channel.may_pipeline): the backlog stays busy
until the last of them is answered, and Channel.reply_done drains it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any


class Backlog:
    __slots__ = ("handler", "busy", "events")

    def __init__(self, handler: Callable[[Any], None]) -> None:
        self.handler = handler
        self.busy = False
        self.events: deque = deque()

    def __len__(self) -> int:
        return len(self.events)

    def submit(self, event: Any) -> None:
        if self.busy or self.events:
            self.events.append(event)
        else:
            self.handler(event)

    def block(self) -> None:
        self.busy = True

    def unblock(self) -> None:
        """The pending request finished: handle waiting events until one blocks again."""
        self.busy = False
        events = self.events
        handler = self.handler
        while events and not self.busy:
            handler(events.popleft())

    def clear(self) -> None:
        self.events.clear()
        self.busy = False
