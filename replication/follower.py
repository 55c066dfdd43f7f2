"""ReplicationFollower: keeps this node's data dir a copy of the leader's (see docs/cluster.md).

One session = one connection per stream: the node stream first (its full sync decides which
queue directories exist at all), then one per leader shard (``Welcome.streams``). If any stream
ends (leader gone, CRC32 mismatch, ack timeout on the leader, nothing from the leader for the
heartbeat timeout: a hung, stopped or unreachable leader), the whole session is dropped and
started again after a short pause: the next full sync sends only the files whose size or CRC32
differ and deletes what the leader no longer has, so a corrupted file is replaced rather than
patched and acked messages never come back.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from replication import protocol as p
from replication.files import CrcCache
from replication.receiver import (
    FILE_LIST_TIMEOUT_S,
    AuthFailed,
    FileListTimeout,
    HeartbeatTimeout,
    StreamReceiver,
)

log = logging.getLogger("shardmq.replication")

RETRY_S = 0.5
AUTH_RETRY_S = 5.0


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
        self._receivers: list[StreamReceiver] = []
        # One per stream (their full syncs hash in parallel threads); they survive sessions, so
        # unchanged files are not hashed again.
        self._crcs: dict[str, CrcCache] = {}
        self.sessions = 0
        self.file_list_timeouts = 0
        self.heartbeat_timeouts = 0
        self.last_error = ""

    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """Stop replicating. Everything applied is made durable; the data dir is what the leader had
        at some point (plus at most a torn tail that the normal recovery cuts), so a promotion can
        start from it."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
            self._task = None
        self._receivers = []

    def status(self) -> dict:
        recs = self._receivers
        connected = bool(recs) and recs[0].streams != []
        in_sync = connected and len(recs) == len(recs[0].streams) and all(r.synced for r in recs)
        return {
            "connected": connected,
            "in_sync": in_sync,
            "lag_bytes": sum(r.position - r.acked for r in recs),  # received but not yet durable
            "leader": f"{self.leader_host}:{self.leader_port}",
            "streams": {r.stream: {"synced": r.synced, "position": r.position, "acked": r.acked,
                                   "heartbeats": r.heartbeats} for r in recs},
            "sessions": self.sessions,
            "file_list_timeouts": self.file_list_timeouts,
            "heartbeat_timeouts": self.heartbeat_timeouts,
            "last_error": self.last_error,
        }

    def _crc_cache(self, stream: str) -> CrcCache:
        return self._crcs.setdefault(stream, CrcCache())

    async def _run(self) -> None:
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
            except FileListTimeout as exc:
                self.last_error = str(exc)
                self.file_list_timeouts += 1
                log.warning("replication: %s; dropping the session and reconnecting", exc)
            except HeartbeatTimeout as exc:
                self.last_error = str(exc)
                self.heartbeat_timeouts += 1
                log.warning("replication: %s; dropping the session and reconnecting", exc)
            except (OSError, p.ProtocolError) as exc:
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.warning("replication: session with %s:%d ended: %s; resyncing", self.leader_host,
                            self.leader_port, self.last_error)
            except Exception as exc:
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.exception("replication: session with %s:%d failed; resyncing", self.leader_host,
                              self.leader_port)
            self._receivers = []
            await asyncio.sleep(delay)

    def _receiver(self, stream: str) -> StreamReceiver:
        return StreamReceiver(self.data_dir, self.secret, self.node_name, stream, self._crc_cache(stream),
                              self.file_list_timeout, self.heartbeat, self.heartbeat_timeout)

    async def _session(self) -> None:
        self.sessions += 1
        node = self._receiver("node")
        self._receivers = [node]
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
                if stream == "node":
                    continue
                rec = self._receiver(stream)
                self._receivers.append(rec)
                tasks.append(loop.create_task(rec.run(self.leader_host, self.leader_port)))
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                t.result()
            raise ConnectionError("a stream ended")
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
