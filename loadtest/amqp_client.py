"""Minimal blocking AMQP 0-9-1 client for the perf tool, over the project's sans-IO codec.

Only what a load generator needs: the client handshake (start-ok PLAIN, tune-ok, open,
channel.open), synchronous control RPCs (declare/bind/delete/qos/confirm/consume) and a raw
socket the hot loops write pre-encoded frames to and read deliveries from themselves.

Frames are split here and fed to ``FrameParser`` one at a time, so control RPCs stop exactly at
their reply: bytes after it (e.g. deliveries following consume-ok) stay in ``pending`` for a
hot loop to take over with ``take_pending()``.
"""

from __future__ import annotations

import socket
import struct
from collections import deque
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

from pamqp import commands

from broker.amqp import encoder, events
from broker.amqp.parser import FrameParser

_FRAME_HEAD = struct.Struct(">BHI")
CLIENT_PROPERTIES = {
    "product": "shardmq-perf",
    "capabilities": {
        "publisher_confirms": True,
        "consumer_cancel_notify": True,
        "basic.nack": True,
        "connection.blocked": False,
    },
}


class AMQPClosed(Exception):
    """The broker closed the connection or a channel (or the socket went away)."""

    def __init__(self, code: int, text: str, channel: int = 0) -> None:
        super().__init__(f"{'channel ' + str(channel) if channel else 'connection'} closed: {code} {text}")
        self.code = code
        self.text = text
        self.channel = channel


@dataclass(frozen=True)
class AMQPUri:
    host: str
    port: int
    user: str
    password: str
    vhost: str

    @classmethod
    def parse(cls, uri: str) -> AMQPUri:
        u = urlsplit(uri)
        if u.scheme not in ("amqp", ""):
            raise ValueError(f"unsupported scheme {u.scheme!r} (only amqp://)")
        path = u.path[1:] if u.path.startswith("/") else u.path
        return cls(
            host=u.hostname or "127.0.0.1",
            port=u.port or 5672,
            user=unquote(u.username) if u.username is not None else "guest",
            password=unquote(u.password) if u.password is not None else "guest",
            vhost=unquote(path) if path else "/",
        )


