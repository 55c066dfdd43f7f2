"""ReplicationLeader: the leader node's replication port and its view of the followers.

It listens on ``--replication-port``, authenticates each connection (HMAC challenge-response,
replication/protocol.py), then serves the ``node`` stream itself (a StreamSender over the node's
own files) and hands every ``shard-N`` connection to shard N (replication/handoff.py), which
streams its queues' files directly. Shards report their followers' positions (contract
REPL_STATUS, fed in with :meth:`shard_status`); the leader aggregates them per follower: a
follower is in sync when every stream (node and each shard) is.

The ISR: :meth:`set_isr` (the coordinator, from etcd) decides which followers confirms wait for;
the shards learn it through ``broadcast_isr`` (contract REPL_ISR). ``on_change`` is called when a
follower becomes in sync or falls out. Without a coordinator (``auto_isr=True``, the static
``--cluster`` mode) the ISR is simply every follower that is in sync.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from replication import handoff
from replication import protocol as p
from replication.sender import StreamSender

log = logging.getLogger("shardmq.replication")

HANDSHAKE_TIMEOUT_S = 10.0
# How long a follower's shard connection waits for that shard to take it (a shard restarting after
# a crash binds its handoff socket once it has recovered its queues); then it is closed and the
# follower starts a new session.
HANDOFF_WAIT_S = 30.0
# Between two handoff attempts while the shard is not up (doubling): a fallback only, the node's
# word that the shard is up (shard_up) makes the next attempt at once.
_HANDOFF_RETRY_S = 0.05
_HANDOFF_RETRY_MAX_S = 1.0


@dataclass
class FollowerStatus:
    name: str
    connected: bool
    in_sync: bool
    lag_bytes: int
    lag_seconds: float
    last_ack_monotonic: float


class ReplicationLeader:
    def __init__(self, config: Any, data_dir: Path | str, secret: bytes, *, shards: int, run_dir: str,
                 broadcast_isr: Callable[[set[str], int], None],
                 on_change: Callable[[], None] | None = None, auto_isr: bool = True) -> None:
        self.config = config
        self.data_dir = str(data_dir)
        self.secret = secret
        self.shards = shards
        self.run_dir = run_dir
        self.broadcast_isr = broadcast_isr
        self.on_change = on_change
        self.auto_isr = auto_isr
        self.name = config.node_name
        self.min_isr = int(config.min_isr)
        self.isr: set[str] = set()
        self.loop = asyncio.get_running_loop()
        # Seconds between heartbeats on an idle stream (0: off), announced in CHALLENGE.
        self.heartbeat = float(getattr(config, "replication_heartbeat", 0) or 0)
        self.node_sender = StreamSender(self.loop, self.data_dir, "node", lambda: None,
                                        ack_timeout=float(config.replication_ack_timeout),
                                        heartbeat=self.heartbeat,
                                        heartbeat_timeout=float(getattr(config, "replication_heartbeat_timeout", 0)),
                                        on_change=self._recompute)
        self._shard_status: dict[int, dict[str, list]] = {}
        self._in_sync: set[str] = set()
        self._lsock: socket.socket | None = None
        self._accept_task: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self.port = 0
        self.refused = 0  # connections refused at the handshake (tests, status)
        self._stopping = False
        self._known: set[str] = set()
        self._last_ack: dict[str, float] = {}
        # Per shard: set when the node reports that shard (re)started; handoffs waiting for it retry.
        self._shard_started: dict[int, asyncio.Event] = {}

    @property
    def streams(self) -> list[str]:
        return ["node"] + [f"shard-{i}" for i in range(self.shards)]

    # ------------------------------------------------------------ life
    async def start(self) -> None:
        c = self.config
        sock = socket.create_server((c.replication_bind, int(c.replication_port)), reuse_port=False)
        sock.setblocking(False)
        self._lsock = sock
        self.port = sock.getsockname()[1]
        self.set_isr(self.isr)  # the shards start from an explicit ISR (and min-isr)
        self._accept_task = self.loop.create_task(self._accept_loop())
        log.info("replication: leader %s listening on %s:%d (%d streams, min-isr %d)", self.name,
                 c.replication_bind, self.port, len(self.streams), self.min_isr)

    def keep_isr(self) -> None:
        """A stop has begun: from here on followers only go away because we stop, which must not
        shrink the ISR (a graceful stop of the leader would otherwise leave no follower that may take
        over, and the shards still stopping would confirm without the followers)."""
        self._stopping = True

    async def stop(self) -> None:
        self.keep_isr()
        if self._accept_task is not None:
            self._accept_task.cancel()
            await asyncio.gather(self._accept_task, return_exceptions=True)
        if self._lsock is not None:
            self._lsock.close()
            self._lsock = None
        for t in list(self._tasks):
            t.cancel()
        # The shards keep the ISR they have: they must never confirm without the followers because
        # the leader is going away (they are stopped or killed next).
        self.node_sender.close()

    # ------------------------------------------------------------ ISR and status
    def set_isr(self, names: set[str]) -> None:
        """The ISR as written in etcd: confirms wait for exactly these followers."""
        self.isr = set(names)
        self.node_sender.set_isr(self.isr, self.min_isr)
        self.broadcast_isr(self.isr, self.min_isr)

    def followers(self) -> dict[str, FollowerStatus]:
        node = self.node_sender.status()
        names = set(node)
        for st in self._shard_status.values():
            names.update(st)
        self._known |= names
        out = {}
        for name in self._known - names:  # seen before, gone now (ISR members stay visible)
            out[name] = FollowerStatus(name, False, False, 0, 0.0, self._last_ack.get(name, 0.0))
        for name in names:
            parts = [node.get(name)] + [self._shard_status.get(i, {}).get(name) for i in range(self.shards)]
            present = [x for x in parts if x is not None]
            out[name] = FollowerStatus(
                name=name,
                connected=node.get(name) is not None,
                in_sync=len(present) == len(parts) and all(x[1] for x in present),
                lag_bytes=sum(int(x[2]) for x in present),
                lag_seconds=max((float(x[3]) for x in present), default=0.0),
                last_ack_monotonic=min((float(x[4]) for x in present), default=0.0),
            )
            self._last_ack[name] = out[name].last_ack_monotonic
        return out

    def stream_status(self) -> dict[str, dict[str, dict]]:
        """Per stream and follower: connected, in_sync, lag_bytes, lag_seconds, last_ack_monotonic,
        acked (bytes of that stream acked since the follower's full sync began)."""
        keys = ("connected", "in_sync", "lag_bytes", "lag_seconds", "last_ack_monotonic", "acked")
        out = {"node": {n: dict(zip(keys, v, strict=False)) for n, v in self.node_sender.status().items()}}
        for i in range(self.shards):
            st = self._shard_status.get(i, {})
            out[f"shard-{i}"] = {n: dict(zip(keys, v, strict=False)) for n, v in st.items()}
        return out

    def shard_status(self, index: int, status: dict[str, list]) -> None:
        """A shard's REPL_STATUS."""
        self._shard_status[index] = status
        self._recompute()

    def shard_up(self, index: int) -> None:
        """The node's word that shard ``index`` has loaded its queues (and so listens for handoffs)."""
        self._shard_started.setdefault(index, asyncio.Event()).set()

    def shard_down(self, index: int) -> None:
        self._shard_status.pop(index, None)
        self._recompute()

    def _recompute(self) -> None:
        if self._stopping:
            return
        in_sync = {f.name for f in self.followers().values() if f.in_sync}
        if in_sync == self._in_sync:
            return
        joined, left = in_sync - self._in_sync, self._in_sync - in_sync
        self._in_sync = in_sync
        for name in sorted(joined):
            log.info("replication: follower %s is in sync", name)
        for name in sorted(left):
            log.warning("replication: follower %s is out of sync", name)
        if self.auto_isr:
            self.set_isr(in_sync)
        if self.on_change is not None:
            self.on_change()

    async def node_stream_replicated(self) -> bool:
        """Wait until every ISR follower acked the node stream up to now (False: fewer than min-isr)."""
        fut = self.loop.create_future()

        def done(ok: bool) -> None:
            if not fut.done():
                fut.set_result(ok)
        self.node_sender.when_replicated(self.node_sender.position(), done)
        return await fut

    # ------------------------------------------------------------ connections
    async def _accept_loop(self) -> None:
        while True:
            conn, addr = await self.loop.sock_accept(self._lsock)
            task = self.loop.create_task(self._handshake(conn, addr))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _recv_event(self, conn: socket.socket, dec: p.Decoder, pending: list) -> p.Event:
        while not pending:
            data = await self.loop.sock_recv(conn, 65536)
            if not data:
                raise ConnectionError("closed during handshake")
            pending.extend(dec.feed(data))
        return pending.pop(0)

    async def _handshake(self, conn: socket.socket, addr: Any) -> None:
        conn.setblocking(False)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        dec = p.Decoder()
        pending: list = []
        handed = False
        try:
            async with asyncio.timeout(HANDSHAKE_TIMEOUT_S):
                hello = await self._recv_event(conn, dec, pending)
            if not isinstance(hello, p.Hello):
                raise p.ProtocolError(f"expected HELLO, got {type(hello).__name__}")
            if hello.version != p.VERSION:
                await self._refuse(conn, addr, f"protocol version {hello.version} (leader speaks {p.VERSION})")
                return
            if hello.stream not in self.streams:
                await self._refuse(conn, addr, f"unknown stream {hello.stream!r}")
                return
            nonce_l = p.new_nonce()
            await self.loop.sock_sendall(conn, p.encode_challenge(
                nonce_l, p.leader_proof(self.secret, hello.stream, hello.nonce, nonce_l), self.heartbeat))
            try:
                async with asyncio.timeout(HANDSHAKE_TIMEOUT_S):
                    auth = await self._recv_event(conn, dec, pending)
            except ConnectionError:
                self.refused += 1
                log.warning("replication: follower %s at %s closed the handshake after our challenge "
                            "(does it have another cluster secret?)", hello.name, addr)
                return
            expected = p.follower_proof(self.secret, hello.stream, hello.name, nonce_l, hello.nonce)
            if not isinstance(auth, p.Auth) or not p.check_proof(expected, auth.proof):
                await self._refuse(conn, addr, "authentication failed", name=hello.name)
                return
            if pending or dec._buf:
                raise p.ProtocolError("data after AUTH before WELCOME")
            await self.loop.sock_sendall(conn, p.encode_welcome(self.streams, self.name))
            if hello.stream == "node":
                self.node_sender.attach_socket(conn, hello.name, hello.heartbeat)
                handed = True
            else:
                await self._hand_to_shard(int(hello.stream.partition("-")[2]), conn, hello.name, hello.heartbeat)
        except (OSError, p.ProtocolError, TimeoutError) as exc:
            log.warning("replication: connection from %s dropped during handshake: %s", addr, exc)
        finally:
            if not handed:
                conn.close()

    async def _hand_to_shard(self, index: int, conn: socket.socket, follower: str, heartbeat: float) -> None:
        """Pass ``conn`` to shard ``index``, waiting (up to HANDOFF_WAIT_S) for a shard that is not up.

        A follower reconnects as soon as a killed shard's stream ends, before the restarted shard
        has bound its handoff socket. Closing the connection then made the follower drop its whole
        session and start again (once it stayed out of sync for 30 s); waiting keeps the session,
        and the stream starts as soon as the shard is up.
        """
        started = self._shard_started.setdefault(index, asyncio.Event())
        deadline = self.loop.time() + HANDOFF_WAIT_S
        delay = _HANDOFF_RETRY_S
        while True:
            started.clear()  # before the attempt: a start reported after it wakes the wait below
            try:
                handoff.send_socket(self.run_dir, index, conn, follower, heartbeat)
                return
            except OSError as exc:
                remaining = deadline - self.loop.time()
                if remaining <= 0 or self._stopping:
                    log.warning("replication: cannot hand follower %s to shard %d: %s", follower, index, exc)
                    return
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(delay, remaining)):
                    await started.wait()
            delay = min(delay * 2, _HANDOFF_RETRY_MAX_S)

    async def _refuse(self, conn: socket.socket, addr: Any, reason: str, name: str = "?") -> None:
        self.refused += 1
        log.warning("replication: refused %s (follower %s): %s", addr, name, reason)
        try:
            await self.loop.sock_sendall(conn, p.encode_refused(reason))
        except OSError:
            pass
