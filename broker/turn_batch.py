"""Per-turn batching of contract items, shared by both data-plane transports.

Callers ``put`` items for a destination during a loop turn; the first put schedules ``flush``
with ``loop.call_soon``, so every destination gets one batch per turn however many items were
produced (a full batch of MAX_BATCH_ITEMS goes out at once). The transports (broker/zmqio.py,
broker/unixio.py) supply ``_send`` and what reading needs; this class holds only what both do.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from broker import contract

# on_batch(dest, header, items): it may return the batch's weight in items, when one item stands for
# many (a DEFS slice of 256 ops): broker/unixio.py reads about TURN_ITEMS of weight per loop turn.
OnBatch = Callable[[bytes | None, Any, list], int | None]

MAX_BATCH_ITEMS = 512


class TurnBatcher:
    """Items put during a loop turn, one packed batch per destination at its end; trace hooks."""

    __slots__ = ("loop", "on_batch", "header_for", "_pending", "_extra", "_scheduled", "_flush_handle", "_closed",
                 "_trace", "_trace_in", "_trace_out", "_trace_keep", "on_sent", "on_drained")

    is_router = False
    # False: the turn's flush only sends what is pending, so ``send_pending`` that leaves nothing
    # pending cancels it (at a steady rate every batch leaves from send_pending, and the flush's
    # callback was a fixed cost of every message: docs/benchmarks.md "A lone message's instructions").
    # True where the flush does more (broker/zmqio.py: it re-checks the socket after any send).
    flush_always = False

    def __init__(self, loop: asyncio.AbstractEventLoop, on_batch: OnBatch,
                 header_for: Callable[[bytes | None], Any] | None) -> None:
        self.loop = loop
        self.on_batch = on_batch
        self.header_for = header_for or (lambda dest: 0)
        self._pending: dict[bytes | None, list] = {}
        # Per destination, the weight beyond one each of the pending batch's items that stand for
        # several (put_weighted); empty unless some do, so put() pays one truth test for it.
        self._extra: dict[bytes | None, int] = {}
        self._scheduled = False
        self._flush_handle: asyncio.Handle | None = None  # the scheduled flush, while _scheduled
        self._closed = False
        self._trace: Any = None  # broker.stage_trace.StageTrace under --trace-stages
        self._trace_in = self._trace_out = ""
        self._trace_keep = False
        # Called with the size of every batch sent (after header_for): the frontend counts bytes in flight.
        self.on_sent: Callable[[int], None] | None = None
        # Called after the batches of one read from a peer were handled (broker/unixio.py; ZeroMQ
        # does not call it): a worker sends what they produced then, not after the rest of the turn.
        self.on_drained: Callable[[], None] | None = None

    def set_trace(self, trace: Any, stage_in: str, stage_out: str, keep_in: bool = False) -> None:
        """Record the sampled messages of every batch received (``stage_in``) and sent (``stage_out``)."""
        self._trace, self._trace_in, self._trace_out, self._trace_keep = trace, stage_in, stage_out, keep_in

    def put(self, dest: bytes | None, item: list) -> None:
        items = self._pending.get(dest)
        if items is None:
            self._pending[dest] = [item]
        else:
            items.append(item)
            if len(items) >= MAX_BATCH_ITEMS or (self._extra and len(items) + self._extra.get(dest, 0)
                                                 >= MAX_BATCH_ITEMS):
                self._send_batch(dest)
        if not self._scheduled:
            self._scheduled = True
            self._flush_handle = self.loop.call_soon(self.flush)

    def put_many(self, dest: bytes | None, new: list) -> None:
        """``put`` of each of ``new``'s items in order, in one call (a shard's delivery run): batches
        are cut where single puts would cut them."""
        if not new:
            return
        pending = self._pending
        items = pending.get(dest)
        if items is None:
            items = pending[dest] = []
        start, total = 0, len(new)
        while True:
            room = MAX_BATCH_ITEMS - len(items) - (self._extra.get(dest, 0) if self._extra else 0)
            if total - start < room:
                items.extend(new[start:] if start else new)
                break
            items.extend(new[start : start + room])
            start += room
            self._send_batch(dest)
            if start == total:
                break
            items = pending[dest] = []
        if not self._scheduled:
            self._scheduled = True
            self._flush_handle = self.loop.call_soon(self.flush)

    def put_weighted(self, dest: bytes | None, item: list, weight: int) -> None:
        """An item that stands for ``weight`` items (a PUBLISH_RUN of that many messages): a batch
        goes out once it holds MAX_BATCH_ITEMS of weight, as one of single items does, so whatever
        bounds batches in flight bounds messages the same way. A heavier item goes alone."""
        extra = self._extra
        items = self._pending.get(dest)
        if items is not None and len(items) + extra.get(dest, 0) + weight > MAX_BATCH_ITEMS:
            self._send_batch(dest)
            items = None
        if items is None:
            self._pending[dest] = [item]
            held = weight
        else:
            items.append(item)
            held = len(items) + extra.get(dest, 0) + weight - 1
        if held >= MAX_BATCH_ITEMS:
            self._send_batch(dest)
        else:
            extra[dest] = extra.get(dest, 0) + weight - 1
        if not self._scheduled:
            self._scheduled = True
            self._flush_handle = self.loop.call_soon(self.flush)

    def _send_batch(self, dest: bytes | None) -> None:
        """Send the pending batch of one destination now."""
        items = self._pending.pop(dest)
        self._extra.pop(dest, None)
        if self._trace is not None:
            self._trace.batch(self._trace_out, items)
        self._send_items(dest, self.header_for(dest), items)

    def send_now(self, dest: bytes | None, items: list, header: Any = 0) -> None:
        """Send one batch immediately (control messages outside the per-turn batch)."""
        self._send_items(dest, header, items)

    def send_packed(self, dest: bytes | None, payload: bytes) -> None:
        """Send one batch already packed (contract.pack) immediately: the same bytes to many peers."""
        self._send(dest, payload)

    def send_pending(self) -> None:
        """Send what was put this turn now, before the turn ends (the end-of-turn flush still runs,
        unless it would find nothing to do: ``flush_always``)."""
        if not self._closed:
            self._send_pending()
            if self._scheduled and not self._pending and not self.flush_always:
                self._scheduled = False
                self._flush_handle.cancel()  # type: ignore[union-attr]

    def flush(self) -> None:
        self._scheduled = False
        if self._closed:
            return
        self._send_pending()

    def _send_pending(self) -> None:
        pending = self._pending
        if not pending:
            return
        if self._extra:
            self._extra.clear()
        trace = self._trace
        if len(pending) == 1:  # one destination (a frontend's lane, a lone message's reply): no new dict
            dest, items = pending.popitem()  # what the send puts to this batcher again is pending anew
            if trace is not None:
                trace.batch(self._trace_out, items)
            self._send_items(dest, self.header_for(dest), items)
            return
        self._pending = {}
        for dest, items in pending.items():
            if trace is not None:
                trace.batch(self._trace_out, items)
            self._send_items(dest, self.header_for(dest), items)

    def _send_items(self, dest: bytes | None, header: Any, items: list) -> None:
        """Send one batch: packed, to ``_send``. The in-process link (broker/local_link.py) hands the
        items over instead; ``items`` is the sender's no more either way (never put to again)."""
        self._send(dest, contract.pack(header, items))

    def _send(self, dest: bytes | None, payload: bytes) -> None:
        raise NotImplementedError
