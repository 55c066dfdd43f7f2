"""The WebSocket listeners of a frontend, with aiohttp imported when the first connection comes.

WebSocket is on by default (``--ws-port`` 15675) but rarely used, and aiohttp costs a frontend
about 9 MB of RSS (a third of its size; docs/benchmarks.md, "Memory"). So the frontend binds and
listens on the WebSocket ports itself and only watches the listening sockets: the first time one
has a connection waiting, it imports ``frontend.ws`` (aiohttp), sets its app up and hands the
listening sockets to aiohttp (``SockSite``), which accepts that connection and every later one.
Nothing is accepted before aiohttp is ready, so no connection changes hands; a client only sees
the import time on the very first connection.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from typing import Any, Protocol

log = logging.getLogger("shardmq.frontend")


def _listening_socket(bind: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in bind else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)  # every frontend listens on the port
        sock.bind((bind, port))
        sock.listen(1024)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


class ListenerFrontend(Protocol):
    """What the listeners use of the frontend (frontend/worker.py FrontendWorker); the app is given
    the same object (frontend/ws.py make_app)."""

    settings: dict
    loop: asyncio.AbstractEventLoop


class LazyWebSocket:
    """Owns the WebSocket listening sockets; ``shutdown``/``cleanup`` as an aiohttp ``AppRunner`` has them."""

    def __init__(self, worker: ListenerFrontend) -> None:
        self.worker = worker
        self.runner: Any = None  # aiohttp AppRunner, once a connection came
        self._socks: list[tuple[socket.socket, ssl.SSLContext | None]] = []
        self._starting: asyncio.Task | None = None

    async def listen(self, bind: str, port: int, tls_port: int = 0, tls: ssl.SSLContext | None = None) -> None:
        if port:
            self._socks.append((_listening_socket(bind, port), None))
        if tls is not None and tls_port:
            self._socks.append((_listening_socket(bind, tls_port), tls))
        for sock, _ctx in self._socks:
            self.worker.loop.add_reader(sock.fileno(), self._connection_waiting)

    def _connection_waiting(self) -> None:
        self._stop_watching()
        if self._starting is None:
            self._starting = self.worker.loop.create_task(self._start())

    def _stop_watching(self) -> None:
        for sock, _ctx in self._socks:
            self.worker.loop.remove_reader(sock.fileno())

    async def _start(self) -> None:
        from aiohttp import web

        from frontend import ws

        runner = web.AppRunner(ws.make_app(self.worker), access_log=None, handle_signals=False)
        await runner.setup()
        for sock, ctx in self._socks:
            await web.SockSite(runner, sock, backlog=1024, ssl_context=ctx).start()
        self.runner = runner

    async def shutdown(self) -> None:
        if self.runner is not None:
            await self.runner.shutdown()

    async def cleanup(self) -> None:
        if self._starting is not None and not self._starting.done():
            self._starting.cancel()
        if self.runner is not None:
            await self.runner.cleanup()  # closes the sites' servers, and so the sockets
            return
        self._stop_watching()
        for sock, _ctx in self._socks:
            sock.close()
