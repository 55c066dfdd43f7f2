"""The WebSocket listeners of a frontend, with aiohttp imported on the first WebSocket connection.

WebSocket is on by default (``--ws-port`` 15675) but rarely used, and aiohttp costs a frontend
about 9 MB of RSS (a third of its size; measured in docs/benchmarks.md, "Memory"). So the frontend
listens on the WebSocket ports with plain asyncio servers whose first connections wait (reading
paused) while ``frontend.ws`` (aiohttp) is imported and its app set up; they are then handed to
aiohttp's request handler on the same transport, and every later connection goes to aiohttp
directly. A client sees nothing of this but the import time on its first connection.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from frontend.worker import FrontendWorker

log = logging.getLogger("shardmq.frontend")


class _Waiting(asyncio.Protocol):
    """A connection accepted before aiohttp is ready: paused until ``hand_over``."""

    def __init__(self, lazy: LazyWebSocket) -> None:
        self.lazy = lazy
        self.transport: Any = None
        self.lost = False

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        transport.pause_reading()
        self.lazy.wait(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True

    def hand_over(self, protocol: asyncio.Protocol) -> None:
        if self.lost or self.transport.is_closing():
            return
        self.transport.set_protocol(protocol)
        protocol.connection_made(self.transport)
        self.transport.resume_reading()


class LazyWebSocket:
    """Owns the WebSocket servers; ``shutdown``/``cleanup`` as an aiohttp ``AppRunner`` has them."""

    def __init__(self, worker: FrontendWorker) -> None:
        self.worker = worker
        self.servers: list[asyncio.AbstractServer] = []
        self.runner: Any = None  # aiohttp AppRunner, once a connection asked for it
        self._waiting: list[_Waiting] = []
        self._starting: asyncio.Task | None = None

    async def listen(self, bind: str, port: int, tls_port: int = 0, tls: ssl.SSLContext | None = None) -> None:
        loop = self.worker.loop
        if port:
            self.servers.append(await loop.create_server(self._protocol, host=bind, port=port, reuse_port=True,
                                                         backlog=1024))
        if tls is not None and tls_port:
            self.servers.append(await loop.create_server(self._protocol, host=bind, port=tls_port, reuse_port=True,
                                                         backlog=1024, ssl=tls))

    def _protocol(self) -> asyncio.Protocol:
        if self.runner is not None:
            return self.runner.server()  # aiohttp's RequestHandler, as its TCPSite would create
        return _Waiting(self)

    def wait(self, conn: _Waiting) -> None:
        self._waiting.append(conn)
        if self._starting is None:
            self._starting = self.worker.loop.create_task(self._start())

    async def _start(self) -> None:
        try:
            from aiohttp import web

            from frontend import ws

            runner = web.AppRunner(ws.make_app(self.worker), access_log=None, handle_signals=False)
            await runner.setup()
        except Exception:
            log.exception("frontend %d: WebSocket server failed to start", self.worker.index)
            for conn in self._waiting:
                if conn.transport is not None:
                    conn.transport.close()
            self._waiting = []
            self._starting = None
            return
        self.runner = runner
        waiting, self._waiting = self._waiting, []
        for conn in waiting:
            conn.hand_over(runner.server())

    async def shutdown(self) -> None:
        for server in self.servers:
            server.close()
        if self.runner is not None:
            await self.runner.shutdown()

    async def cleanup(self) -> None:
        for conn in self._waiting:
            if conn.transport is not None:
                conn.transport.close()
        self._waiting = []
        if self.runner is not None:
            await self.runner.cleanup()
