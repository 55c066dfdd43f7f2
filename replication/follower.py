"""ReplicationFollower: keeps this node's data dir a copy of the leader's (see docs/cluster.md).

One session = one connection per stream: the node stream first (its full sync decides which
queue directories exist at all), then one per leader shard (``Welcome.streams``). If the node
stream ends (leader gone, CRC32 mismatch, ack timeout on the leader, nothing from the leader for
the heartbeat timeout: a hung, stopped or unreachable leader), or the leader turns out to be
another one, the whole session is dropped and started again after a short pause: the next full
sync sends only the files whose size or CRC32 differ and deletes what the leader no longer has,
so a corrupted file is replaced rather than patched and acked messages never come back.

A shard stream that ends alone (that leader shard was killed and restarts, a CRC32 mismatch on
it, its own ack or heartbeat timeout) is reconnected alone: the other streams go on, and only that
stream's full sync runs again (its file list covers every directory the restarted shard has; a
store directory this follower got from that stream and the leader no longer lists is deleted, see
:class:`StoreDirOwners`). Until it is in sync again the leader counts this follower out of sync
(a follower is in sync when every stream is), so it leaves the ISR as before: a confirm on that
shard never counts on a copy it did not get.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from replication import protocol as p
from replication.files import CrcCache, remove_temps, store_dir_of
from replication.receiver import (
    FILE_LIST_TIMEOUT_S,
    AuthFailed,
    FileListTimeout,
    HeartbeatTimeout,
    LeaderChanged,
    StreamReceiver,
)

log = logging.getLogger("shardmq.replication")

RETRY_S = 0.5
AUTH_RETRY_S = 5.0


class StoreDirOwners:
    """Which shard stream each store directory of this data dir came from.

    A shard stream that reconnects alone gets a file list of the directories that shard has now; its
    full sync deletes the files of those it does not list, but a directory the shard deleted while
    its stream was down (a queue deleted as the restarted shard came up) is in no list at all. The
    whole-session resync found those through the node stream's list of every store directory; a
    stream resyncing alone finds them here: a directory it owned that its new list leaves out is
    deleted, unless another stream wrote to it since (a queue deleted and declared again on another
    shard: that stream's files are the current ones).

    Updated on the event loop only: at a file list, when a stream's writer opens or replaces a file
    (not per write: an open file is written without a look-up) and when a stream deletes a directory.
    """

    def __init__(self) -> None:
        self._owner: dict[str, str] = {}

    def listed(self, stream: str, dirs: list[str]) -> list[str]:
        """``stream``'s new file list names ``dirs``: the directories it owned and no longer lists
        (to delete); from now on it owns the listed ones."""
        listed = set(dirs)
        stale = [d for d, s in self._owner.items() if s == stream and d not in listed]
        for d in stale:
            del self._owner[d]
        for d in dirs:
            if store_dir_of(d) == d:
                self._owner[d] = stream
        return stale

    def wrote(self, stream: str, rel: str) -> None:
        d = store_dir_of(rel)
        if d is not None:
            self._owner[d] = stream

    def deleted(self, stream: str, rel: str) -> None:
        if self._owner.get(rel) == stream:
            del self._owner[rel]

    def owner(self, rel: str) -> str | None:
        return self._owner.get(rel)


class ReplicationFollower:
    def __init__(self, config: Any, data_dir: Path | str, secret: bytes, node_name: str,
                 leader_host: str, leader_port: int) -> None:
        self.config = config
        self.data_dir = str(data_dir)
        self.secret = secret
        self.node_name = node_name
        self.leader_host = leader_host
        self.leader_port = leader_port
        self.file_list_timeout = float(getattr(config, "replication_file_list_timeout", FILE_LIST_TIMEOUT_S))
        self.heartbeat = float(getattr(config, "replication_heartbeat", 0) or 0)
        self.heartbeat_timeout = float(getattr(config, "replication_heartbeat_timeout", 0) or 0)
        self._task: asyncio.Task | None = None
        # The current receiver of each stream of the session, the node's first.
        self._receivers: dict[str, StreamReceiver] = {}
        # One per stream (their full syncs hash in parallel threads); they survive sessions, so
        # unchanged files are not hashed again.
        self._crcs: dict[str, CrcCache] = {}
        self.owners = StoreDirOwners()
        self.sessions = 0
        self.connections: dict[str, int] = {}  # per stream: connections opened (every session)
        self.stream_restarts = 0  # shard streams reconnected alone, the session going on
        self.file_list_timeouts = 0
        self.heartbeat_timeouts = 0
        self.last_error = ""

    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """Stop replicating. Everything applied is made durable; the data dir is what the leader had
        at some point (plus at most a torn tail that recovery cuts), so a promotion can start from it."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
            self._task = None
        self._receivers = {}

    def status(self) -> dict:
        recs = self._receivers
        node = recs.get("node")
        connected = node is not None and node.streams != []
        in_sync = (connected and all(s in recs for s in node.streams)
                   and all(r.synced for r in recs.values()))
        return {
            "connected": connected,
            "in_sync": in_sync,
            "lag_bytes": sum(r.position - r.acked for r in recs.values()),  # received but not yet durable
            "leader": f"{self.leader_host}:{self.leader_port}",
            "streams": {r.stream: {"synced": r.synced, "position": r.position, "acked": r.acked,
                                   "heartbeats": r.heartbeats, "connections": self.connections.get(r.stream, 0)}
                        for r in recs.values()},
            "sessions": self.sessions,
            "stream_restarts": self.stream_restarts,
            "file_list_timeouts": self.file_list_timeouts,
            "heartbeat_timeouts": self.heartbeat_timeouts,
            "last_error": self.last_error,
        }

    def _crc_cache(self, stream: str) -> CrcCache:
        return self._crcs.setdefault(stream, CrcCache())

    async def _run(self) -> None:
        # What a killed follower (or node) left half written: no writer runs in the data dir yet.
        removed = await asyncio.get_running_loop().run_in_executor(None, remove_temps, self.data_dir)
        if removed:
            log.info("replication: removed %d temporary file(s) a killed process left in the data dir: %s",
                     len(removed), ", ".join(removed[:5]) + (" ..." if len(removed) > 5 else ""))
        while True:
            delay = RETRY_S
            try:
                await self._session()
            except asyncio.CancelledError:
                raise
            except AuthFailed as exc:
                self.last_error = str(exc)
                log.error("replication: authentication with %s:%d failed: %s", self.leader_host,
                          self.leader_port, exc)
                delay = AUTH_RETRY_S
            except Exception as exc:
                if not self._note_end(exc, "session", "dropping the session and reconnecting"):
                    log.exception("replication: session with %s:%d failed; resyncing", self.leader_host,
                                  self.leader_port)
            self._receivers = {}
            await asyncio.sleep(delay)

    def _note_end(self, exc: BaseException, what: str, then: str) -> bool:
        """Count and log why a stream (or the session: ``what``) ended; False for an unexpected error
        (the caller logs it with its traceback)."""
        self.last_error = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, FileListTimeout):
            self.last_error = str(exc)
            self.file_list_timeouts += 1
            log.warning("replication: %s; %s", exc, then)
        elif isinstance(exc, HeartbeatTimeout):
            self.last_error = str(exc)
            self.heartbeat_timeouts += 1
            log.warning("replication: %s; %s", exc, then)
        elif isinstance(exc, (OSError, p.ProtocolError, LeaderChanged)):
            log.warning("replication: %s with %s:%d ended: %s; %s", what, self.leader_host,
                        self.leader_port, self.last_error, then)
        else:
            return False
        return True

    def _receiver(self, stream: str, expect_leader: str = "", expect_streams: list[str] | None = None,
                  ) -> StreamReceiver:
        self.connections[stream] = self.connections.get(stream, 0) + 1
        owners = self.owners
        rec = StreamReceiver(self.data_dir, self.secret, self.node_name, stream, self._crc_cache(stream),
                             self.file_list_timeout, self.heartbeat, self.heartbeat_timeout,
                             expect_leader=expect_leader, expect_streams=expect_streams,
                             on_file_list=None if stream == "node" else self._on_file_list)
        if stream != "node":
            rec.writer.admit = lambda rel, deleting: self._admit(rec, rel, deleting)
            rec.on_delete = lambda rel: owners.deleted(stream, rel)
        self._receivers[stream] = rec
        return rec

    def _admit(self, rec: StreamReceiver, rel: str, deleting: bool) -> bool:
        """Whether shard stream ``rec`` may open, replace or delete ``rel`` (see FileWriter.admit).

        Streams are not ordered with each other. A queue (or delay store) deleted on shard A and
        declared again on shard B has the same directory, and B's first writes to it can arrive here
        before A's last actions on the old one (its DELETE above all, which removed the new queue's
        files with the old ones). On the leader the directory B writes to is a new one: so B's first
        write to a directory another stream owns here removes what that stream left in it (what its
        own DELETE would have removed), and that stream's actions on it are dropped until its DELETE
        of it, the last one it sends about the old queue (or until its next file list: a stream that
        reconnects starts from the leader shard's present). Open files of the old owner's under it
        are closed, so its writes pass here too. Called on a cache miss, not per write.
        """
        d = store_dir_of(rel)
        if d is None:
            return True
        writer = rec.writer
        if d in writer.fenced:
            if deleting and rel == d:
                writer.fenced.discard(d)
                log.info("replication %s: its late delete of %s dropped: another stream has it since",
                         rec.stream, d)
            return False
        if deleting:
            return True
        stream = rec.stream
        prev = self.owners.owner(d)
        if prev is not None and prev != stream:
            old = self._receivers.get(prev)
            if old is not None:
                old.writer.fence(d)
            log.info("replication %s: %s is declared again here after %s had it: the old files go, "
                     "%s's late actions on it are dropped", stream, d, prev, prev)
            writer.remove(d)
        self.owners.wrote(stream, rel)
        return True

    def _on_file_list(self, rec: StreamReceiver, listing: p.FileList) -> None:
        """A shard stream's file list (on the loop, before its comparison runs in a thread): delete
        the store directories that stream gave us and the leader's shard no longer has."""
        # A connection's writer may have been fenced before its list came (_admit): the list is the
        # leader shard's present, no late action of an older connection's can follow it.
        rec.writer.fenced.clear()
        for d in self.owners.listed(rec.stream, listing.dirs):
            log.info("replication %s: deleting %s: no longer on the leader", rec.stream, d)
            rec.writer.delete(d)

    async def _session(self) -> None:
        self.sessions += 1
        self._receivers = {}
        node = self._receiver("node")
        tasks: list[asyncio.Task] = []
        loop = asyncio.get_running_loop()
        try:
            tasks.append(loop.create_task(node.run(self.leader_host, self.leader_port)))
            synced = loop.create_task(node.synced_event.wait())
            done, _ = await asyncio.wait([tasks[0], synced], return_when=asyncio.FIRST_COMPLETED)
            if tasks[0] in done:
                synced.cancel()
                tasks[0].result()  # raises why it ended
                raise ConnectionError("node stream ended")
            for stream in node.streams:
                if stream != "node":
                    tasks.append(loop.create_task(self._shard_stream(stream, node.leader, node.streams)))
            # Ends when the node stream ends or a shard stream meets another leader (or its secret
            # is refused); a shard stream that just ends is reconnected by _shard_stream.
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                t.result()
            raise ConnectionError("the node stream ended")
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _shard_stream(self, stream: str, leader: str, streams: list[str]) -> None:
        """Run one shard stream for the session, reconnecting it alone whenever it ends. Raises (ending
        the session) when the leader refuses us or is not the one the node stream follows."""
        first = True
        while True:
            if not first:
                self.stream_restarts += 1
            first = False
            rec = self._receiver(stream, leader, streams)
            try:
                await rec.run(self.leader_host, self.leader_port)
            except (asyncio.CancelledError, AuthFailed, LeaderChanged):
                raise
            except Exception as exc:
                if not self._note_end(exc, f"stream {stream}", "reconnecting that stream alone"):
                    self.last_error = f"{type(exc).__name__}: {exc}"
                    log.exception("replication %s: stream failed; reconnecting it alone", stream)
            await asyncio.sleep(RETRY_S)
