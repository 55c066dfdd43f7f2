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
from broker.turn_batch import OnBatch, TurnBatcher

# Together these bound the work one loop turn does for a socket to about 1,000 items, so
# deliveries, confirms and credit interleave with a publish flood instead of waiting behind it.
_BATCHES_PER_TURN = 2


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


class BatchSocket(TurnBatcher):
    """A ROUTER (dest = peer identity) or DEALER (dest = None) with per-turn batching."""

    __slots__ = ("sock", "is_router", "_resume_scheduled")

    flush_always = True  # the flush re-checks the socket's FD after any send (see flush)

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: zmq.Socket,
        on_batch: OnBatch,
        header_for: Callable[[bytes | None], Any] | None = None,
    ) -> None:
        super().__init__(loop, on_batch, header_for)
        self.sock = sock
        self.is_router = sock.type == zmq.ROUTER
        self._resume_scheduled = False
        loop.add_reader(sock.getsockopt(zmq.FD), self._on_readable)
        # Messages may already be waiting (the FD only signals edges).
        loop.call_soon(self._on_readable)

    def send_now(self, dest: bytes | None, items: list, header: Any = 0) -> None:
        """Send one batch immediately (control messages outside the per-turn batch)."""
        self._send_items(dest, header, items)
        if not self._scheduled:  # re-check for input after the send (see flush)
            self._scheduled = True
            self.loop.call_soon(self.flush)

    def flush(self) -> None:
        self._scheduled = False
        if self._closed:
            return
        self._send_pending()
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
