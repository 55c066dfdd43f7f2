"""A channel's declare/bind/delete requests in flight at once, answered in the order sent.

A client that sends many queue.declare (or binds, deletes) on one channel without waiting for each
*-Ok would otherwise pay a full round trip per method (frontend -> node -> every worker -> node ->
frontend): the channel's backlog handles one request at a time. Instead, such a method is sent to the
node while the ones before it are still in flight (the node plans them in the order sent and skips
those behind a failure, broker/request_chains.py), and the replies are written to the client in the
channel's order, whatever order they come back in. Any other method or content waits in the backlog
until the pipeline is empty, so a publish after a (nowait) declare or bind still routes through it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from pamqp import commands as C

# Requests in flight on one channel at most; later ones wait in the backlog (which pauses reading).
MAX_IN_FLIGHT = 1000

# The methods a channel may send while others are in flight (see Channel.may_pipeline for the
# conditions on each).
PIPELINED = frozenset((
    C.Exchange.Declare, C.Exchange.Delete, C.Exchange.Bind, C.Exchange.Unbind,
    C.Queue.Declare, C.Queue.Bind, C.Queue.Unbind, C.Queue.Delete,
))


class Pending:
    """One request in flight: its reply once it came, and what writes it to the client."""

    __slots__ = ("done", "ok", "result", "on_ok", "class_id", "method_id")

    def __init__(self, on_ok: Callable[[dict], None], class_id: int, method_id: int) -> None:
        self.done = False
        self.ok = False
        self.result: Any = None
        self.on_ok = on_ok
        self.class_id = class_id
        self.method_id = method_id


class Pipeline:
    """The channel's requests in flight, oldest first."""

    __slots__ = ("entries",)

    def __init__(self) -> None:
        self.entries: deque[Pending] = deque()

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, on_ok: Callable[[dict], None], class_id: int, method_id: int) -> Pending:
        p = Pending(on_ok, class_id, method_id)
        self.entries.append(p)
        return p

    def pop_ready(self) -> Pending | None:
        """The oldest request if it has its reply (the next one to answer the client), else None."""
        entries = self.entries
        if entries and entries[0].done:
            return entries.popleft()
        return None

    def clear(self) -> None:
        self.entries.clear()
