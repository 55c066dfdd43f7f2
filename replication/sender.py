"""The leader's side of one replication stream, living in the process that owns the files.

A shard runs one ``StreamSender`` for the files it owns (its queues' and delay stores'
directories), the node one for the rest (definitions, ...). The sender subscribes to the
process's write observer (``broker.write_observer``) while at least one follower is attached,
encodes every reported write as an action frame (contiguous appends to one file are coalesced
into one), and writes the frames to every follower at once.

When: a caller that asks for :meth:`StreamSender.position` is about to wait for the followers to
ack it (a shard starting its group fsync for confirms, a KV reply, a definition commit), so that
call sends everything written so far. Otherwise frames wait up to ``FLUSH_DELAY_S`` (5 ms; or until
``FLUSH_BYTES`` are pending). A follower then receives one burst per leader fsync and makes it
durable with one fdatasync, in parallel with the leader's own, instead of a send, a receive and a
sync for every loop turn: fewer syscalls on both sides and fewer cache flushes on a shared disk.

Attaching a follower's (already authenticated) socket is the start of its full sync: the file
list with CRC32s is computed in the same loop turn in which the follower starts receiving
actions, so nothing written in between is missed (the process is single-threaded: that turn is
the brief write pause). The follower asks for what differs; file data is read when sent, and
actions are offset-addressed and idempotent, so data newer than the list plus the actions that
follow converge on the leader's content.

Positions: ``seq`` counts the bytes of every action frame encoded since the sender started; a
follower attached at ``base`` that acked position p has everything up to ``base + p``. Confirm
gating (``when_replicated``) waits until every follower of the ISR has acked past a target seq.

Heartbeats (with a follower that announced them in its HELLO): the check that runs every
``_CHECK_S`` while followers are attached sends HEARTBEAT to a follower nothing was written to for
``heartbeat`` seconds, and drops a follower from which nothing (acks, its own heartbeats) arrived
for ``heartbeat_timeout`` seconds, as one that stops acking is dropped: a dead host, a dropped
network path (a half-open connection) or a hung follower leaves the ISR on an idle stream too.
The hot path pays a flag store per write and per received batch of acks, no clock read.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable

from broker import write_observer
from broker.crc import crc32
from replication import protocol as p
from replication.files import CrcCache, store_dirs, walk

log = logging.getLogger("shardmq.replication")

_HIGH_WATER = 8 << 20
_CHECK_S = 0.25
FULL_SYNC_ACK_TIMEOUT_S = 60.0
# A follower whose unsent backlog passes this is dropped (it resyncs) rather than growing memory.
MAX_BACKLOG = 256 << 20
# Writes nobody waits for yet are sent this long after the first of them, or once this many bytes
# are pending, whichever comes first (see the module docstring).
FLUSH_DELAY_S = 0.005
FLUSH_BYTES = 256 << 10


def _closed_by_peer(sock: socket.socket) -> bool:
    """True when the peer has closed (or reset) the connection. A follower sends nothing before the
    file list, so a readable byte here is not expected either: only EOF or an error say closed."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True


class _Link(asyncio.Protocol):
    """One follower on this stream."""

    def __init__(self, sender: StreamSender, name: str, peer_heartbeat: float = 0.0) -> None:
        self.sender = sender
        self.name = name
        # Heartbeats on this link: both sides announced them. The follower promised a frame at
        # least every peer_heartbeat seconds; we wait for one at most silence_timeout.
        self.heartbeats = sender.heartbeat > 0 and peer_heartbeat > 0
        self.silence_timeout = max(sender.heartbeat_timeout, 3 * peer_heartbeat)
        self.wrote = False  # something was written since the last check (set per write: no clock read)
        self.heard = False  # something arrived since the last check
        self.last_write = self.last_heard = time.monotonic()
        self.transport: asyncio.Transport | None = None
        self.decoder = p.Decoder()
        self.base = 0
        self.acked = 0  # global seq acked (durable on the follower)
        self.synced = False  # full sync applied and acked
        self.sync_target = -1
        self.last_ack = time.monotonic()
        self.closed = False
        self._can_write = asyncio.Event()
        self._can_write.set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        transport.set_write_buffer_limits(high=_HIGH_WATER)  # type: ignore[attr-defined]
        self.sender._attach(self)

    def data_received(self, data: bytes) -> None:
        self.heard = True
        try:
            events = self.decoder.feed(data)
        except p.ProtocolError as exc:
            log.warning("replication %s: follower %s sent garbage (%s): dropped", self.sender.stream, self.name, exc)
            self.close()
            return
        for ev in events:
            if isinstance(ev, p.Ack):
                self.sender._on_ack(self, ev)
            elif isinstance(ev, p.FileRequest):
                self.sender._spawn(self.sender._send_files(self, ev.paths))
            elif isinstance(ev, p.Heartbeat):
                pass  # heard (above)
            else:
                log.warning("replication %s: unexpected %s from %s: dropped", self.sender.stream,
                            type(ev).__name__, self.name)
                self.close()
                return

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._can_write.set()
        self.sender._detach(self)

    def pause_writing(self) -> None:
        self._can_write.clear()

    def resume_writing(self) -> None:
        self._can_write.set()

    async def drain(self) -> None:
        await self._can_write.wait()

    def write(self, data: bytes) -> None:
        if not self.closed and self.transport is not None:
            self.transport.write(data)
            self.wrote = True

    def writelines(self, frames: list) -> None:
        if not self.closed and self.transport is not None:
            self.transport.writelines(frames)
            self.wrote = True

    def close(self) -> None:
        # abort, not close: a stuck follower's backlog would otherwise keep the socket open to drain.
        if not self.closed and self.transport is not None:
            self.transport.abort()
        self.closed = True


