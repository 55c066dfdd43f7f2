"""The data plane's ``BatchSocket`` over unix-domain stream sockets on the running event loop.

Why not ZeroMQ here: a ZeroMQ send hands the message to ZeroMQ's I/O thread, which writes it and
wakes the receiver's I/O thread, which wakes the receiving loop through an eventfd. A message from a
client to a consumer crosses four of those handoffs (frontend send, shard receive, shard send,
frontend receive), each tens of microseconds on a busy machine. Here the loop thread writes the
turn's batch straight into the kernel socket and the peer's loop reads it from its own epoll: no
thread, no eventfd, one ``write`` per destination per loop turn and one ``read`` per wake-up.

Same interface and the same semantics the callers rely on from ZeroMQ's ROUTER/DEALER pair
(``broker/zmqio.py``):

- ``UnixRouter`` (the shard's listening side; ``dest`` is a peer's identity): a connecting peer
  announces its identity first (``contract.STREAM_HELLO``); a later connection with the same
  identity takes over (ROUTER_HANDOVER 1: the old one is closed); a batch for an identity that is
  not connected is dropped silently (ROUTER_MANDATORY 0; the contract's epochs, PROCESSED and the
  frontends' probes already deal with that loss).
- ``UnixDealer`` (frontends and shard peers; ``dest`` is None): connects in the background and
  reconnects after the peer went away (a shard restarted after ``kill -9``); batches put while it
  is not connected wait and go out, in order, right after the identity once it is. Like a ZeroMQ
  DEALER's pipe, nothing bounds that queue: back-pressure is the protocol's (PROCESSED / CREDIT,
  bytes in flight counted by the frontend through ``on_sent``). What the old connection had
  written but the dead peer never read is lost, as with ZeroMQ.

Frames are ``contract.STREAM_FRAME`` (u32 length) + payload, the payload the same msgpack batch as
ZeroMQ carried. Reads go into one reused buffer per connection (``asyncio.BufferedProtocol``) and
batches are decoded from it without a copy; one loop turn handles about ``TURN_ITEMS`` items per
connection and then pauses reading until the next turn, so a publish flood cannot starve the
callbacks that deliver, flush and return credit (ZeroMQ's side does the same with a batch budget).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import select
import socket
import time
from collections.abc import Callable
from typing import Any

from broker import contract, gc_pause
from broker.turn_batch import OnBatch, TurnBatcher

log = logging.getLogger("shardmq.unixio")

TURN_ITEMS = 1024  # items handled per connection per loop turn before reading pauses
CONTROL_TURN_S = 0.002  # the control plane's _Base.turn_s in the workers
_FRAME = contract.STREAM_FRAME
_FRAME_SIZE = _FRAME.size
_FRAME_MAX = (1 << (8 * _FRAME_SIZE)) - 1
_HELLO = contract.STREAM_HELLO
_READ_BUFFER = 256 * 1024  # starting size of a connection's read buffer; grows for bigger frames
_MIN_READ = 64 * 1024  # free space offered to a read before unread data is moved to the front
# A buffer grown past this for a big frame (a SNAPSHOT of 100,000 queues: 7 MB, a full STATS) goes
# back to _READ_BUFFER once it has been empty for _SHRINK_AFTER_S: a worker kept its boot snapshot's
# buffer for good. The delay keeps a stream of big batches (large bodies) on one grown buffer.
_KEEP_BUFFER = 1 << 20
_SHRINK_AFTER_S = 1.0
_BULK_BATCH = 1 << 20  # a batch this big is decoded and handled with the cyclic GC paused
_RECONNECT_FIRST_S = 0.01
_RECONNECT_MAX_S = 0.1  # ZeroMQ reconnects every 100 ms


class _Stream(asyncio.BufferedProtocol):
    """One connection: frames in from a reused buffer, frames out with one write per call."""

    __slots__ = ("owner", "transport", "identity", "closed", "_buf", "_view", "_start", "_end",
                 "_need", "_paused", "_resume_scheduled", "_shrink_scheduled")

    def __init__(self, owner: _Base, identity: bytes | None) -> None:
        self.owner = owner
        self.transport: asyncio.Transport | None = None
        self.identity = identity  # a router learns it from the peer's hello
        self.closed = False
        self._buf = bytearray(_READ_BUFFER)
        self._view = memoryview(self._buf)
        self._start = 0  # first unread byte
        self._end = 0  # end of the bytes read
        self._need = 0  # size of the frame being read when it does not fit the buffer
        self._paused = False
        self._resume_scheduled = False
        self._shrink_scheduled = False

    # ------------------------------------------------------------- asyncio
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.owner._made(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.owner._lost(self)

    def eof_received(self) -> bool:
        return False  # close our side too: connection_lost follows

    def get_buffer(self, sizehint: int) -> memoryview:
        if len(self._buf) - self._end < _MIN_READ or self._need > len(self._buf) - self._start:
            self._make_room()
        return self._view[self._end:]

    def buffer_updated(self, nbytes: int) -> None:
        self._end += nbytes
        self._drain()

    # ------------------------------------------------------------- frames in
    def _make_room(self) -> None:
        start, end = self._start, self._end
        unread = end - start
        size = len(self._buf)
        wanted = max(self._need, unread + _MIN_READ)
        if wanted > size:
            # A frame bigger than the buffer: a new one that holds it (and reads after it).
            buf = bytearray(max(wanted, 2 * size))
            buf[:unread] = self._view[start:end]
            self._buf, self._view = buf, memoryview(buf)
            if len(buf) > _KEEP_BUFFER and not self._shrink_scheduled:
                self._shrink_scheduled = True
                self.owner.loop.call_later(_SHRINK_AFTER_S, self._shrink)
        elif unread:
            self._view[:unread] = self._view[start:end]
        self._start, self._end = 0, unread

    def _shrink(self) -> None:
        """Back to a _READ_BUFFER buffer if the grown one is empty now, else look again later."""
        if self.closed or len(self._buf) <= _KEEP_BUFFER:
            self._shrink_scheduled = False
            return
        if self._start != self._end or self._need:
            self.owner.loop.call_later(_SHRINK_AFTER_S, self._shrink)
            return
        self._shrink_scheduled = False
        self._start = self._end = 0
        self._buf = bytearray(_READ_BUFFER)
        self._view = memoryview(self._buf)

    def _drain(self) -> None:
        """Hand complete frames to the owner, then tell it (``on_drained``) when there were any."""
        if self._drain_frames():
            on_drained = self.owner.on_drained
            if on_drained is not None and not self.closed:
                on_drained()

    def _drain_frames(self) -> bool:
        """Hand complete frames to the owner, at most about TURN_ITEMS items this turn; True if any."""
        handled = False
        view = self._view
        owner = self.owner
        budget = TURN_ITEMS
        turn_s = owner.turn_s
        if turn_s is not None:
            until = time.perf_counter() + turn_s
        while not self.closed:
            start = self._start
            have = self._end - start
            if have < _FRAME_SIZE:
                break
            size = _FRAME.unpack_from(view, start)[0]
            if have < _FRAME_SIZE + size:
                self._need = _FRAME_SIZE + size
                break
            self._need = 0
            self._start = start + _FRAME_SIZE + size
            budget -= owner._frame(self, view[start + _FRAME_SIZE:self._start])
            handled = True
            if budget <= 0 or (turn_s is not None and time.perf_counter() > until):
                if self._end - self._start >= _FRAME_SIZE and not self.closed:
                    self._pause()
                    return True
                break
        if self._start == self._end:
            self._start = self._end = 0
        if self._paused and not self.closed:
            self._paused = False
            self.transport.resume_reading()
        return handled

    def _pause(self) -> None:
        if not self._paused:
            self._paused = True
            self.transport.pause_reading()
        if not self._resume_scheduled:
            self._resume_scheduled = True
            self.owner.loop.call_soon(self._resume)

    def _resume(self) -> None:
        self._resume_scheduled = False
        self._drain()

    def read_until(self, done: Callable[[], bool], timeout: float) -> bool:
        """Handle frames now, reading the socket directly, until ``done()``; False: not within timeout.

        The definitions fence's catch-up (broker/defs_fence.py): no turn budget, no time cap. Frames
        already in the buffer come first (a paused or delayed stream's), then what the socket has,
        then, while ``done()`` is still False, it waits for the socket (the node writes the DEFS in
        the loop turn it raised the word in). The loop owns the descriptor but runs nothing else
        meanwhile: it finds the bytes gone (EAGAIN) or the next ones, never half a frame missing.
        """
        deadline = time.monotonic() + timeout
        owner = self.owner
        fd = -1
        while True:
            while not self.closed and not done():
                start = self._start
                have = self._end - start
                if have < _FRAME_SIZE:
                    break
                size = _FRAME.unpack_from(self._view, start)[0]
                if have < _FRAME_SIZE + size:
                    self._need = _FRAME_SIZE + size
                    break
                self._need = 0
                self._start = start + _FRAME_SIZE + size
                owner._frame(self, self._view[start + _FRAME_SIZE:self._start])
            if self.closed:
                return False
            if done():
                break
            if self._start == self._end:
                self._start = self._end = 0
            if len(self._buf) - self._end < _MIN_READ or self._need > len(self._buf) - self._start:
                self._make_room()
            if fd < 0:
                fd = self.transport.get_extra_info("socket").fileno()
            try:
                n = os.readv(fd, [self._view[self._end:]])
            except (BlockingIOError, InterruptedError):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                select.select([fd], [], [], left)
                continue
            except OSError:
                return False  # the transport sees the error too and closes
            if n == 0:
                return False  # end of file: the transport's next read sees it
            self._end += n
        if self._end - self._start >= _FRAME_SIZE or self._paused:
            self._pause()  # what is left (or was paused) is handled from the loop's next turn
        return True

    # ------------------------------------------------------------- frames out
    def send(self, payload: bytes) -> None:
        if not self.closed:
            self.transport.writelines((_FRAME.pack(len(payload)), payload))

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.transport.close()


class _DelayedStream(_Stream):
    """A control-plane stream that handles what it read only ``owner.read_delay_s`` later (tests only:
    SHARDMQ_TEST_CONTROL_DELAY_MS, broker/defs_fence.py). ``read_until`` does not wait for it."""

    __slots__ = ("_delayed",)

    def __init__(self, owner: _Base, identity: bytes | None) -> None:
        super().__init__(owner, identity)
        self._delayed = False

    def buffer_updated(self, nbytes: int) -> None:
        self._end += nbytes
        if not self._delayed:
            self._delayed = True
            self.owner.loop.call_later(self.owner.read_delay_s, self._late)

    def _late(self) -> None:
        self._delayed = False
        self._drain()


class _Base(TurnBatcher):
    """What both ends add to the per-turn batching: frame-size check, write and decode."""

    __slots__ = ()

    # Seconds of batch handling per connection per loop turn, if set (the control plane: one DEFS
    # slice of a vhost delete costs far more than its item count says); reading pauses after it.
    turn_s: float | None = None

    def _send(self, dest: bytes | None, payload: bytes) -> None:
        if self._closed:
            return
        if len(payload) > _FRAME_MAX:
            log.error("batch of %d bytes is over the frame limit: dropped", len(payload))
            return
        if self.on_sent is not None:
            self.on_sent(len(payload))
        self._write(dest, payload)

    def _deliver(self, ident: bytes | None, payload: memoryview) -> int:
        """Decode one batch and hand it on; returns its number of items (the read budget)."""
        if len(payload) >= _BULK_BATCH:
            # A SNAPSHOT of 100,000 queues (or a full STATS): decoding it with the collector on
            # walked the growing heap again and again, half of the decode's time (broker/gc_pause.py).
            with gc_pause.paused():
                return self._deliver_decoded(ident, payload)
        return self._deliver_decoded(ident, payload)

    def _deliver_decoded(self, ident: bytes | None, payload: memoryview) -> int:
        try:
            header, items = contract.unpack(payload)
        except ValueError:
            return 1
        if self._trace is not None:
            self._trace.batch(self._trace_in, items, self._trace_keep)
        weight = self.on_batch(ident, header, items)
        return weight or len(items) or 1

    # provided by each end
    def _write(self, dest: bytes | None, payload: bytes) -> None:
        raise NotImplementedError

    def _made(self, stream: _Stream) -> None:
        raise NotImplementedError

    def _lost(self, stream: _Stream) -> None:
        raise NotImplementedError

    def _frame(self, stream: _Stream, payload: memoryview) -> int:
        raise NotImplementedError


class UnixRouter(_Base):
    """The listening end (a shard's data socket): ``dest`` is a connected peer's identity."""

    is_router = True

    def __init__(self, loop: asyncio.AbstractEventLoop, path: str, on_batch: OnBatch,
                 header_for: Callable[[bytes | None], Any] | None = None) -> None:
        super().__init__(loop, on_batch, header_for)
        self.path = path
        # Called with a peer's identity when its connection closed (the node: a paired process's
        # frontend part stopped while the process goes on, broker/supervisor.py stop_role).
        self.on_lost: Callable[[bytes], None] | None = None
        self._peers: dict[bytes, _Stream] = {}
        self._streams: set[_Stream] = set()
        # Bound and listening before this returns, as ZeroMQ's bind: peers may connect (and queue
        # in the backlog) at once. A socket file left by a killed predecessor is replaced.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(path)
        sock.listen(1024)
        sock.setblocking(False)
        self._sock = sock
        self._server: asyncio.AbstractServer | None = None
        self._serving = loop.create_task(self._serve(sock))

    async def _serve(self, sock: socket.socket) -> None:
        self._server = await self.loop.create_unix_server(lambda: _Stream(self, None), sock=sock)

    def _made(self, stream: _Stream) -> None:
        if self._closed:
            stream.close()
            return
        self._streams.add(stream)

    def _lost(self, stream: _Stream) -> None:
        self._streams.discard(stream)
        if stream.identity is not None and self._peers.get(stream.identity) is stream:
            del self._peers[stream.identity]
            if self.on_lost is not None:
                self.on_lost(stream.identity)

    def _frame(self, stream: _Stream, payload: memoryview) -> int:
        if stream.identity is None:
            # The first frame names the peer (contract.STREAM_HELLO); anything else is not ours.
            if payload[:len(_HELLO)] != _HELLO:
                log.warning("%s: a connection that did not say hello: closed", self.path)
                stream.close()
                return 1
            ident = bytes(payload[len(_HELLO):])
            old = self._peers.get(ident)
            if old is not None and old is not stream:
                old.close()  # ROUTER_HANDOVER: the new connection with this identity takes over
            stream.identity = ident
            self._peers[ident] = stream
            return 1
        return self._deliver(stream.identity, payload)

    def has_peer(self, ident: bytes) -> bool:
        """A connection named ``ident`` is open."""
        return ident in self._peers

    def _write(self, dest: bytes | None, payload: bytes) -> None:
        stream = self._peers.get(dest)  # type: ignore[arg-type]
        if stream is not None:
            stream.send(payload)
        # else: ROUTER_MANDATORY 0, the peer is gone and the node's worker-down handling takes over

    def close(self) -> None:
        if self._closed:
            return
        self.flush()
        self._closed = True
        if self._server is not None:
            self._server.close()
        else:
            self._serving.cancel()
            self._sock.close()
        for stream in list(self._streams):
            stream.close()
        self._streams.clear()
        self._peers.clear()
        with contextlib.suppress(OSError):
            os.unlink(self.path)


class UnixDealer(_Base):
    """The connecting end (a frontend's lane, a shard's peer socket): always one connection, kept up."""

    def __init__(self, loop: asyncio.AbstractEventLoop, path: str, identity: bytes, on_batch: OnBatch,
                 header_for: Callable[[bytes | None], Any] | None = None) -> None:
        super().__init__(loop, on_batch, header_for)
        self.path = path
        self.identity = identity
        self._stream: _Stream | None = None  # connected and said hello
        self._waiting: list[bytes] = []  # frames (length prefix included) put while not connected
        self._delay = _RECONNECT_FIRST_S
        self._task: asyncio.Task | None = None
        self.read_delay_s = 0.0  # tests only (_DelayedStream); set before the first loop turn
        self._connect()

    def _connect(self) -> None:
        if not self._closed:
            self._task = self.loop.create_task(self._connect_loop())

    async def _connect_loop(self) -> None:
        stream = _DelayedStream if self.read_delay_s else _Stream
        while not self._closed:
            try:
                await self.loop.create_unix_connection(lambda: stream(self, self.identity), self.path)
                return
            except OSError:  # not bound yet, or the dead peer's file: try again, as ZeroMQ reconnects
                await asyncio.sleep(self._delay)
                self._delay = min(self._delay * 2, _RECONNECT_MAX_S)

    def _made(self, stream: _Stream) -> None:
        if self._closed:
            stream.close()
            return
        self._delay = _RECONNECT_FIRST_S
        hello = _HELLO + self.identity
        frames = [_FRAME.pack(len(hello)), hello, *self._waiting]
        self._waiting = []
        stream.transport.writelines(frames)
        self._stream = stream

    def _lost(self, stream: _Stream) -> None:
        if self._stream is stream:
            self._stream = None
            self.loop.call_later(self._delay, self._connect)

    def _frame(self, stream: _Stream, payload: memoryview) -> int:
        return self._deliver(None, payload)

    def _write(self, dest: bytes | None, payload: bytes) -> None:
        stream = self._stream
        if stream is not None and not stream.closed:
            stream.send(payload)
        else:
            self._waiting.append(_FRAME.pack(len(payload)))
            self._waiting.append(payload)

    @property
    def connected(self) -> bool:
        return self._stream is not None and not self._stream.closed

    def read_until(self, done: Callable[[], bool], timeout: float) -> bool:
        """Handle what the peer sent, reading it now, until ``done()`` (_Stream.read_until); False
        when not connected or not done within ``timeout`` seconds."""
        stream = self._stream
        if stream is None or stream.closed:
            return done()
        return stream.read_until(done, timeout)

    def close(self) -> None:
        if self._closed:
            return
        self.flush()
        self._closed = True
        if self._task is not None and not self._task.done():
            self._task.cancel()
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        self._waiting = []
