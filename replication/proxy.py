"""A follower's client listeners: every connection is relayed byte for byte to the leader.

Clients behind a plain TCP load balancer thus reach the leader through any node. The proxy knows
nothing of AMQP or MQTT: it listens on the node's client ports (the same ``--bind``/``--port`` the
frontends use when this node leads, so only one of the two holds them at a time) and connects to
the same-named listener of the leader. When the leader changes every relayed connection is closed
(the client reconnects and reaches the new leader); connections that arrive while there is no
leader wait for one for a bounded time.

If the leader accepts the PROXY protocol (it says so in its etcd record), a version 2 header with
the client's address goes first, so the leader sees the real client; otherwise the bytes are plain.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import struct

from replication.coordination import NodeInfo

log = logging.getLogger("shardmq.proxy")

_CHUNK = 256 * 1024
_PP2_SIGNATURE = b"\r\n\r\n\x00\r\nQUIT\n"


def proxy_v2_header(src: tuple, dst: tuple) -> bytes:
    """PROXY protocol v2 header (PROXY command, TCP over IPv4 or IPv6) for a relayed connection."""
    try:
        s_ip, d_ip = ipaddress.ip_address(src[0]), ipaddress.ip_address(dst[0])
    except ValueError:
        return _PP2_SIGNATURE + b"\x20\x00\x00\x00"  # LOCAL: no address information
    if s_ip.version == 4 and d_ip.version == 4:
        body = s_ip.packed + d_ip.packed + struct.pack("!HH", src[1], dst[1])
        return _PP2_SIGNATURE + b"\x21\x11" + struct.pack("!H", len(body)) + body
    s6 = s_ip.packed if s_ip.version == 6 else ipaddress.IPv6Address("::ffff:" + str(s_ip)).packed
    d6 = d_ip.packed if d_ip.version == 6 else ipaddress.IPv6Address("::ffff:" + str(d_ip)).packed
    body = s6 + d6 + struct.pack("!HH", src[1], dst[1])
    return _PP2_SIGNATURE + b"\x21\x21" + struct.pack("!H", len(body)) + body


class ClientProxy:
    """Listeners ``{name: (bind, port)}`` relayed to the leader's listeners of the same name."""

    def __init__(self, listeners: dict[str, tuple[str, int]], wait_for_leader: float) -> None:
        self.listeners = {k: v for k, v in listeners.items() if v[1]}
        self.wait_for_leader = wait_for_leader
        self.target: NodeInfo | None = None
        self._target_set = asyncio.Event()
        self._servers: list[asyncio.Server] = []
        self._conns: set[asyncio.StreamWriter] = set()  # both ends of relayed connections
        self._waiting: set[asyncio.StreamWriter] = set()  # clients waiting for a leader
        self.relayed = 0  # connections relayed so far (status)

    @property
    def listening(self) -> bool:
        return bool(self._servers)

    async def start(self) -> None:
        if self._servers:
            return
        for name, (bind, port) in self.listeners.items():
            server = await asyncio.start_server(
                lambda r, w, name=name: self._relay(name, r, w), bind, port,
                reuse_address=True, reuse_port=True, backlog=1024)
            self._servers.append(server)
        log.info("proxying client ports %s to the leader",
                 ", ".join(f"{n} {b}:{p}" for n, (b, p) in self.listeners.items()))

    async def stop(self) -> None:
        """Stop listening (the frontends take the ports) and close every relayed connection."""
        servers, self._servers = self._servers, []
        for server in servers:
            server.close()
        self.close_all()
        for w in list(self._waiting):
            w.transport.abort()
        self._waiting.clear()
        for server in servers:
            with contextlib.suppress(Exception):
                await server.wait_closed()

    def set_target(self, leader: NodeInfo | None) -> None:
        """Relay new connections to ``leader``; a change closes the connections relayed so far."""
        if leader != self.target:
            if self._conns:
                log.info("leader changed (%s -> %s): closing %d relayed connections",
                         self.target and self.target.name, leader and leader.name, len(self._conns) // 2)
            self.close_all()
            self.target = leader
        if leader is None:
            self._target_set.clear()
        else:
            self._target_set.set()

    def close_all(self) -> None:
        for w in list(self._conns):
            w.transport.abort()
        self._conns.clear()

    async def _relay(self, name: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream: asyncio.StreamWriter | None = None
        try:
            if self.target is None:
                self._waiting.add(writer)
                try:
                    async with asyncio.timeout(self.wait_for_leader):
                        await self._target_set.wait()
                except TimeoutError:
                    return
                finally:
                    self._waiting.discard(writer)
            if not self._servers:
                return  # stopped while waiting
            target = self.target
            if target is None:
                return
            port = target.listeners.get(name) if name != "amqp" else target.amqp_port
            if not port:
                return
            self._conns.add(writer)
            up_reader, upstream = await asyncio.open_connection(target.host, port)
            self._conns.add(upstream)
            if target is not self.target or writer not in self._conns:
                return  # the leader changed while we connected
            sock = upstream.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            csock = writer.get_extra_info("socket")
            if csock is not None:
                csock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if target.proxy_protocol:
                upstream.write(proxy_v2_header(writer.get_extra_info("peername"),
                                               writer.get_extra_info("sockname")))
            self.relayed += 1
            await asyncio.gather(_pump(reader, upstream), _pump(up_reader, writer))
        except OSError as exc:
            log.debug("relay to the leader failed: %s", exc)
        finally:
            for w in (writer, upstream):
                if w is not None:
                    self._conns.discard(w)
                    w.transport.abort()


async def _pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    try:
        while data := await src.read(_CHUNK):
            dst.write(data)
            await dst.drain()
    except (OSError, asyncio.IncompleteReadError):
        pass
    finally:
        # Half-close would keep a dead leader's half open; close both ways as soon as one ends.
        dst.transport.abort()
