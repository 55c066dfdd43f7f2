"""The follower's side of one replication stream: handshake, full sync, applying actions, acks.

Each stream has its own :class:`~replication.files.FileWriter`, so a durable batch of one stream
covers exactly the writes it acks. Acks go out after the batch is durable (fdatasync of the
written files and fsync of changed directories, in a worker thread, at most ``MAX_SYNCS`` batches
at a time while the next one is received), never per action, and in order.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import deque

from replication import protocol as p
from replication.files import CrcCache, FileWriter, make_durable, store_dirs, walk

log = logging.getLogger("shardmq.replication")

_READ = 1 << 20
HANDSHAKE_TIMEOUT_S = 10.0
# Durability batches in flight per stream. With one, data that arrives while an fdatasync is slow
# (a journal commit behind other writers) waits for it to end and then for its own; with two it
# starts its own at once, and the confirm that waits for it is released sooner.
MAX_SYNCS = 2


class AuthFailed(Exception):
    """The leader refused us, or could not prove it knows the secret."""


class StreamReceiver:
    def __init__(self, root: str, secret: bytes, name: str, stream: str, crcs: CrcCache) -> None:
        self.root = os.path.abspath(root)
        self.secret = secret
        self.name = name
        self.stream = stream
        self.crcs = crcs
        self.writer = FileWriter(self.root)
        self.decoder = p.Decoder()
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
        self._writer_w: asyncio.StreamWriter | None = None
        self._events: list = []

    # ------------------------------------------------------------ connection
    async def _next(self, reader: asyncio.StreamReader) -> p.Event:
        while not self._events:
            data = await reader.read(_READ)
            if not data:
                raise ConnectionError("leader closed the connection")
            self._events = self.decoder.feed(data)
        return self._events.pop(0)

    async def handshake(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonce_f = p.new_nonce()
        writer.write(p.encode_hello(self.name, self.stream, nonce_f))
        ev = await asyncio.wait_for(self._next(reader), HANDSHAKE_TIMEOUT_S)
        if isinstance(ev, p.Refused):
            raise AuthFailed(f"leader refused: {ev.reason}")
        if not isinstance(ev, p.Challenge) or ev.version != p.VERSION:
            raise AuthFailed(f"unexpected handshake answer {type(ev).__name__}")
        if not p.check_proof(p.leader_proof(self.secret, self.stream, nonce_f, ev.nonce), ev.proof):
            raise AuthFailed("the leader does not know the cluster secret")
        writer.write(p.encode_auth(p.follower_proof(self.secret, self.stream, self.name, ev.nonce, nonce_f)))
        ev = await asyncio.wait_for(self._next(reader), HANDSHAKE_TIMEOUT_S)
        if isinstance(ev, p.Refused):
            raise AuthFailed(f"leader refused: {ev.reason}")
        if not isinstance(ev, p.Welcome):
            raise AuthFailed(f"unexpected handshake answer {type(ev).__name__}")
        self.streams = ev.streams
        self.leader = ev.leader

    async def run(self, host: str, port: int) -> None:
        """Connect, authenticate, full-sync, then apply actions until the connection ends (raises)."""
        reader, writer = await asyncio.open_connection(host, port, limit=_READ * 4)
        self._writer_w = writer
        try:
            await self.handshake(reader, writer)
            await self._serve(reader, writer)
        finally:
            writer.close()
            self.writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        ev = await self._next(reader)
        if not isinstance(ev, p.FileList):
            raise p.ProtocolError(f"expected FILE_LIST, got {type(ev).__name__}")
        wanted = await loop.run_in_executor(None, self._compare, ev)
        writer.write(p.encode_file_request(wanted))
        log.info("replication %s: full sync from %s: %d of %d files differ", self.stream, self.leader,
                 len(wanted), len(ev.files))
        while True:
            if self._events:
                events, self._events = self._events, []
            else:
                data = await reader.read(_READ)
                if not data:
                    raise ConnectionError("leader closed the connection")
                events = self.decoder.feed(data)  # raises CorruptAction before anything is applied
            for ev in events:
                self._apply(ev)
            self._maybe_sync(loop)

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
        elif isinstance(ev, p.FileData):
            if ev.total < 0:
                w.delete(ev.path)
            else:
                w.write_at(ev.path, ev.offset, ev.data, truncate=ev.offset == 0)
        elif isinstance(ev, p.SyncDone):
            self.sync_done = True
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
                if self._writer_w is not None:
                    self._writer_w.close()
                return
            ack = (position, sync_done)
        if ack is None:
            return
        position, sync_done = ack
        self.acked = position
        if self._writer_w is not None and not self._writer_w.is_closing():
            self._writer_w.write(p.encode_ack(position, sync_done))
        if sync_done and not self.synced:
            self.synced = True
            self.synced_event.set()
            log.info("replication %s: in sync with %s", self.stream, self.leader)
        self._maybe_sync(loop)
