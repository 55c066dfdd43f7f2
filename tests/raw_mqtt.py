"""A raw MQTT 3.1.1 client over a socket for the error paths and exact QoS 2 steps (the broker's own codec
encodes and parses; tests/test_mqtt_codec.py checks the codec against paho's bytes)."""

from __future__ import annotations

import socket
import time

from broker.mqtt import codec as M


class RawMQTT:
    def __init__(self, port: int, host: str = "127.0.0.1") -> None:
        self.sock = socket.create_connection((host, port), timeout=5)
        self.parser = M.MQTTParser(server=False)
        self.packets: list = []

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def connect(self, client_id: str, clean: bool = True, keep_alive: int = 60, username: str | None = "guest",
                password: bytes | None = b"guest", will: M.Publish | None = None, **kw) -> M.ConnAck:
        self.send(M.encode_connect(client_id, clean, keep_alive, username, password, will, **kw))
        ack = self.recv()
        assert isinstance(ack, M.ConnAck), ack
        return ack

    def recv(self, timeout: float = 5.0):
        """The next packet; AssertionError when none comes in time or the server closed."""
        deadline = time.monotonic() + timeout
        while not self.packets:
            left = deadline - time.monotonic()
            assert left > 0, "no packet from the server in time"
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            assert data, "server closed the connection"
            self.packets.extend(self.parser.feed(data))
        return self.packets.pop(0)

    def closed_by_server(self, timeout: float = 5.0) -> bool:
        """True once the server closes the connection (packets before that are kept)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            except ConnectionResetError:
                return True
            if not data:
                return True
            self.packets.extend(self.parser.feed(data))
        return False

    def subscribe(self, pid: int, topics: list[tuple[str, int]]) -> list[int]:
        self.send(M.encode_subscribe(pid, topics))
        ack = self.recv()
        assert isinstance(ack, M.SubAck) and ack.packet_id == pid, ack
        return ack.codes

    def publish(self, topic: str, payload: bytes, qos: int = 0, pid: int = 0, retain: bool = False,
                dup: bool = False) -> None:
        self.send(M.encode_publish(topic.encode(), payload, qos, retain, dup, pid))

    def ack(self, ptype: int, pid: int) -> None:
        self.send(M.encode_ack(ptype, pid))

    def close(self) -> None:
        self.sock.close()

    def disconnect(self) -> None:
        self.send(bytes((M.DISCONNECT << 4, 0)))
        self.sock.close()
