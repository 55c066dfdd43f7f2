"""ZeroMQ sockets on an asyncio loop, with one flush per event-loop turn.

A ``BatchSocket`` wraps one ROUTER or DEALER socket. Callers ``put`` items for
a destination during a loop turn; the first put schedules a flush with
``loop.call_soon`` so every destination gets exactly one ZeroMQ message per
turn however many items were produced. Incoming batches are drained without
blocking whenever the socket's FD becomes readable.

ZeroMQ's FD is edge-triggered and only signals a change of ZMQ_EVENTS, so
after every send and receive we re-check ZMQ_EVENTS and drain again: skipping
that step is the classic way to hang a pyzmq-on-asyncio integration.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import zmq

from broker import contract

OnBatch = Callable[[bytes | None, Any, list], None]

# Together these bound the work one loop turn does for a socket to about 1,000 items, so
# deliveries, confirms and credit interleave with a publish flood instead of waiting behind it.
_BATCHES_PER_TURN = 2
MAX_BATCH_ITEMS = 512


def make_socket(ctx: zmq.Context, kind: int, identity: bytes | None = None) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    # Unlimited queues: back-pressure is done at the protocol level (PROCESSED / CREDIT),
    # and a HWM drop on a ROUTER would silently lose messages.
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if kind == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    return sock


class BatchSocket:
    """A ROUTER (dest = peer identity) or DEALER (dest = None) with per-turn batching."""

    __slots__ = ("loop", "sock", "on_batch", "is_router", "header_for", "_pending", "_scheduled", "_closed",
                 "_resume_scheduled", "_trace", "_trace_in", "_trace_out", "_trace_keep", "on_sent")

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: zmq.Socket,
        on_batch: OnBatch,
        header_for: Callable[[bytes | None], Any] | None = None,
    ) -> None:
        self.loop = loop
        self.sock = sock
        self.on_batch = on_batch
        self.is_router = sock.socket_type == zmq.ROUTER
        self.header_for = header_for or (lambda dest: 0)
        self._pending: dict[bytes | None, list] = {}
        self._scheduled = False
        self._closed = False
        self._resume_scheduled = False
        self._trace: Any = None  # broker.stage_trace.StageTrace under --trace-stages
        self._trace_in = self._trace_out = ""
        self._trace_keep = False
        # Called with the size of every batch sent (after header_for): the frontend counts bytes in flight.
        self.on_sent: Callable[[int], None] | None = None
        loop.add_reader(sock.getsockopt(zmq.FD), self._on_readable)
        # Messages may already be waiting (the FD only signals edges).
        loop.call_soon(self._on_readable)

    def set_trace(self, trace: Any, stage_in: str, stage_out: str, keep_in: bool = False) -> None:
        """Record the sampled messages of every batch received (``stage_in``) and sent (``stage_out``)."""
        self._trace, self._trace_in, self._trace_out, self._trace_keep = trace, stage_in, stage_out, keep_in

    def put(self, dest: bytes | None, item: list) -> None:
        items = self._pending.get(dest)
        if items is None:
            self._pending[dest] = [item]
        else:
            items.append(item)
            if len(items) >= MAX_BATCH_ITEMS:
                del self._pending[dest]
                if self._trace is not None:
                    self._trace.batch(self._trace_out, items)
                self._send(dest, contract.pack(self.header_for(dest), items))
        if not self._scheduled:
            self._scheduled = True
            self.loop.call_soon(self.flush)

    def send_now(self, dest: bytes | None, items: list, header: Any = 0) -> None:
        """Send one batch immediately (control messages outside the per-turn batch)."""
        self._send(dest, contract.pack(header, items))
        if not self._scheduled:  # re-check for input after the send (see flush)
            self._scheduled = True
            self.loop.call_soon(self.flush)

    def flush(self) -> None:
        self._scheduled = False
        if self._closed:
            return
        if self._pending:
            pending = self._pending
            self._pending = {}
            trace = self._trace
            for dest, items in pending.items():
                if trace is not None:
                    trace.batch(self._trace_out, items)
                self._send(dest, contract.pack(self.header_for(dest), items))
        # Always, even when put() already sent everything (a full batch goes out at once): any
        # send may have consumed the FD's edge, and a missed edge leaves replies unread forever.
        self._on_readable()

    def _send(self, dest: bytes | None, payload: bytes) -> None:
        if self._closed:
            return
        if self.on_sent is not None:
            self.on_sent(len(payload))
        try:
            if self.is_router:
                self.sock.send_multipart((dest, payload), copy=len(payload) < 65536)
            else:
                self.sock.send(payload, copy=len(payload) < 65536)
        except zmq.ZMQError:
            # Unroutable on a ROUTER (peer gone) or a closing context: the peer is dead and
            # the node's worker-down handling takes care of its state.
            return

    def _on_readable(self) -> None:
        sock = self.sock
        on_batch = self.on_batch
        is_router = self.is_router
        # Handle a bounded number of batches per loop turn: a peer that keeps the socket full
        # (a publish flood) must not starve the callbacks that deliver, flush and return credit.
        budget = _BATCHES_PER_TURN
        while not self._closed:
            budget -= 1
            if budget < 0:
                if not self._resume_scheduled:
                    self._resume_scheduled = True
                    self.loop.call_soon(self._resume)
                return
            try:
                if not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    return
                if is_router:
                    ident, payload = sock.recv_multipart(zmq.NOBLOCK, copy=True)
                else:
                    ident, payload = None, sock.recv(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            except (zmq.ZMQError, ValueError):
                return
            try:
                header, items = contract.unpack(payload)
            except ValueError:
                continue
            if self._trace is not None:
                self._trace.batch(self._trace_in, items, self._trace_keep)
            on_batch(ident, header, items)

    def _resume(self) -> None:
        self._resume_scheduled = False
        self._on_readable()

    def close(self) -> None:
        if self._closed:
            return
        self.flush()
        self._closed = True
        try:
            self.loop.remove_reader(self.sock.getsockopt(zmq.FD))
        except Exception:
            pass
        self.sock.close(0)
