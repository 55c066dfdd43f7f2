"""A raw-socket AMQP 0-9-1 client for tests that need bytes no client library will send.

Frames are encoded and decoded with pamqp (independent of the project's own codec), so a
test sees exactly what the node put on the wire. Every read is bounded by a deadline.
"""

from __future__ import annotations

import socket
import struct
import time
from typing import Any

from pamqp import commands as C
from pamqp import encode as pencode
from pamqp import frame as pframe
from pamqp import header as pheader
from pamqp.body import ContentBody
from pamqp.exceptions import UnmarshalingException
from pamqp.heartbeat import Heartbeat

PROTOCOL_HEADER = b"AMQP\x00\x00\x09\x01"
_FRAME_HDR = struct.Struct(">BHI")


class RawClient:
    """One TCP connection to 127.0.0.1:port; ``frames()`` returns what arrived, decoded by pamqp."""

    def __init__(self, port: int, timeout: float = 5.0, source: str | None = None) -> None:
        # source: a local address to bind the client side to (the destination is always 127.0.0.1)
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout,
                                             source_address=(source, 0) if source else None)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.timeout = timeout
        self.buf = b""
        self.eof = False
        self.frame_max = 131072

    def __enter__(self) -> RawClient:
        return self

    def __exit__(self, *_exc) -> None:
        self.close()

    # -------------------------------------------------------------- sending
    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def send_method(self, channel: int, method: Any) -> None:
        self.send(pframe.marshal(method, channel))

    def send_header(self) -> None:
        self.send(PROTOCOL_HEADER)

    def publish(self, channel: int, exchange: str, routing_key: str, body: bytes) -> None:
        self.send_method(channel, C.Basic.Publish(exchange=exchange, routing_key=routing_key))
        self.send(pframe.marshal(pheader.ContentHeader(0, len(body), C.Basic.Properties()), channel))
        step = self.frame_max - 8
        for i in range(0, len(body), step):
            self.send(pframe.marshal(ContentBody(body[i : i + step]), channel))

    def send_start_ok(self, mechanism: str = "PLAIN", response: bytes = b"\0guest\0guest") -> None:
        """connection.start-ok with a response of arbitrary bytes (pamqp wants str there)."""
        mech = mechanism.encode()
        args = (pencode.field_table({"product": "raw-test"}) + bytes((len(mech),)) + mech
                + struct.pack(">I", len(response)) + response + b"\x05en_US")
        self.send(frame(1, 0, method_payload(10, 11, args)))

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    # -------------------------------------------------------------- reading
    def _fill(self, deadline: float) -> bool:
        """Read more bytes; False on EOF/reset or when the deadline passes."""
        left = deadline - time.monotonic()
        if left <= 0 or self.eof:
            return False
        self.sock.settimeout(left)
        try:
            data = self.sock.recv(65536)
        except TimeoutError:
            return False
        except (ConnectionResetError, BrokenPipeError):
            data = b""
        if not data:
            self.eof = True
            return False
        self.buf += data
        return True

    def next_frame(self, timeout: float | None = None) -> tuple[int, Any] | None:
        """(channel, pamqp frame object) of the next frame, None on EOF or timeout."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while True:
            if self.buf.startswith(b"AMQP") and len(self.buf) >= 8:
                header, self.buf = self.buf[:8], self.buf[8:]
                return 0, header
            if len(self.buf) >= 7:
                size = _FRAME_HDR.unpack_from(self.buf)[2]
                if len(self.buf) >= size + 8:
                    try:
                        used, channel, value = pframe.unmarshal(self.buf)
                    except UnmarshalingException as exc:
                        raise AssertionError(f"node sent an undecodable frame: {self.buf[:64]!r}") from exc
                    self.buf = self.buf[used:]
                    return channel, value
            if not self._fill(deadline):
                return None

    def expect(self, cls: type, timeout: float | None = None, channel: int | None = None) -> Any:
        """Skip heartbeats; the next frame must be a ``cls`` (on ``channel`` when given)."""
        while True:
            got = self.next_frame(timeout)
            if got is None:
                raise AssertionError(f"expected {cls.__name__}, got {'EOF' if self.eof else 'timeout'}")
            ch, value = got
            if isinstance(value, Heartbeat):
                continue
            assert isinstance(value, cls), f"expected {cls.__name__}, got {value!r} on channel {ch}"
            if channel is not None:
                assert ch == channel, f"{cls.__name__} on channel {ch}, expected {channel}"
            return value

    def read_until_eof(self, timeout: float) -> bool:
        """Drain until the node closes the socket; True if it did within timeout."""
        deadline = time.monotonic() + timeout
        while not self.eof:
            self.buf = b""
            if not self._fill(deadline) and not self.eof:
                return False
        return True

    def connection_close(self, timeout: float | None = None, answer: bool = True) -> C.Connection.Close:
        """Wait for the node's connection.close (skipping anything before it), answer close-ok."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while True:
            got = self.next_frame(max(0.0, deadline - time.monotonic()))
            if got is None:
                raise AssertionError(f"expected connection.close, got {'EOF' if self.eof else 'timeout'}")
            ch, value = got
            if ch == 0 and isinstance(value, C.Connection.Close):
                if answer:
                    self.send_method(0, C.Connection.CloseOk())
                return value

    # ------------------------------------------------------------ handshake
    def handshake(self, *, user: str = "guest", password: str = "guest", vhost: str = "/",
                  frame_max: int = 131072, channel_max: int = 0, heartbeat: int = 0,
                  mechanism: str = "PLAIN", response: bytes | None = None) -> C.Connection.Start:
        """Header through open-ok; returns the node's connection.start."""
        self.send_header()
        start = self.expect(C.Connection.Start)
        if response is None:
            response = f"\0{user}\0{password}".encode()
        self.send_start_ok(mechanism, response)
        tune = self.expect(C.Connection.Tune)
        self.frame_max = frame_max
        self.send_method(0, C.Connection.TuneOk(channel_max=channel_max or tune.channel_max,
                                                frame_max=frame_max, heartbeat=heartbeat))
        self.send_method(0, C.Connection.Open(virtual_host=vhost))
        self.expect(C.Connection.OpenOk)
        return start

    def open_channel(self, channel: int = 1) -> None:
        self.send_method(channel, C.Channel.Open())
        self.expect(C.Channel.OpenOk, channel=channel)


