"""One event-loop timer for the periodic checks of every connection of a frontend.

An idle AMQP connection needs a check every heartbeat/2 seconds (send a heartbeat, count the
client's silence) and, before that, a handshake deadline. With one ``loop.call_later`` each, 10,000
idle connections are 10,000 TimerHandles with a libuv timer each, and every open and close of a
connection creates and cancels one. Here a connection is an entry in a dict keyed by the tick
(``RESOLUTION`` seconds) at which it is due, and one timer fires at the earliest due tick:
arming is a dict insert, disarming a dict delete.

A due connection's ``on_tick()`` is called once; it re-arms itself if it wants another check.
Due times are rounded up to the next tick, so a check is never early and at most RESOLUTION late.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import math
import weakref
from typing import Protocol

RESOLUTION = 0.1  # seconds

log = logging.getLogger("shardmq.frontend")


class Ticked(Protocol):
    wheel_tick: int | None  # the tick this connection is due at (set by TimerWheel), None when unarmed

    def on_tick(self) -> None: ...


class TimerWheel:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._due: dict[int, dict[Ticked, None]] = {}  # tick -> connections (insertion-ordered)
        self._ticks: list[int] = []  # heap of the ticks in _due (stale entries are skipped)
        self._handle: asyncio.TimerHandle | None = None
        self._handle_tick: int | None = None

    def __len__(self) -> int:
        return sum(map(len, self._due.values()))

    def arm(self, conn: Ticked, delay: float) -> None:
        """``conn.on_tick()`` in ``delay`` seconds (replacing a check it had armed)."""
        if conn.wheel_tick is not None:
            self.disarm(conn)
        tick = math.ceil((self.loop.time() + delay) / RESOLUTION)
        bucket = self._due.get(tick)
        if bucket is None:
            bucket = self._due[tick] = {}
            heapq.heappush(self._ticks, tick)
            if self._handle_tick is None or tick < self._handle_tick:
                self._schedule(tick)
        bucket[conn] = None
        conn.wheel_tick = tick

    def disarm(self, conn: Ticked) -> None:
        tick = conn.wheel_tick
        if tick is None:
            return
        conn.wheel_tick = None
        bucket = self._due.get(tick)
        if bucket is not None:
            bucket.pop(conn, None)
            if not bucket:
                del self._due[tick]  # its heap entry is skipped when it comes up

    def _schedule(self, tick: int) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._handle_tick = tick
        self._handle = self.loop.call_at(tick * RESOLUTION, self._fire)

    def _fire(self) -> None:
        self._handle = self._handle_tick = None
        # A loop timer may fire a little before its time (millisecond rounding): within 1 ms counts.
        now = math.floor(self.loop.time() / RESOLUTION + 0.01)
        ticks = self._ticks
        while ticks and ticks[0] <= now:
            bucket = self._due.pop(heapq.heappop(ticks), None)
            if not bucket:
                continue
            for conn in bucket:
                conn.wheel_tick = None
            for conn in bucket:
                try:
                    conn.on_tick()
                except Exception:  # one connection's bug must not stop the others' checks
                    log.exception("timer wheel: on_tick failed")
        while ticks and ticks[0] not in self._due:
            heapq.heappop(ticks)
        if ticks:
            self._schedule(ticks[0])


_WHEELS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def wheel_for(loop: asyncio.AbstractEventLoop) -> TimerWheel:
    """The wheel of this event loop (one per frontend process)."""
    wheel = _WHEELS.get(loop)
    if wheel is None:
        wheel = _WHEELS[loop] = TimerWheel(loop)
    return wheel
