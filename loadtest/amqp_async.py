"""Many AMQP connections from one process: the asyncio client of the connection scenarios.

``connection-count`` holds 10,000 idle connections and ``connection-churn`` opens and closes
thousands per second: one blocking socket per connection (loadtest/amqp_client.py) would need a
thread or a process each. Here a connection is one small ``asyncio.Protocol`` that does what a
client library does on connect, one step after the other as pika or the Java client do (no
pipelining): protocol header, ``start-ok`` (PLAIN), ``tune-ok`` (accepting the server's heartbeat
unless told otherwise), ``open``, ``channel.open``; and on close, ``connection.close`` and the
socket closed once ``close-ok`` arrived.

The client frames are constant per URI and encoded once (pamqp, through broker/amqp/encoder.py);
incoming frames are split here and only the connection-level methods a handshake can meet are
looked at (their class/method ids, the three integers of ``connection.tune``), so the load
generator spends little CPU per connection and the broker is what is measured. A negotiated
heartbeat is sent by one timer for all connections (``IdleConnections``), not one per connection.
"""

from __future__ import annotations

import asyncio
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pamqp import commands as C

from broker.amqp.encoder import encode_heartbeat, encode_method, encode_protocol_header
from broker.process import raise_nofile_limit
from loadtest.amqp_client import CLIENT_PROPERTIES, AMQPClosed, AMQPUri

_HEAD = struct.Struct(">BHI")  # frame type, channel, payload size
_IDS = struct.Struct(">HH")  # class id, method id
_TUNE = struct.Struct(">HIH")  # channel-max, frame-max, heartbeat
_CLOSE_HEAD = struct.Struct(">H")  # reply-code (then the reply-text shortstr)

START, TUNE, OPEN_OK, CLOSE, CLOSE_OK = (10, 10), (10, 30), (10, 41), (10, 50), (10, 51)
CHANNEL_OPEN_OK, CHANNEL_CLOSE = (20, 11), (20, 40)
HEARTBEAT_FRAME = 8


def raise_nofile() -> int:
    """Lift the soft RLIMIT_NOFILE to the hard limit (10,000 sockets need 10,000 descriptors)."""
    return raise_nofile_limit()


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop when installed (it is a dependency of the broker): less client CPU per connection."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


@dataclass
class ClientFrames:
    """The bytes a client writes, encoded once per URI."""

    uri: AMQPUri
    heartbeat: int | None = None  # None: accept the server's proposal (pika's default)
    header: bytes = encode_protocol_header()
    start_ok: bytes = b""
    open: bytes = b""
    channel_open: bytes = encode_method(1, C.Channel.Open())
    close: bytes = encode_method(0, C.Connection.Close(200, "bye", 0, 0))
    close_ok: bytes = encode_method(0, C.Connection.CloseOk())
    heartbeat_frame: bytes = encode_heartbeat()
    _tune_ok: dict[tuple[int, int, int], bytes] = field(default_factory=dict)

    def __post_init__(self) -> None:
        u = self.uri
        self.start_ok = encode_method(0, C.Connection.StartOk(
            client_properties=CLIENT_PROPERTIES, mechanism="PLAIN", response=f"\0{u.user}\0{u.password}"))
        self.open = encode_method(0, C.Connection.Open(virtual_host=u.vhost))

    def tune_ok(self, channel_max: int, frame_max: int, heartbeat: int) -> bytes:
        hb = heartbeat if self.heartbeat is None else self.heartbeat
        key = (channel_max or 2047, min(frame_max or 131072, 131072), hb)
        got = self._tune_ok.get(key)
        if got is None:
            got = self._tune_ok[key] = encode_method(0, C.Connection.TuneOk(*key))
        return got


class ClientConnection(asyncio.Protocol):
    """One AMQP connection: ``await opened`` after channel 1 is open; ``close()`` then ``await closed``."""

    __slots__ = ("frames", "transport", "buf", "waiter", "heartbeat", "wrote", "error")

    def __init__(self, frames: ClientFrames, loop: asyncio.AbstractEventLoop) -> None:
        self.frames = frames
        self.transport: asyncio.Transport | None = None
        self.buf = b""
        self.waiter: asyncio.Future = loop.create_future()  # the handshake, then close-ok
        self.heartbeat = 0
        self.wrote = False
        self.error: AMQPClosed | None = None

    # -- asyncio.Protocol ---------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        transport.write(self.frames.header)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        buf = self.buf + data if self.buf else data
        pos = 0
        end = len(buf)
        if buf[:4] == b"AMQP" and end >= 8:  # the server's protocol header: it refuses our version
            self._fail(AMQPClosed(505, f"server refused protocol: {bytes(buf[:8])!r}"))
            return
        while end - pos >= 8:
            kind, channel, size = _HEAD.unpack_from(buf, pos)
            stop = pos + 8 + size
            if stop > end:
                break
            if kind == 1 and size >= 4:  # heartbeats (8) and other frames: nothing to do
                self._method(_IDS.unpack_from(buf, pos + 7), buf, pos + 11)
                if self.transport is None:
                    return
            pos = stop
        self.buf = buf[pos:] if pos < end else b""

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if not self.waiter.done():
            if self.error is None:
                self.error = AMQPClosed(320, f"socket closed by peer{f': {exc}' if exc else ''}")
            self.waiter.set_exception(self.error)

    # -- frames -------------------------------------------------------------------------------
    def _method(self, ids: tuple[int, int], buf: bytes, args: int) -> None:
        write = self.transport.write  # type: ignore[union-attr]
        f = self.frames
        if ids == START:
            write(f.start_ok)
        elif ids == TUNE:
            channel_max, frame_max, heartbeat = _TUNE.unpack_from(buf, args)
            tune_ok = f.tune_ok(channel_max, frame_max, heartbeat)
            self.heartbeat = heartbeat if f.heartbeat is None else f.heartbeat
            write(tune_ok)
            write(f.open)
        elif ids == OPEN_OK:
            write(f.channel_open)
        elif ids == CHANNEL_OPEN_OK:
            if not self.waiter.done():
                self.waiter.set_result(None)
        elif ids == CLOSE_OK:
            if not self.waiter.done():
                self.waiter.set_result(None)
            self.transport.close()  # type: ignore[union-attr]
        elif ids in (CLOSE, CHANNEL_CLOSE):
            (code,) = _CLOSE_HEAD.unpack_from(buf, args)
            n = buf[args + 2]
            text = bytes(buf[args + 3:args + 3 + n]).decode("utf-8", "replace")
            if ids == CLOSE:
                write(f.close_ok)
            self._fail(AMQPClosed(code, text, 0 if ids == CLOSE else 1))

    def _fail(self, exc: AMQPClosed) -> None:
        self.error = exc
        if not self.waiter.done():
            self.waiter.set_exception(exc)
        if self.transport is not None:
            self.transport.close()

    # -- API ----------------------------------------------------------------------------------
    def close(self) -> asyncio.Future:
        """connection.close; the returned future is done at close-ok (the socket is closed then)."""
        self.waiter = asyncio.get_running_loop().create_future()
        if self.transport is None or self.transport.is_closing():
            self.waiter.set_result(None)
        else:
            self.transport.write(self.frames.close)
        return self.waiter

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()


