"""PROXY protocol on the client listeners (``--proxy-protocol``): read the header, then hand the socket over.

``ProxyProtocolListener`` is the asyncio protocol of a new connection until the PROXY header is
read (broker/proxy_protocol.py); then the session the listener table names takes over the
transport (``set_protocol``), seeing the client's real address as ``peername``: nothing is in
the way of its reads and writes afterwards. On a TLS listener the TLS layer is put in between
after the header. A connection without a valid header is closed
(within HEADER_TIMEOUT at most).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from asyncio import sslproto
from collections.abc import Callable
from typing import Any

from broker.proxy_protocol import ProxyHeaderParser, ProxyProtocolError

log = logging.getLogger("shardmq.frontend")

HEADER_TIMEOUT = 5.0


class ProxiedTransport:
    """The real transport, but ``get_extra_info("peername")`` is the address from the PROXY header."""

    def __init__(self, transport: asyncio.Transport, peer: Any) -> None:
        self._transport = transport
        self._peer = peer

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "peername":
            return self._peer
        return self._transport.get_extra_info(name, default)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class ProxyProtocolListener(asyncio.Protocol):
    def __init__(self, session_factory: Callable[[], asyncio.Protocol], loop: asyncio.AbstractEventLoop,
                 tls: ssl.SSLContext | None = None) -> None:
        self._factory = session_factory
        self._loop = loop
        # On a TLS listener the header comes before the TLS handshake (haproxy passing TLS through):
        # TLS is layered on after it, so the listener itself is created without ssl.
        self._tls = tls
        self._parser = ProxyHeaderParser()
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        self._timer = self._loop.call_later(HEADER_TIMEOUT, transport.abort)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        transport = self._transport
        if transport is None:
            return
        try:
            found = self._parser.feed(data)
        except ProxyProtocolError as exc:
            log.warning("connection from %s refused: %s", transport.get_extra_info("peername"), exc)
            self._end()
            transport.abort()
            return
        if found is None:
            return
        header, rest = found
        self._end()
        peer = header.source or transport.get_extra_info("peername")
        session = self._factory()
        if self._tls is None:
            transport.set_protocol(session)
            session.connection_made(ProxiedTransport(transport, peer))  # type: ignore[arg-type]
            if rest:
                session.data_received(rest)
            return
        # asyncio's own TLS protocol, fed the bytes that followed the header (loop.start_tls cannot
        # take bytes already read); the session gets the TLS transport once the handshake is done.
        tls = sslproto.SSLProtocol(self._loop, session, self._tls, None, server_side=True)
        transport.set_protocol(tls)
        tls.connection_made(ProxiedTransport(transport, peer))  # type: ignore[arg-type]
        view = memoryview(rest)
        while view:
            buf = tls.get_buffer(len(view))
            n = min(len(buf), len(view))
            buf[:n] = view[:n]
            tls.buffer_updated(n)
            view = view[n:]

    def connection_lost(self, exc: Exception | None) -> None:
        self._end()

    def _end(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._transport = None if self._transport is None or self._transport.is_closing() else self._transport
