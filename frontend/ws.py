"""MQTT and AMQP over WebSocket (``--ws-port``, 15675): aiohttp's WebSocket server in front of the same sessions.

Paths ``/ws`` (RabbitMQ web-mqtt's) and ``/amqp``; the subprotocol picks the protocol
(``mqtt``/``mqttv3.1`` or ``amqp``), else the path does (``/ws`` MQTT, ``/amqp`` AMQP). The session
is the class the listener table names for that protocol, unchanged: ``WSTransport`` gives it what an
asyncio transport gives (write, close, pause/resume reading, the peer address); each binary
WebSocket message is fed to ``data_received`` as it comes (the codecs are streaming, a message may
carry part of a packet or several). WebSocket is a browser path, not the high-rate one: a write
burst of a loop turn becomes one binary message sent by a task. The listeners are in
``frontend/ws_listener.py``, which imports this module (and aiohttp) on the first connection.

Write back-pressure is the TCP transports': past ``HIGH_WATER`` bytes written and waiting for the
WebSocket send (which waits while the socket's own buffer is over its limit: aiohttp drains it),
the session gets ``pause_writing()`` - it then returns no credit and takes back what its shards have
not spent (frontend/paused_credit.py), so they stop delivering - and once a send went out with at
most ``LOW_WATER`` waiting, ``resume_writing()``. A client that stops reading therefore costs the
frontend about the high-water mark, one send and the deliveries in flight when it paused, not its
consumers' credit windows nor everything published to it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

from aiohttp import WSMsgType, web

from frontend.listeners import load

log = logging.getLogger("shardmq.frontend")

SESSIONS = {"mqtt": "frontend.mqtt.connection:MQTTConnection", "amqp": "frontend.amqp.connection:AMQPConnection"}
SUBPROTOCOLS = {"mqtt": "mqtt", "mqttv3.1": "mqtt", "amqp": "amqp"}
PATHS = {"/ws": "mqtt", "/amqp": "amqp"}
# asyncio's defaults for a transport's write buffer.
HIGH_WATER = 64 << 10
LOW_WATER = 16 << 10


class WSTransport:
    """The asyncio-transport face of one WebSocket for a session."""

    def __init__(self, ws: web.WebSocketResponse, peer: Any, loop: asyncio.AbstractEventLoop,
                 socket_transport: asyncio.Transport | None = None) -> None:
        self._ws = ws
        self._peer = peer
        self._loop = loop
        self._socket = socket_transport  # the TCP connection under the WebSocket (its buffer counts too)
        self._pending: list[bytes] = []
        self._buffered = 0  # bytes in _pending
        self._protocol: Any = None  # the session: told pause_writing/resume_writing
        self._write_paused = False
        self._sending = False
        self._closing = False
        self.readable = asyncio.Event()
        self.readable.set()

    def set_protocol(self, protocol: Any) -> None:
        self._protocol = protocol

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "peername":
            return self._peer
        if name == "socket" and self._socket is not None:  # the TCP socket under it (its kernel send
            return self._socket.get_extra_info("socket", default)  # queue: frontend/paused_credit.py)
        return default

    def write(self, data: bytes) -> None:
        if self._closing:
            return
        self._pending.append(data)
        self._buffered += len(data)
        if self._buffered > HIGH_WATER and not self._write_paused and self._protocol is not None:
            # aiohttp's send is blocked on a full socket: what the session writes piles up here
            self._write_paused = True
            self._protocol.pause_writing()
        if not self._sending:
            self._sending = True
            self._loop.create_task(self._send())

    def writelines(self, chunks: list[bytes]) -> None:
        self.write(b"".join(chunks))

    def get_write_buffer_size(self) -> int:
        socket = self._socket
        return self._buffered + (socket.get_write_buffer_size() if socket is not None else 0)

    async def _send(self) -> None:
        try:
            while self._pending and not self._ws.closed:
                data = b"".join(self._pending)
                self._pending.clear()
                self._buffered = 0
                await self._ws.send_bytes(data)  # waits while the socket's buffer is over its limit
                if self._write_paused and self._buffered <= LOW_WATER:
                    self._write_paused = False
                    if not self._closing:
                        self._protocol.resume_writing()
        except (ConnectionError, RuntimeError):
            pass
        finally:
            self._sending = False
            if self._closing and not self._ws.closed:
                await self._ws.close()

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        if not self._sending:
            self._loop.create_task(self._ws.close())

    def abort(self) -> None:
        self._closing = True
        self._pending.clear()
        self._buffered = 0
        self._loop.create_task(self._ws.close())

    def drop(self) -> None:
        """Cut the TCP connection under the WebSocket at once, without a close frame: what the
        frontend process's death does (frontend/worker.py FrontendWorker.abort)."""
        self._closing = True
        self._pending.clear()
        self._buffered = 0
        if self._socket is not None:
            self._socket.abort()
        else:
            self.abort()

    def can_write_eof(self) -> bool:
        return False  # a WebSocket has no half-close: a lingering session closes on its timer or the client's close

    def write_eof(self) -> None:
        raise NotImplementedError("a WebSocket cannot half-close")

    def is_closing(self) -> bool:
        return self._closing or self._ws.closed

    def pause_reading(self) -> None:
        self.readable.clear()

    def resume_reading(self) -> None:
        self.readable.set()


class WSFrontend(Protocol):
    """What the app uses of the frontend (frontend/worker.py FrontendWorker); the sessions it makes
    are given the same object, as the TCP listeners give them."""

    settings: dict
    loop: asyncio.AbstractEventLoop


def make_app(worker: WSFrontend) -> web.Application:
    max_size = int(worker.settings.get("mqtt_max_packet_size", 134217728))

    async def handle(request: web.Request) -> web.StreamResponse:
        ws = web.WebSocketResponse(protocols=tuple(SUBPROTOCOLS), max_msg_size=max_size, autoping=True)
        await ws.prepare(request)
        protocol = SUBPROTOCOLS.get(ws.ws_protocol or "") or PATHS[request.path]
        transport = WSTransport(ws, request.transport.get_extra_info("peername") if request.transport else None,
                                worker.loop, request.transport)
        session = load(SESSIONS[protocol])(worker)
        transport.set_protocol(session)
        session.connection_made(transport)
        try:
            async for msg in ws:
                if msg.type == WSMsgType.BINARY:
                    await transport.readable.wait()
                    session.data_received(msg.data)
                elif msg.type == WSMsgType.TEXT:
                    log.info("websocket %s: text frame refused (binary frames only)", transport._peer)
                    break
                elif msg.type == WSMsgType.ERROR:
                    break
        finally:
            transport._closing = True
            session.connection_lost(None)
            if not ws.closed:
                await ws.close()
        return ws

    app = web.Application()
    for path in PATHS:
        app.router.add_get(path, handle)
    return app