def frame(ftype: int, channel: int, payload: bytes, end: int = 0xCE) -> bytes:
    """One frame with an arbitrary type, payload and end octet."""
    return _FRAME_HDR.pack(ftype, channel, len(payload)) + payload + bytes((end,))


def method_payload(class_id: int, method_id: int, args: bytes = b"") -> bytes:
    return struct.pack(">HH", class_id, method_id) + args


class FrameClient:
    """A minimal blocking AMQP 0-9-1 client on pamqp frames, already past connection.open-ok.

    Unlike ``RawClient`` it does the handshake itself and speaks in whole frames per channel;
    nothing hidden, nothing retried.
    """

    def __init__(self, port: int, timeout: float = 10.0, vhost: str = "/") -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.buf = bytearray()
        self.sock.sendall(b"AMQP\x00\x00\x09\x01")
        start = self.expect(0, C.Connection.Start)
        self.server_properties = start.server_properties
        self.send(0, C.Connection.StartOk(client_properties={"product": "raw-test"}, mechanism="PLAIN",
                                          response="\0guest\0guest", locale="en_US"))
        tune = self.expect(0, C.Connection.Tune)
        self.frame_max = tune.frame_max
        self.send(0, C.Connection.TuneOk(channel_max=tune.channel_max, frame_max=tune.frame_max, heartbeat=0))
        self.send(0, C.Connection.Open(virtual_host=vhost))
        self.expect(0, C.Connection.OpenOk)

    def send(self, channel: int, *frames) -> None:
        self.sock.sendall(b"".join(pframe.marshal(f, channel) for f in frames))

    def publish_frames(self, channel: int, exchange: str, routing_key: str, body: bytes,
                       props: C.Basic.Properties | None = None, mandatory: bool = False) -> bytes:
        return b"".join((
            pframe.marshal(C.Basic.Publish(exchange=exchange, routing_key=routing_key, mandatory=mandatory),
                           channel),
            pframe.marshal(pheader.ContentHeader(0, len(body), props or C.Basic.Properties()), channel),
            pframe.marshal(ContentBody(body), channel) if body else b"",
        ))

    def recv(self):
        """The next (channel, frame); heartbeats are skipped."""
        while True:
            if len(self.buf) >= 7:
                size = int.from_bytes(self.buf[3:7], "big")
                if len(self.buf) >= size + 8:
                    consumed, channel, frame = pframe.unmarshal(bytes(self.buf[: size + 8]))
                    del self.buf[:consumed]
                    if isinstance(frame, Heartbeat):
                        continue
                    return channel, frame
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("server closed the socket")
            self.buf += chunk

    def expect(self, channel: int, cls):
        got_channel, frame = self.recv()
        assert (got_channel, type(frame)) == (channel, cls), f"expected {cls.__name__} on {channel}: {frame}"
        return frame

    def open_channel(self, channel: int = 1) -> None:
        self.send(channel, C.Channel.Open())
        self.expect(channel, C.Channel.OpenOk)

    def close(self) -> None:
        try:
            self.send(0, C.Connection.Close(200, "bye", 0, 0))
            while not isinstance(self.recv()[1], C.Connection.CloseOk):
                pass
        except OSError:
            pass
        finally:
            self.sock.close()