class StreamSender:
    """See the module docstring. ``owned_dirs()`` returns the directories (relative to the data dir)
    this stream owns, or None for the node stream (everything that is not a store directory)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, data_dir: str, stream: str,
                 owned_dirs: Callable[[], list[str] | None], *, ack_timeout: float = 3.0,
                 heartbeat: float = 0.0, heartbeat_timeout: float = 0.0,
                 on_change: Callable[[], None] | None = None,
                 logical_size: Callable[[str], int | None] = lambda _p: None) -> None:
        self.loop = loop
        self.root = os.path.abspath(data_dir)
        self._prefix = self.root + os.sep
        self.stream = stream
        self.owned_dirs = owned_dirs
        self.ack_timeout = ack_timeout
        self.heartbeat = heartbeat  # seconds; 0: no heartbeats on this stream's links
        self.heartbeat_timeout = heartbeat_timeout
        self.on_change = on_change or (lambda: None)
        self.logical_size = logical_size
        self.links: dict[str, _Link] = {}
        self.seq = 0
        self._frames: list[bytes] = []
        self._frames_bytes = 0
        # The append being coalesced (a run): its stream path (None: no run), the absolute path as
        # the store passed it (the fast path compares identity), where it starts and ends, its data
        # pieces, their size and CRC32.
        self._run_rel: str | None = None
        self._run_path: str | None = None
        self._run_start = self._run_end = 0
        self._run_chunks: list[bytes] = []
        self._run_bytes = 0
        self._run_crc = 0
        self._flush_timer: asyncio.TimerHandle | None = None
        self._flush_soon = False
        self._marks: deque[tuple[int, float]] = deque()  # (seq at a flush, when): lag in seconds
        self._waiters: deque[tuple[int, Callable[[bool], None]]] = deque()
        self.isr: set[str] = set()
        self.min_isr = 0
        self._crcs = CrcCache()
        self._thread = threading.get_ident()
        self._tasks: set[asyncio.Task] = set()
        self._timer: asyncio.TimerHandle | None = None
        self._checked = 0.0  # when _check last ran
        self._nack_logged = 0.0
        self._rels: dict[str, str | None] = {}  # absolute path -> stream path (appends repeat paths)

    # ------------------------------------------------------------ observer (any thread)
    def _rel(self, path: str) -> str | None:
        if not path.startswith(self._prefix):
            return None
        rel = path[len(self._prefix):]
        if rel.startswith("run/") or rel == ".lock":
            return None
        return rel if os.sep == "/" else rel.replace(os.sep, "/")

    def append(self, path: str, offset: int, data: bytes) -> None:
        # The hot case (a queue's messages one after another, with the store's same path object):
        # extend the pending run without looking anything up. The run keeps the stores' bytes
        # objects as they are (a CRC32 computed as they come): no copy into a growing buffer and
        # no joined blob, whose fresh pages cost a page fault every 4 KiB (see flush()).
        if (path is self._run_path and offset == self._run_end and type(data) is bytes
                and threading.get_ident() == self._thread):
            self._run_chunks.append(data)
            self._run_crc = crc32(data, self._run_crc)
            n = len(data)
            self._run_end = offset + n
            self._run_bytes += n
            if self._run_bytes >= FLUSH_BYTES:
                self._schedule_flush()
            return
        self._append(path, offset, data)

    def _append(self, path: str, offset: int, data: bytes) -> None:
        if threading.get_ident() != self._thread:
            self.loop.call_soon_threadsafe(self.append, path, offset, bytes(data))
            return
        try:
            rel = self._rels[path]
        except KeyError:
            if len(self._rels) > 4096:
                self._rels.clear()
            rel = self._rels[path] = self._rel(path)
        if rel is None:
            return
        if type(data) is not bytes:
            data = bytes(data)  # kept until sent: never a buffer the store may reuse
        if self._run_rel is not None:
            if self._run_rel == rel and self._run_end == offset:
                self._run_path = path
                self._run_chunks.append(data)
                self._run_crc = crc32(data, self._run_crc)
                self._run_end = offset + len(data)
                self._run_bytes += len(data)
                if self._run_bytes + self._frames_bytes >= FLUSH_BYTES:
                    self._schedule_flush()
                return
            self._encode_pending()
        self._run_rel, self._run_path, self._run_start = rel, path, offset
        self._run_end = offset + len(data)
        self._run_chunks = [data]
        self._run_crc = crc32(data)
        self._run_bytes = len(data)
        self._schedule_flush()

    def replace(self, path: str, data: bytes) -> None:
        if threading.get_ident() != self._thread:
            self.loop.call_soon_threadsafe(self.replace, path, bytes(data))
            return
        rel = self._rel(path)
        if rel is not None:
            self._add(p.encode_replace(rel, data))

    def delete(self, path: str) -> None:
        if threading.get_ident() != self._thread:
            self.loop.call_soon_threadsafe(self.delete, path)
            return
        rel = self._rel(path)
        if rel is not None:
            self._add(p.encode_delete(rel))

    def _add(self, frame: bytes) -> None:
        if self._run_rel is not None:
            self._encode_pending()
        self._frames.append(frame)
        self._frames_bytes += len(frame)
        self.seq += len(frame)
        self._schedule_flush()

    def _encode_pending(self) -> None:
        rel, offset, size, chunks = self._run_rel, self._run_start, self._run_bytes, self._run_chunks
        self._run_rel = self._run_path = None
        self._run_chunks = []
        self._run_bytes = 0
        frames = self._frames
        step = p.MAX_FRAME // 2
        if size <= step:
            header = p.append_header_for(rel, offset, size, self._run_crc)
            frames.append(header)
            frames.extend(chunks)
            added = len(header) + size
        else:  # frames stay below MAX_FRAME: a huge run is cut in pieces
            view = memoryview(b"".join(chunks))
            added = 0
            for i in range(0, size, step):
                piece = view[i:i + step]
                header = p.append_header(rel, offset + i, piece)
                frames.append(header)
                frames.append(piece)
                added += len(header) + len(piece)
        self._frames_bytes += added
        self.seq += added

    def _schedule_flush(self) -> None:
        if self._frames_bytes + self._run_bytes >= FLUSH_BYTES:
            if not self._flush_soon:
                self._flush_soon = True
                self.loop.call_soon(self.flush)
        elif self._flush_timer is None:
            self._flush_timer = self.loop.call_later(FLUSH_DELAY_S, self.flush)

    def position(self) -> int:
        """The seq that covers every write reported so far. The caller is about to wait for the
        followers to ack it (confirm gating), so what is pending is sent now."""
        self.flush()
        return self.seq

    def flush(self) -> None:
        """Write the pending frames to every follower."""
        self._flush_soon = False
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        if self._run_rel is not None:
            self._encode_pending()
        if not self._frames:
            return
        # The frames as they are (headers and the stores' bytes objects), one writev each
        # (transport.writelines); nothing is joined into a fresh blob first.
        frames = self._frames
        self._frames = []
        self._frames_bytes = 0
        for link in list(self.links.values()):
            link.writelines(frames)
            if link.transport is not None and link.transport.get_write_buffer_size() > MAX_BACKLOG:
                log.warning("replication %s: follower %s is %d bytes behind on the wire: dropped",
                            self.stream, link.name, link.transport.get_write_buffer_size())
                link.close()
                self._detach(link)
        self._marks.append((self.seq, time.monotonic()))
        if len(self._marks) > 4096:
            self._marks.popleft()

    # ------------------------------------------------------------ followers
    def attach_socket(self, sock: socket.socket, name: str, peer_heartbeat: float = 0.0) -> None:
        """Start replicating to an authenticated follower connection (its full sync begins).
        ``peer_heartbeat``: the interval the follower announced in its HELLO (0: it has none)."""
        sock.setblocking(False)
        self._spawn(self._attach_socket(sock, name, peer_heartbeat))

    async def _attach_socket(self, sock: socket.socket, name: str, peer_heartbeat: float) -> None:
        # First pass, off the loop: hash every file that is not a live write segment, so the list
        # made in one loop turn by _attach (the second pass, the brief write pause) only hashes
        # what changed since (write segments, new acks). Sealed segments then cost the loop nothing.
        try:
            dirs = self.owned_dirs()
            rels = walk(self.root, dirs)
            cold = [r for r in rels if self.logical_size(os.path.join(self.root, r)) is None
                    and not self._crcs.fresh(self.root, r)]
            if cold:
                self._crcs.merge(await self.loop.run_in_executor(None, CrcCache.compute, self.root, cold))
            if _closed_by_peer(sock):
                # The follower gave up waiting for the file list (a stopped or slow shard: its handoffs
                # queued up) and is on a newer connection: attaching this one would replace that one.
                log.info("replication %s: follower %s closed this connection before its file list: dropped",
                         self.stream, name)
                sock.close()
                return
            await self.loop.connect_accepted_socket(lambda: _Link(self, name, peer_heartbeat), sock)
        except Exception:
            log.exception("replication %s: cannot attach follower %s", self.stream, name)
            sock.close()

    def _attach(self, link: _Link) -> None:
        old = self.links.pop(link.name, None)
        if old is not None:
            old.close()
        self.flush()  # what was written before the list goes to the others only
        dirs = self.owned_dirs()
        if dirs is None:
            rels = walk(self.root, None)
            listed_dirs = store_dirs(self.root)
        else:
            rels = walk(self.root, dirs)
            listed_dirs = dirs
        files = self._crcs.listing(self.root, rels, self.logical_size)
        link.base = link.acked = self.seq
        link.last_ack = link.last_write = link.last_heard = time.monotonic()
        link.write(p.encode_file_list(listed_dirs, files))
        self.links[link.name] = link
        if len(self.links) == 1:
            write_observer.subscribe(self)
        if self._timer is None:
            self._checked = time.monotonic()
            self._timer = self.loop.call_later(_CHECK_S, self._check)
        log.info("replication %s: follower %s attached (%d files listed)", self.stream, link.name, len(files))
        self.on_change()

    def _detach(self, link: _Link) -> None:
        if self.links.get(link.name) is link:
            del self.links[link.name]
            log.info("replication %s: follower %s detached", self.stream, link.name)
            if not self.links:
                write_observer.subscribe(None)
                if self._timer is not None:
                    self._timer.cancel()
                    self._timer = None
            self.on_change()
        self._check_waiters()

    async def _send_files(self, link: _Link, paths: list[str]) -> None:
        for rel in paths:
            if link.closed:
                return
            self.flush()  # older actions must not arrive after newer file data
            self._send_file(link, rel)
            await link.drain()
        if link.closed:
            return
        self.flush()
        link.sync_target = self.position()
        link.write(p.encode_sync_done())

    def _send_file(self, link: _Link, rel: str) -> None:
        full = os.path.join(self.root, rel)
        try:
            with open(full, "rb") as f:
                size = self.logical_size(full)
                if size is None:
                    size = os.fstat(f.fileno()).st_size
                data = f.read(size)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            link.write(p.encode_file_data(rel, 0, -1, b""))
            return
        data = data.ljust(size, b"\0")
        if not data:
            link.write(p.encode_file_data(rel, 0, 0, b""))
        for off in range(0, len(data), p.CHUNK):
            link.write(p.encode_file_data(rel, off, size, data[off:off + p.CHUNK]))

    def _on_ack(self, link: _Link, ev: p.Ack) -> None:
        acked = link.base + ev.position
        if acked > self.seq:
            log.warning("replication %s: follower %s acked beyond what was sent: dropped", self.stream, link.name)
            link.close()
            return
        link.acked = max(link.acked, acked)
        link.last_ack = time.monotonic()
        if ev.synced and not link.synced and link.sync_target >= 0 and link.acked >= link.sync_target:
            link.synced = True
            log.info("replication %s: follower %s in sync", self.stream, link.name)
            self.on_change()
        self._check_waiters()

    def _check(self) -> None:
        """Drop a follower that is behind and has not acked for ack_timeout, or that sent nothing for
        its heartbeat timeout; send a heartbeat to one nothing was written to for a heartbeat."""
        now = time.monotonic()
        # A stall of this process (its loop held, or the process stopped) is not the followers'
        # silence: what they sent meanwhile waits in the socket, to be read after this check.
        gap = now - self._checked
        stalled = gap - _CHECK_S if gap > 2 * _CHECK_S else 0.0
        self._checked = now
        for link in list(self.links.values()):
            if link.heartbeats:
                if link.heard:
                    link.heard = False
                    link.last_heard = now
                else:
                    link.last_heard = min(now, link.last_heard + stalled)
                if now - link.last_heard > link.silence_timeout:
                    log.warning("replication %s: follower %s sent nothing for %.1f s "
                                "(--replication-heartbeat-timeout %g): disconnected", self.stream, link.name,
                                now - link.last_heard, link.silence_timeout)
                    link.close()
                    self._detach(link)
                    continue
                if link.wrote:
                    link.wrote = False
                    link.last_write = now
                elif now - link.last_write >= self.heartbeat:
                    link.write(p.HEARTBEAT_FRAME)
                    link.wrote = False
                    link.last_write = now
            # During its full sync a follower hashes its files and receives whole files before it
            # gets to the actions behind them: give it longer (LavinMQ: 60 s) before calling it stuck.
            timeout = self.ack_timeout if link.synced else max(FULL_SYNC_ACK_TIMEOUT_S, self.ack_timeout)
            if link.acked >= self.seq:
                link.last_ack = now  # nothing to ack: not late
            elif now - link.last_ack > timeout:
                log.warning("replication %s: follower %s has not acked for %.1f s with %d bytes of lag: "
                            "disconnected", self.stream, link.name, now - link.last_ack, self.seq - link.acked)
                link.close()
                self._detach(link)
        self._timer = self.loop.call_later(_CHECK_S, self._check) if self.links else None

    def _spawn(self, coro) -> None:
        task = self.loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------ gating
    @property
    def gating(self) -> bool:
        return bool(self.isr) or self.min_isr > 0

    def set_isr(self, names: set[str], min_isr: int) -> None:
        if set(names) != self.isr or min_isr != self.min_isr:
            log.info("replication %s: confirms wait for ISR [%s] (min-isr %d)", self.stream,
                     ",".join(sorted(names)), min_isr)
        self.isr = set(names)
        self.min_isr = min_isr
        self._check_waiters()

    def isr_attached(self) -> bool:
        """Whether every ISR follower is attached and synced (else a wait for acks waits for the ISR to change)."""
        return all((link := self.links.get(name)) is not None and link.synced for name in self.isr)

    def when_replicated(self, target: int, callback: Callable[[bool], None]) -> None:
        """Call ``callback(True)`` once every ISR follower acked past ``target``, ``callback(False)``
        when the ISR is smaller than min_isr (the caller nacks)."""
        self._waiters.append((target, callback))
        self._check_waiters()

    def _check_waiters(self) -> None:
        waiters = self._waiters
        if not waiters:
            return
        if len(self.isr) < self.min_isr:
            now = time.monotonic()
            if now - self._nack_logged > 5:
                self._nack_logged = now
                log.warning("replication %s: %d in-sync followers (%s) < min-isr %d: nacking confirms",
                            self.stream, len(self.isr), ",".join(sorted(self.isr)) or "none", self.min_isr)
            while waiters:
                waiters.popleft()[1](False)
            return
        low = self.seq
        for name in self.isr:
            link = self.links.get(name)
            if link is None or not link.synced:
                return  # an ISR member is not here (yet): wait for it or for the ISR to change
            low = min(low, link.acked)
        while waiters and waiters[0][0] <= low:
            waiters.popleft()[1](True)

    # ------------------------------------------------------------ status
    def status(self) -> dict[str, list]:
        """{follower: [connected, in_sync, lag_bytes, lag_seconds, last_ack_monotonic, acked_position]}"""
        now = time.monotonic()
        out = {}
        for name, link in self.links.items():
            lag = self.seq - link.acked
            lag_s = 0.0
            if lag > 0:
                for seq, t in self._marks:
                    if seq > link.acked:
                        lag_s = now - t
                        break
            out[name] = [True, link.synced, lag, round(lag_s, 3), link.last_ack, link.acked - link.base]
        return out

    def close(self) -> None:
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        for link in list(self.links.values()):
            link.close()
        self.links.clear()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if write_observer.current is self:
            write_observer.subscribe(None)
        while self._waiters:
            self._waiters.popleft()[1](False)