async def open_connection(frames: ClientFrames, timeout: float = 10.0) -> ClientConnection:
    """Connect, handshake and open channel 1; AMQPClosed/OSError/TimeoutError on failure."""
    loop = asyncio.get_running_loop()
    u = frames.uri
    conn = ClientConnection(frames, loop)
    try:
        await asyncio.wait_for(loop.create_connection(lambda: conn, u.host, u.port), timeout)
        await asyncio.wait_for(conn.waiter, timeout)
    except BaseException:
        conn.abort()
        raise
    return conn


async def close_connection(conn: ClientConnection, timeout: float = 10.0) -> None:
    try:
        await asyncio.wait_for(conn.close(), timeout)
    except BaseException:
        conn.abort()
        raise


class IdleConnections:
    """Hold many open connections; one timer sends the heartbeats every one of them owes."""

    def __init__(self, frames: ClientFrames) -> None:
        self.frames = frames
        self.conns: list[ClientConnection] = []
        self.errors: list[str] = []
        self._beat: asyncio.TimerHandle | None = None

    async def open(self, count: int, concurrency: int, deadline: float) -> None:
        """Open up to ``count`` connections, ``concurrency`` handshakes at a time, until ``deadline``."""
        todo = iter(range(count))

        async def opener() -> None:
            for _ in todo:
                if time.monotonic() > deadline:
                    return
                try:
                    self.conns.append(await open_connection(self.frames))
                except (TimeoutError, AMQPClosed, OSError) as exc:
                    self.errors.append(f"{type(exc).__name__}: {exc}")
                    if len(self.errors) > 100:  # the broker refuses: stop, report what we have
                        return
        await asyncio.gather(*(opener() for _ in range(max(1, concurrency))))
        self._schedule_heartbeats()

    def _schedule_heartbeats(self) -> None:
        beats = [c.heartbeat for c in self.conns if c.heartbeat]
        if beats:
            self._beat = asyncio.get_running_loop().call_later(min(beats) / 2, self._heartbeats)

    def _heartbeats(self) -> None:
        frame = self.frames.heartbeat_frame
        for c in self.conns:
            if c.heartbeat and c.transport is not None:
                c.transport.write(frame)
        self._schedule_heartbeats()

    def alive(self) -> int:
        return sum(1 for c in self.conns if c.transport is not None and not c.transport.is_closing())

    async def close_all(self, concurrency: int = 200) -> None:
        if self._beat is not None:
            self._beat.cancel()
        conns = iter(self.conns)

        async def closer() -> None:
            for c in conns:
                try:
                    await close_connection(c, 5.0)
                except (TimeoutError, AMQPClosed, OSError):
                    pass
        await asyncio.gather(*(closer() for _ in range(max(1, concurrency))))


@dataclass
class ChurnCounts:
    """What the churn loops did; ``done`` is read by the sampler while they run."""

    done: int = 0
    errors: int = 0
    first_error: str = ""


async def churn(frames: ClientFrames, concurrency: int, duration: float, counts: ChurnCounts,
                on_done: Callable[[int], None] | None = None) -> None:
    """``concurrency`` loops of open (handshake + channel.open) and close for ``duration`` seconds."""
    stop_at = time.monotonic() + duration

    async def loop_one() -> None:
        while time.monotonic() < stop_at:
            try:
                conn = await open_connection(frames)
                await close_connection(conn)
            except (TimeoutError, AMQPClosed, OSError) as exc:
                counts.errors += 1
                if not counts.first_error:
                    counts.first_error = f"{type(exc).__name__}: {exc}"
                await asyncio.sleep(0.01)
                continue
            counts.done += 1
            if on_done is not None:
                on_done(counts.done)
    await asyncio.gather(*(loop_one() for _ in range(max(1, concurrency))))
