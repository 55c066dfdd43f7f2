"""The follower's side of one replication stream: handshake, full sync, applying actions, acks.

Each stream has its own :class:`~replication.files.FileWriter`, so a durable batch of one stream
covers exactly the writes it acks. Received bytes land in one reused buffer
(:class:`~replication.protocol.FrameBuffer`, through ``asyncio.BufferedProtocol``) and APPEND
frames, nearly all the traffic, are checked and written from it in place: no copy, no object per
frame beyond a slice. Other frames are decoded into events.

Acks go out after the batch is durable (fdatasync of the written files and fsync of changed
directories, in a worker thread, at most ``MAX_SYNCS`` batches at a time while the next one is
received), never per action, and in order.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import deque
from collections.abc import Callable

from replication import protocol as p
from replication.files import CrcCache, FileWriter, make_durable, store_dirs, walk

log = logging.getLogger("shardmq.replication")

# Unapplied bytes held while the file list is compared (the socket is paused beyond this).
_HOLD_MAX = 4 << 20
HANDSHAKE_TIMEOUT_S = 10.0
# Default of --replication-file-list-timeout: after WELCOME the leader's node hands a shard stream to
# its shard (waiting up to leader.HANDOFF_WAIT_S, 30 s, for one that restarts), which first hashes its
# sealed segments off its loop (a restarted leader with a large data dir) and then lists its files.
FILE_LIST_TIMEOUT_S = 60.0
# Durability batches in flight per stream. With one, data that arrives while an fdatasync is slow
# (a journal commit behind other writers) waits for it to end and then for its own; with two it
# starts its own at once, and the confirm that waits for it is released sooner.
MAX_SYNCS = 2


class AuthFailed(Exception):
    """The leader refused us, or could not prove it knows the secret."""


class FileListTimeout(TimeoutError):
    """The leader welcomed us on a stream and then sent no file list in time (a stopped or hung
    shard): the follower drops the session and reconnects."""


class LeaderChanged(Exception):
    """A shard stream reconnected alone reached another leader (or one with other streams) than the
    session's node stream: the follower drops the whole session."""


class HeartbeatTimeout(TimeoutError):
    """Nothing arrived from the leader on a stream for the heartbeat timeout (a hung, stopped or
    unreachable leader): the follower drops the session and reconnects."""


class _Conn(asyncio.BufferedProtocol):
    """The socket end of a :class:`StreamReceiver`: reads into its FrameBuffer, hands it frames."""

    def __init__(self, on_frames: Callable[[], None], on_lost: Callable[[Exception | None], None]) -> None:
        self.frames = p.FrameBuffer()
        self.transport: asyncio.Transport | None = None
        self._on_frames = on_frames
        self._on_lost = on_lost
        self.heard = False  # bytes arrived since the receiver's last heartbeat tick

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.frames.writable()

    def buffer_updated(self, nbytes: int) -> None:
        self.heard = True
        self.frames.received(nbytes)
        self._on_frames()

    def eof_received(self) -> bool:
        return False  # close

    def connection_lost(self, exc: Exception | None) -> None:
        self._on_lost(exc)


