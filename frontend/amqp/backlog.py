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
        # A deque once something waits: most channels never wait, and an empty deque is 624 bytes.
        self.events: deque | tuple = ()

    def __len__(self) -> int:
        return len(self.events)

    def append(self, event: Any) -> None:
        if self.events.__class__ is deque:  # once made, always the same deque (a drain loop holds it)
            self.events.append(event)
        else:
            self.events = deque((event,))

    def submit(self, event: Any) -> None:
        if self.busy or self.events:
            self.append(event)
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
        if self.events:
            self.events.clear()  # the same deque: an unblock() loop draining it stops
        self.busy = False
