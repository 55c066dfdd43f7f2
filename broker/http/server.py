"""Build and run the node's aiohttp application (routes registered per module)."""

from __future__ import annotations

import importlib
import logging
import ssl
from typing import Any

from aiohttp import web

log = logging.getLogger("shardmq.http")

NODE_KEY: web.AppKey[Any] = web.AppKey("node", Any)

# Modules that register routes, in order. Each has ``register(app, node)``.
ROUTE_MODULES: tuple[str, ...] = (
    "broker.http.health",
    "broker.http.management",
    "broker.http.resources",
    "broker.http.policies_api",
    "broker.http.definitions_api",
    "broker.http.ui",
    "broker.http.cluster",
)


def make_app(node: Any) -> web.Application:
    """The node's HTTP application with every route module registered."""
    app = web.Application()
    app[NODE_KEY] = node
    for name in ROUTE_MODULES:
        importlib.import_module(name).register(app, node)
    return app


class HttpServer:
    """The HTTP listener of one node; ``port`` 0 in the settings means no listener."""

    def __init__(self, node: Any, bind: str, port: int, tls_port: int = 0, tls: ssl.SSLContext | None = None) -> None:
        self.node = node
        self.bind = bind
        self.port = port
        self.tls_port = tls_port if tls is not None else 0  # HTTPS: the same app over broker/tls.py's context
        self.tls = tls
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        if not self.port and not self.tls_port:
            return
        self._runner = web.AppRunner(make_app(self.node), access_log=None, handle_signals=False)
        await self._runner.setup()
        if self.port:
            site = web.TCPSite(self._runner, self.bind, self.port, reuse_address=True)
            await site.start()
            log.info("HTTP (management, health) on %s:%d", self.bind, self.port)
        if self.tls_port:
            site = web.TCPSite(self._runner, self.bind, self.tls_port, reuse_address=True, ssl_context=self.tls)
            await site.start()
            log.info("HTTPS (management, health) on %s:%d", self.bind, self.tls_port)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