class StreamReceiver:
    def __init__(self, root: str, secret: bytes, name: str, stream: str, crcs: CrcCache,
                 file_list_timeout: float = FILE_LIST_TIMEOUT_S, heartbeat: float = 0.0,
                 heartbeat_timeout: float = 0.0, *, expect_leader: str = "",
                 expect_streams: list[str] | None = None,
                 on_file_list: Callable[[StreamReceiver, p.FileList], None] | None = None) -> None:
        self.root = os.path.abspath(root)
        # A shard stream of a running session: the leader and streams its node stream welcomed.
        self.expect_leader = expect_leader
        self.expect_streams = expect_streams
        self.on_file_list = on_file_list  # on the loop, before the list is compared
        self.on_delete: Callable[[str], None] | None = None  # a DELETE action applied (its path)
        self.file_list_timeout = file_list_timeout
        self.heartbeat = heartbeat  # ours, announced in HELLO (0: off)
        self.heartbeat_timeout = heartbeat_timeout
        self.leader_heartbeat = 0.0  # the leader's, from its CHALLENGE (0: an older leader, or off)
        self._tick: asyncio.TimerHandle | None = None
        self._sent = False  # something went to the leader since the last tick
        self._last_sent = self._last_heard = self._last_tick = 0.0
        self.heartbeats = 0  # HEARTBEAT frames received (status: an idle stream is kept alive by them)
        self.secret = secret
        self.name = name
        self.stream = stream
        self.crcs = crcs
        self.writer = FileWriter(self.root)
        self.streams: list[str] = []
        self.leader = ""
        self.position = 0  # action bytes applied
        self.acked = 0
        self.sync_done = False  # SYNC_DONE received (and everything before it applied)
        self.synced = False  # ... and made durable and acked
        self.synced_event = asyncio.Event()
        # Syncs started and not yet acked: (future, position, sync_done), oldest first.
        self._inflight: deque[tuple[asyncio.Future, int, bool]] = deque()
        self._sub_position = 0  # what the newest started sync covers
        self._sub_sync_done = False
        self._writer_w: asyncio.WriteTransport | None = None  # where acks go
        self._conn: _Conn | None = None
        # Until the file list is compared, frames are decoded into events and queued here (and
        # handed to the handshake and full sync one by one); after that they are applied as they come.
        self._events: deque[p.Event] = deque()
        self._held = 0  # bytes of the queued events
        self._applying = False
        self._wakeup: asyncio.Future | None = None
        self._ended: asyncio.Future | None = None  # the connection's end: an exception, never a result
        self._paths: dict[bytes, str] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    # ------------------------------------------------------------ connection
    def _end(self, exc: BaseException) -> None:
        if self._tick is not None:
            self._tick.cancel()
            self._tick = None
        if self._ended is not None and not self._ended.done():
            self._ended.set_exception(exc)
            self._ended.exception()  # retrieved: run() may have left already
        if self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)
        if self._writer_w is not None:
            self._writer_w.close()

    def _on_lost(self, exc: Exception | None) -> None:
        self._end(exc if exc is not None else ConnectionError("leader closed the connection"))

    def _on_frames(self) -> None:
        conn = self._conn
        if conn is None or self._ended is None or self._ended.done():
            return
        try:
            if self._applying:
                self._apply_frames(conn.frames)
            else:
                self._queue_frames(conn.frames)
        except p.ProtocolError as exc:  # CorruptAction included: nothing of that frame was applied
            self._end(exc)
        except OSError as exc:
            self._end(exc)

    def _queue_frames(self, frames: p.FrameBuffer) -> None:
        while (fr := frames.next_frame()) is not None:
            ev = frames.event(*fr)
            self._events.append(ev)
            self._held += fr[2] - fr[1]
        if self._held > _HOLD_MAX and self._conn is not None and self._conn.transport is not None:
            self._conn.transport.pause_reading()
        if self._events and self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)

    def _apply_frames(self, frames: p.FrameBuffer) -> None:
        write_at = self.writer.write_at
        paths = self._paths
        view = frames.view
        position = self.position
        try:
            while (fr := frames.next_frame()) is not None:
                kind, start, end = fr
                if kind == p.APPEND:
                    path, offset, data = p.append_in_place(view, start, end, paths)
                    write_at(path, offset, data)
                    position += end - start + p.HEADER_SIZE
                else:
                    self.position = position
                    self._apply(frames.event(kind, start, end))
                    position = self.position
        finally:
            self.position = position
        self._maybe_sync(self._loop)

    async def _next(self) -> p.Event:
        while not self._events:
            if self._ended.done():
                self._ended.result()  # raises why
            self._wakeup = self._loop.create_future()
            await self._wakeup
        ev = self._events.popleft()
        if self._held > _HOLD_MAX:
            self._held = 0  # a rough bound: resume once the consumer takes something
            self._conn.transport.resume_reading()
        return ev

    async def handshake(self) -> None:
        writer = self._writer_w
        nonce_f = p.new_nonce()
        writer.write(p.encode_hello(self.name, self.stream, nonce_f, self.heartbeat))
        # asyncio.timeout, not wait_for: in 3.11 wait_for returns the result when the answer and a
        # cancellation arrive together, and a session that cancels this stream (another stream
        # failed) then waited for a stream that went on streaming.
        async with asyncio.timeout(HANDSHAKE_TIMEOUT_S):
            ev = await self._next()
        if isinstance(ev, p.Refused):
            raise AuthFailed(f"leader refused: {ev.reason}")
        if not isinstance(ev, p.Challenge) or ev.version != p.VERSION:
            raise AuthFailed(f"unexpected handshake answer {type(ev).__name__}")
        if not p.check_proof(p.leader_proof(self.secret, self.stream, nonce_f, ev.nonce), ev.proof):
            raise AuthFailed("the leader does not know the cluster secret")
        self.leader_heartbeat = ev.heartbeat
        writer.write(p.encode_auth(p.follower_proof(self.secret, self.stream, self.name, ev.nonce, nonce_f)))
        async with asyncio.timeout(HANDSHAKE_TIMEOUT_S):
            ev = await self._next()
        if isinstance(ev, p.Refused):
            raise AuthFailed(f"leader refused: {ev.reason}")
        if not isinstance(ev, p.Welcome):
            raise AuthFailed(f"unexpected handshake answer {type(ev).__name__}")
        if self.expect_leader and (ev.leader != self.expect_leader or ev.streams != self.expect_streams):
            raise LeaderChanged(f"stream {self.stream} reached leader {ev.leader} (streams {ev.streams}), "
                                f"the session follows {self.expect_leader} (streams {self.expect_streams})")
        self.streams = ev.streams
        self.leader = ev.leader

    async def run(self, host: str, port: int) -> None:
        """Connect, authenticate, full-sync, then apply actions until the connection ends (raises)."""
        loop = self._loop = asyncio.get_running_loop()
        self._ended = loop.create_future()
        transport, conn = await loop.create_connection(lambda: _Conn(self._on_frames, self._on_lost), host, port)
        self._conn = conn
        self._writer_w = transport
        try:
            await self.handshake()
            await self._serve()
        finally:
            if self._tick is not None:
                self._tick.cancel()
                self._tick = None
            transport.close()
            self.writer.close()

    async def _serve(self) -> None:
        loop = self._loop
        try:
            # Not wait_for: see handshake().
            async with asyncio.timeout(self.file_list_timeout):
                ev = await self._next()
        except TimeoutError:
            raise FileListTimeout(f"no file list on stream {self.stream} from {self.leader} within "
                                  f"{self.file_list_timeout:g} s of its welcome "
                                  "(--replication-file-list-timeout)") from None
        if not isinstance(ev, p.FileList):
            raise p.ProtocolError(f"expected FILE_LIST, got {type(ev).__name__}")
        # The leader has attached us: from here on both sides heartbeat (we send nothing before the
        # list: the leader's shard peeks at a handed-over connection to see whether we gave up on it).
        if self.heartbeat > 0 and self.leader_heartbeat > 0:
            self._last_sent = self._last_heard = self._last_tick = loop.time()
            self._tick = loop.call_later(self.heartbeat / 2, self._on_tick)
        if self.on_file_list is not None:
            self.on_file_list(self, ev)
        wanted = await loop.run_in_executor(None, self._compare, ev)
        self._writer_w.write(p.encode_file_request(wanted))
        self._sent = True
        log.info("replication %s: full sync from %s: %d of %d files differ", self.stream, self.leader,
                 len(wanted), len(ev.files))
        # From here on frames are applied as they arrive: first what was queued meanwhile. The leader's
        # silence counts from now (while the list was compared, reading may have been paused).
        self._applying = True
        self._last_heard = loop.time()
        try:
            while self._events:
                self._apply(self._events.popleft())
        except (p.ProtocolError, OSError) as exc:
            self._end(exc)
        self._held = 0
        self._conn.transport.resume_reading()
        self._on_frames()
        await self._ended  # raises why the connection ended

    def _on_tick(self) -> None:
        """Every half heartbeat: a heartbeat if nothing went to the leader since the last tick, and the
        end of the stream if nothing came from it for the heartbeat timeout."""
        loop = self._loop
        now = loop.time()
        # A stall of this process (its loop held, or the process stopped) is not the leader's
        # silence: what the leader sent meanwhile waits in the socket, to be read after this tick.
        period = self.heartbeat / 2
        gap = now - self._last_tick
        stalled = gap - period if gap > 2 * period else 0.0
        self._last_tick = now
        conn = self._conn
        if conn.heard or not self._applying:
            conn.heard = False
            self._last_heard = now
        else:
            self._last_heard = min(now, self._last_heard + stalled)
        timeout = max(self.heartbeat_timeout, 3 * self.leader_heartbeat)
        if now - self._last_heard > timeout:
            self._tick = None
            self._end(HeartbeatTimeout(
                f"nothing from {self.leader} on stream {self.stream} for {now - self._last_heard:.1f} s "
                f"(--replication-heartbeat-timeout {timeout:g}; it heartbeats every "
                f"{self.leader_heartbeat:g} s when idle)"))
            return
        if self._sent:
            self._sent = False
            self._last_sent = now
        elif now - self._last_sent >= self.heartbeat - period / 2:
            if self._writer_w is not None and not self._writer_w.is_closing():
                self._writer_w.write(p.HEARTBEAT_FRAME)
            self._last_sent = now
        self._tick = loop.call_later(period, self._on_tick)

    def _compare(self, listing: p.FileList) -> list[str]:
        """Delete what the leader does not have in this stream's scope; return the paths that differ."""
        theirs = {path: (size, crc) for path, size, crc in listing.files}
        if self.stream == "node":
            mine = walk(self.root, None)
            keep_dirs = set(listing.dirs)
            for d in store_dirs(self.root):
                if d not in keep_dirs:
                    self.writer.delete(d)  # a queue or delay store the leader no longer has
        else:
            mine = walk(self.root, listing.dirs)
        for rel in mine:
            if rel not in theirs:
                self.writer.delete(rel)
        local = {path: (size, crc) for path, size, crc in self.crcs.listing(self.root, [r for r in mine if r in theirs])}
        return [path for path, want in theirs.items() if local.get(path) != want]

    def _apply(self, ev: p.Event) -> None:
        w = self.writer
        if isinstance(ev, p.Append):
            w.write_at(ev.path, ev.offset, ev.data)
            self.position += ev.size
        elif isinstance(ev, p.Replace):
            w.replace(ev.path, ev.data)
            self.position += ev.size
        elif isinstance(ev, p.Delete):
            w.delete(ev.path)
            self.position += ev.size
            if self.on_delete is not None:
                self.on_delete(ev.path)
        elif isinstance(ev, p.FileData):
            if ev.total < 0:
                w.delete(ev.path)
            else:
                w.write_chunk(ev.path, ev.offset, ev.data, ev.total)
        elif isinstance(ev, p.SyncDone):
            self.sync_done = True
        elif isinstance(ev, p.Heartbeat):
            self.heartbeats += 1  # the leader is alive (the _Conn's flag said so already)
        else:
            raise p.ProtocolError(f"unexpected {type(ev).__name__} while streaming")

    def _maybe_sync(self, loop: asyncio.AbstractEventLoop) -> None:
        # Nothing new since the last sync was started (SYNC_DONE also needs its own, flagged ack).
        if len(self._inflight) >= MAX_SYNCS or (self.position == self._sub_position
                                                and self.sync_done == self._sub_sync_done):
            return
        self._sub_position, self._sub_sync_done = self.position, self.sync_done
        fds, dirs = self.writer.take_dirty()
        fut = loop.run_in_executor(None, make_durable, fds, dirs)
        self._inflight.append((fut, self.position, self.sync_done))
        fut.add_done_callback(lambda _f: self._synced(loop))

    def _synced(self, loop: asyncio.AbstractEventLoop) -> None:
        # Syncs may finish out of order; a position is acked only once every sync before it is done.
        inflight = self._inflight
        ack: tuple[int, bool] | None = None
        while inflight and inflight[0][0].done():
            fut, position, sync_done = inflight.popleft()
            exc = None if fut.cancelled() else fut.exception()
            if fut.cancelled() or exc is not None:
                log.error("replication %s: making received data durable failed: %s", self.stream, exc)
                inflight.clear()
                self._end(exc if exc is not None else ConnectionError("durability batch cancelled"))
                return
            ack = (position, sync_done)
        if ack is None:
            return
        position, sync_done = ack
        self.acked = position
        if self._writer_w is not None and not self._writer_w.is_closing():
            self._writer_w.write(p.encode_ack(position, sync_done))
            self._sent = True
        if sync_done and not self.synced:
            self.synced = True
            self.synced_event.set()
            log.info("replication %s: in sync with %s", self.stream, self.leader)
        self._maybe_sync(loop)