class AMQPClient:
    """One blocking connection; ``channel`` 1 is opened by ``connect()``."""

    def __init__(self, uri: str, *, timeout: float = 10.0, frame_max: int = 131072) -> None:
        self.uri = AMQPUri.parse(uri)
        self.timeout = timeout
        self.frame_max = frame_max
        self.channel_max = 2047
        self.server_properties: dict[str, Any] = {}
        self.sock: socket.socket | None = None
        self.pending = bytearray()
        self._parser = FrameParser(role="client")
        self._events: deque[Any] = deque()
        self._closed: AMQPClosed | None = None

    # -- connection ----------------------------------------------------------------------------

    def connect(self) -> AMQPClient:
        u = self.uri
        sock = socket.create_connection((u.host, u.port), timeout=self.timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        sock.sendall(encoder.encode_protocol_header())
        start = self._wait_method(0, commands.Connection.Start)
        self.server_properties = dict(start.server_properties or {})
        mechs = start.mechanisms.split() if isinstance(start.mechanisms, str) else []
        if mechs and "PLAIN" not in mechs:
            raise AMQPClosed(540, f"server offers no PLAIN mechanism: {start.mechanisms}")
        response = f"\0{u.user}\0{u.password}"
        self.send_method(0, commands.Connection.StartOk(
            client_properties=CLIENT_PROPERTIES, mechanism="PLAIN", response=response))
        tune = self._wait_method(0, commands.Connection.Tune)
        self.frame_max = min(x for x in (self.frame_max, tune.frame_max) if x) or self.frame_max
        self.channel_max = tune.channel_max or self.channel_max
        self._parser.frame_max = self.frame_max
        # heartbeat 0: a load generator must not spend its hot loop answering heartbeats
        self.send_method(0, commands.Connection.TuneOk(
            channel_max=self.channel_max, frame_max=self.frame_max, heartbeat=0))
        self.send_method(0, commands.Connection.Open(virtual_host=u.vhost))
        self._wait_method(0, commands.Connection.OpenOk)
        self.open_channel(1)
        return self

    def close(self, timeout: float = 2.0) -> None:
        """Polite connection.close, waiting up to ``timeout`` for close-ok, then the socket.

        A publisher must wait for close-ok: the broker answers it only after reading every
        publish before it, and closing the socket earlier can reset the connection and make the
        broker's kernel drop publishes it has not read yet.
        """
        if self.sock is None:
            return
        try:
            if self._closed is None:
                self.sock.settimeout(timeout)
                self.send_method(0, commands.Connection.Close(
                    reply_code=200, reply_text="bye", class_id=0, method_id=0))
                self._wait_method(0, commands.Connection.CloseOk)
        except (AMQPClosed, OSError):
            pass
        finally:
            self.sock.close()
            self.sock = None

    def __enter__(self) -> AMQPClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plumbing ------------------------------------------------------------------------------

    def send(self, data: bytes | bytearray | memoryview) -> None:
        assert self.sock is not None, "not connected"
        self.sock.sendall(data)

    def send_method(self, channel: int, method: Any) -> None:
        self.send(encoder.encode_method(channel, method))

    def take_pending(self) -> bytearray:
        """Bytes received but not yet parsed (a hot loop continues from them)."""
        data, self.pending = self.pending, bytearray()
        return data

    def _split_one_frame(self) -> bytes | None:
        buf = self.pending
        if len(buf) >= 8 and buf[:4] == b"AMQP":
            raise AMQPClosed(505, f"server refused protocol, answered {bytes(buf[:8])!r}")
        if len(buf) < 7:
            return None
        _, _, size = _FRAME_HEAD.unpack_from(buf, 0)
        end = 8 + size
        if len(buf) < end:
            return None
        frame = bytes(buf[:end])
        del buf[:end]
        return frame

    def next_event(self) -> Any:
        """The next parser event, reading from the socket as needed (timeout -> socket.timeout)."""
        while not self._events:
            frame = self._split_one_frame()
            if frame is None:
                assert self.sock is not None, "not connected"
                data = self.sock.recv(65536)
                if not data:
                    raise AMQPClosed(320, "socket closed by peer")
                self.pending += data
                continue
            for ev in self._parser.feed(frame):
                self._events.append(ev)
        return self._events.popleft()

    def _handle_close(self, ev: Any) -> None:
        """Raise on connection/channel close from the broker (answering close-ok first)."""
        if isinstance(ev, events.MethodFrame):
            m = ev.method
            if isinstance(m, commands.Connection.Close):
                try:
                    self.send_method(0, commands.Connection.CloseOk())
                except OSError:
                    pass
                self._closed = AMQPClosed(m.reply_code, m.reply_text)
                raise self._closed
            if isinstance(m, commands.Channel.Close):
                self.send_method(ev.channel, commands.Channel.CloseOk())
                raise AMQPClosed(m.reply_code, m.reply_text, ev.channel)
        elif isinstance(ev, events.ConnectionProtocolError):
            self._closed = AMQPClosed(ev.code, f"client-side codec error: {ev.text}")
            raise self._closed

    def _wait_method(self, channel: int, kind: type) -> Any:
        """Skip unrelated events until method ``kind`` arrives on ``channel``."""
        while True:
            ev = self.next_event()
            self._handle_close(ev)
            if isinstance(ev, events.MethodFrame) and ev.channel == channel and isinstance(ev.method, kind):
                return ev.method

    def rpc(self, method: Any, reply: type, channel: int = 1) -> Any:
        self.send_method(channel, method)
        return self._wait_method(channel, reply)

    # -- control methods -----------------------------------------------------------------------

    def open_channel(self, channel: int) -> None:
        self.rpc(commands.Channel.Open(), commands.Channel.OpenOk, channel)

    def queue_declare(self, queue: str, *, durable: bool = False, auto_delete: bool = False,
                      exclusive: bool = False, passive: bool = False,
                      arguments: dict[str, Any] | None = None, channel: int = 1) -> tuple[str, int, int]:
        ok = self.rpc(commands.Queue.Declare(queue=queue, durable=durable, auto_delete=auto_delete,
                                             exclusive=exclusive, passive=passive, arguments=arguments),
                      commands.Queue.DeclareOk, channel)
        return ok.queue, ok.message_count, ok.consumer_count

    def queue_exists(self, queue: str, channel: int = 1) -> bool:
        """Passive declare; a 404 closes the channel, which is reopened."""
        try:
            self.queue_declare(queue, passive=True, channel=channel)
            return True
        except AMQPClosed as exc:
            if exc.channel != channel or exc.code != 404:
                raise
            self.open_channel(channel)
            return False

    def queue_delete(self, queue: str, channel: int = 1) -> int:
        return self.rpc(commands.Queue.Delete(queue=queue), commands.Queue.DeleteOk, channel).message_count

    def queue_bind(self, queue: str, exchange: str, routing_key: str, channel: int = 1,
                   arguments: dict[str, Any] | None = None) -> None:
        self.rpc(commands.Queue.Bind(queue=queue, exchange=exchange, routing_key=routing_key,
                                     arguments=arguments), commands.Queue.BindOk, channel)

    def queue_unbind(self, queue: str, exchange: str, routing_key: str, channel: int = 1) -> None:
        self.rpc(commands.Queue.Unbind(queue=queue, exchange=exchange, routing_key=routing_key),
                 commands.Queue.UnbindOk, channel)

    def exchange_declare(self, exchange: str, exchange_type: str = "direct", *, durable: bool = False,
                         auto_delete: bool = False, channel: int = 1) -> None:
        self.rpc(commands.Exchange.Declare(exchange=exchange, exchange_type=exchange_type,
                                           durable=durable, auto_delete=auto_delete),
                 commands.Exchange.DeclareOk, channel)

    def exchange_delete(self, exchange: str, channel: int = 1) -> None:
        self.rpc(commands.Exchange.Delete(exchange=exchange), commands.Exchange.DeleteOk, channel)

    def basic_qos(self, prefetch_count: int, channel: int = 1) -> None:
        self.rpc(commands.Basic.Qos(prefetch_count=prefetch_count), commands.Basic.QosOk, channel)

    def confirm_select(self, channel: int = 1) -> None:
        self.rpc(commands.Confirm.Select(), commands.Confirm.SelectOk, channel)

    def basic_consume(self, queue: str, *, no_ack: bool, consumer_tag: str = "", channel: int = 1) -> str:
        ok = self.rpc(commands.Basic.Consume(queue=queue, no_ack=no_ack, consumer_tag=consumer_tag),
                      commands.Basic.ConsumeOk, channel)
        return ok.consumer_tag
