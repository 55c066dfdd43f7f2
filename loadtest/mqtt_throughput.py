"""``shardmq-perf mqtt throughput``: MQTT 3.1.1 publishers/subscribers, QoS 0 and 1, over raw sockets.

Packets are hand-encoded per the MQTT 3.1.1 spec (OASIS, 2014): CONNECT (clean session, keep-alive
0 so no PINGREQ is ever due), CONNACK, SUBSCRIBE/SUBACK, PUBLISH, PUBACK, DISCONNECT. Bodies use
the same stamp as the AMQP tool (monotonic ns, publisher << 48 | sequence), so latency and
--verify work the same way; every subscriber gets every message (topic fan-out), so --verify
checks each subscriber separately. The orchestration (processes, counters, results) is
ThroughputRun's.
"""

from __future__ import annotations

import argparse
import os
import socket
import struct
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

from loadtest.amqp_throughput import (
    _CONFIRMED,
    _CONSUMED,
    _PUBLISHED,
    _SEQ_MASK,
    _STAMP,
    _STATE,
    _STATE_READY,
    LATENCY_CAP,
    ThroughputOptions,
    ThroughputRun,
    VerifyReport,
    _Shared,
    wait_for_go,
)
from loadtest.results import RunResult

CONNECT, CONNACK, PUBLISH, PUBACK, SUBSCRIBE, SUBACK, DISCONNECT = 1, 2, 3, 4, 8, 9, 14
_U16 = struct.Struct(">H")
INFLIGHT = 1000  # QoS 1 publishes awaiting PUBACK per publisher (packet ids 1..65535)


class MQTTError(Exception):
    pass


def encode_varint(n: int) -> bytes:
    """Remaining Length: 7 bits per byte, continuation bit 0x80, at most 4 bytes (268,435,455)."""
    if not 0 <= n <= 268_435_455:
        raise ValueError("remaining length out of range")
    out = bytearray()
    while True:
        n, digit = divmod(n, 128)
        out.append(digit | (0x80 if n else 0))
        if not n:
            return bytes(out)


def decode_varint(buf: bytes | bytearray, pos: int) -> tuple[int, int] | None:
    """(value, position after it), or None if incomplete. MQTTError if longer than 4 bytes."""
    value = 0
    mult = 1
    for i in range(4):
        if pos + i >= len(buf):
            return None
        b = buf[pos + i]
        value += (b & 0x7F) * mult
        if not b & 0x80:
            return value, pos + i + 1
        mult *= 128
    raise MQTTError("malformed remaining length")


def _str(s: str) -> bytes:
    b = s.encode()
    return _U16.pack(len(b)) + b


def encode_connect(client_id: str, username: str | None = None, password: str | None = None,
                   keepalive: int = 0, clean: bool = True) -> bytes:
    flags = (0x02 if clean else 0) | (0x80 if username is not None else 0) | (0x40 if password is not None else 0)
    body = _str("MQTT") + bytes((4, flags)) + _U16.pack(keepalive) + _str(client_id)
    if username is not None:
        body += _str(username)
    if password is not None:
        body += _str(password)
    return bytes((CONNECT << 4,)) + encode_varint(len(body)) + body


def encode_publish(topic: str, payload: bytes, qos: int = 0, packet_id: int = 0, retain: bool = False) -> bytes:
    var = _str(topic) + (_U16.pack(packet_id) if qos else b"")
    return bytes(((PUBLISH << 4) | (qos << 1) | int(retain),)) + encode_varint(len(var) + len(payload)) + var + payload


def encode_subscribe(packet_id: int, topic: str, qos: int) -> bytes:
    body = _U16.pack(packet_id) + _str(topic) + bytes((qos,))
    return bytes(((SUBSCRIBE << 4) | 0x02,)) + encode_varint(len(body)) + body  # reserved flags 0010


def encode_puback(packet_id: int) -> bytes:
    return bytes((PUBACK << 4, 2)) + _U16.pack(packet_id)


DISCONNECT_PACKET = bytes((DISCONNECT << 4, 0))


def split_packets(buf: bytearray, pos: int, end: int) -> tuple[list[tuple[int, int, int]], int]:
    """Complete packets in buf[pos:end] as (first byte, payload start, payload end); new pos."""
    out = []
    while end - pos >= 2:
        r = decode_varint(buf, pos + 1)
        if r is None:
            break
        length, start = r
        if start + length > end:
            break
        out.append((buf[pos], start, start + length))
        pos = start + length
    return out, pos


@dataclass
class MQTTUri:
    host: str
    port: int
    user: str | None
    password: str | None

    @classmethod
    def parse(cls, uri: str) -> MQTTUri:
        u = urlsplit(uri)
        if u.scheme not in ("mqtt", "tcp", ""):
            raise ValueError(f"unsupported scheme {u.scheme!r} (only mqtt://)")
        return cls(u.hostname or "127.0.0.1", u.port or 1883,
                   unquote(u.username) if u.username is not None else None,
                   unquote(u.password) if u.password is not None else None)


class MQTTClient:
    """One blocking MQTT 3.1.1 connection: connect (CONNACK checked), subscribe, raw socket."""

    def __init__(self, uri: str, client_id: str, timeout: float = 10.0) -> None:
        self.uri = MQTTUri.parse(uri)
        self.client_id = client_id
        self.timeout = timeout
        self.sock: socket.socket | None = None
        self.buf = bytearray()

    def connect(self) -> MQTTClient:
        u = self.uri
        self.sock = socket.create_connection((u.host, u.port), timeout=self.timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.sendall(encode_connect(self.client_id, u.user, u.password))
        first, start, end = self.read_packet()
        if first >> 4 != CONNACK or end - start != 2:
            raise MQTTError(f"expected CONNACK, got packet type {first >> 4}")
        if self.buf[start + 1] != 0:
            raise MQTTError(f"connection refused, CONNACK return code {self.buf[start + 1]}")
        del self.buf[:end]
        return self

    def read_packet(self) -> tuple[int, int, int]:
        assert self.sock is not None
        while True:
            packets, _ = split_packets(self.buf, 0, len(self.buf))
            if packets:
                return packets[0]
            data = self.sock.recv(65536)
            if not data:
                raise MQTTError("connection closed by broker")
            self.buf += data

    def subscribe(self, topic: str, qos: int, packet_id: int = 1) -> None:
        assert self.sock is not None
        self.sock.sendall(encode_subscribe(packet_id, topic, qos))
        first, start, end = self.read_packet()
        if first >> 4 != SUBACK or _U16.unpack_from(self.buf, start)[0] != packet_id:
            raise MQTTError(f"expected SUBACK, got packet type {first >> 4}")
        if self.buf[start + 2] == 0x80:
            raise MQTTError(f"subscription to {topic!r} refused")
        del self.buf[:end]

    def close(self) -> None:
        if self.sock is None:
            return
        try:
            self.sock.sendall(DISCONNECT_PACKET)
        except OSError:
            pass
        self.sock.close()
        self.sock = None


@dataclass
class MQTTOptions(ThroughputOptions):
    qos: int = 0
    topic: str = "perf/test"


def _publisher(idx: int, base: int, o: MQTTOptions, sh: _Shared) -> dict[str, Any]:
    counters = sh.counters
    client = MQTTClient(o.uri, f"perf-pub-{os.getpid()}-{idx}").connect()
    try:
        sock = client.sock
        assert sock is not None
        marker = bytes(range(1, 17))[: min(16, o.size)]
        one = encode_publish(o.topic, marker + bytes(o.size - len(marker)), o.qos, 1)
        step = len(one)
        body_at = step - o.size if o.size >= 8 else -1
        pid_at = step - o.size - 2 if o.qos else -1  # the packet id sits right before the payload
        batch = max(1, min(1000, (1 << 20) // step))
        if o.qos:
            batch = min(batch, INFLIGHT)
        if o.rate:
            batch = min(batch, max(1, o.rate // 50))
        buf = bytearray(one * batch)
        view = memoryview(buf)
        counters[base + _STATE] = _STATE_READY
        if not wait_for_go(sh):
            return {"published": 0, "confirmed": 0, "nacked": 0, "t_last": 0}
        started = time.monotonic()
        seq = 0
        acked = 0
        limit = o.pmessages or (1 << 62)
        ident = idx << 48
        rbuf = bytearray()
        stop = sh.stop_pub
        t_last = time.monotonic_ns()

        def read_acks(block: bool) -> None:
            nonlocal acked, rbuf
            try:
                data = sock.recv(65536) if block else sock.recv(65536, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError, TimeoutError):
                return
            if not data:
                raise MQTTError("connection closed by broker")
            rbuf += data
            packets, pos = split_packets(rbuf, 0, len(rbuf))
            acked += sum(1 for first, _s, _e in packets if first >> 4 == PUBACK)
            del rbuf[:pos]

        while seq < limit and not stop.value:
            n = min(batch, limit - seq)
            if o.qos:
                while seq - acked >= INFLIGHT and not stop.value:
                    sock.settimeout(0.2)
                    read_acks(True)
                n = min(n, INFLIGHT - (seq - acked))
                if n <= 0:
                    break
            now = time.monotonic_ns()
            for i in range(n):
                off = i * step
                if body_at >= 0:
                    if o.size >= 16:
                        _STAMP.pack_into(buf, off + body_at, now, ident | (seq + i))
                    else:
                        struct.pack_into(">Q", buf, off + body_at, now)
                if pid_at >= 0:
                    _U16.pack_into(buf, off + pid_at, (seq + i) % 65535 + 1)
            sock.settimeout(None)
            sock.sendall(view[: n * step])
            seq += n
            t_last = time.monotonic_ns()
            counters[base + _PUBLISHED] = seq
            if o.qos:
                read_acks(False)
                counters[base + _CONFIRMED] = acked
            if o.rate:
                ahead = seq / o.rate - (time.monotonic() - started)
                if ahead > 0:
                    time.sleep(ahead)
        if o.qos:
            deadline = time.monotonic() + 10
            sock.settimeout(0.2)
            while acked < seq and time.monotonic() < deadline:
                read_acks(True)
            counters[base + _CONFIRMED] = acked
        return {"published": seq, "confirmed": acked, "nacked": 0, "t_last": t_last}
    finally:
        client.close()


def _consumer(idx: int, base: int, o: MQTTOptions, sh: _Shared) -> dict[str, Any]:
    counters = sh.counters
    client = MQTTClient(o.uri, f"perf-sub-{os.getpid()}-{idx}").connect()
    try:
        client.subscribe(o.topic, o.qos)
        sock = client.sock
        assert sock is not None
        sock.settimeout(0.1)
        buf = bytearray(client.buf)
        limit = o.cmessages or (1 << 62)
        consumed = 0
        lat_min, lat_max = 1 << 62, -1
        lats, times = array("q"), array("q")
        stride, skip = 1, 0
        seen: dict[int, bytearray] = {}
        dups = foreign = 0
        t_last = 0
        counters[base + _STATE] = _STATE_READY
        while consumed < limit and not sh.stop_con.value:
            try:
                data = sock.recv(1 << 20)
            except TimeoutError:
                data = None
            if data == b"":
                raise MQTTError("connection closed by broker")
            if data:
                buf += data
            now = time.monotonic_ns()
            go = sh.go.value
            packets, pos = split_packets(buf, 0, len(buf))
            acks = []
            for first, start, end in packets:
                if first >> 4 != PUBLISH:
                    continue
                qos = (first >> 1) & 3
                tlen = _U16.unpack_from(buf, start)[0]
                at = start + 2 + tlen
                if qos:
                    acks.append(encode_puback(_U16.unpack_from(buf, at)[0]))
                    at += 2
                consumed += 1
                if end - at >= 8:
                    if end - at >= 16:
                        ts, ident = _STAMP.unpack_from(buf, at)
                        if o.verify:
                            pub, seq = ident >> 48, ident & _SEQ_MASK
                            if pub == 0xFFFF:
                                foreign += 1
                            else:
                                bm = seen.setdefault(pub, bytearray(1 << 12))
                                if (seq >> 3) >= len(bm):
                                    bm.extend(bytes(max(len(bm), (seq >> 3) + 1 - len(bm))))
                                bit = 1 << (seq & 7)
                                if bm[seq >> 3] & bit:
                                    dups += 1
                                else:
                                    bm[seq >> 3] |= bit
                    else:
                        ts = struct.unpack_from(">Q", buf, at)[0]
                    lat = now - ts
                    lat_min, lat_max = min(lat_min, lat), max(lat_max, lat)
                    skip += 1
                    if skip >= stride:
                        skip = 0
                        lats.append(lat)
                        times.append(now - go if go else 0)
                        if len(lats) >= LATENCY_CAP:
                            lats, times, stride = lats[::2], times[::2], stride * 2
                if consumed >= limit:
                    break
            del buf[:pos]
            if acks:
                sock.sendall(b"".join(acks))
            if packets:
                counters[base + _CONSUMED] = consumed
                t_last = now
        return {"consumed": consumed, "t_last": t_last, "lat_min": lat_min if lat_max >= 0 else None,
                "lat_max": lat_max if lat_max >= 0 else None, "lats": lats.tobytes(), "times": times.tobytes(),
                "stride": stride, "seen": {k: bytes(v) for k, v in seen.items()}, "dups": dups, "foreign": foreign}
    finally:
        client.close()


class MQTTThroughputRun(ThroughputRun):
    """ThroughputRun with MQTT workers; nothing is declared, so nothing is cleaned up."""

    def __init__(self, opts: MQTTOptions, **kw: Any) -> None:
        if opts.qos not in (0, 1):
            raise ValueError("--qos must be 0 or 1")
        super().__init__(opts, **kw)
        self.publisher_fn = _publisher
        self.consumer_fn = _consumer
        self.fanout = True

    def run(self) -> RunResult:
        return self._measure()


def run(args: argparse.Namespace, *, broker: str, scenario: str,
        broker_rss: Callable[[], int | None],
        progress: Callable[[dict[str, Any]], None] | None = None) -> tuple[RunResult, VerifyReport | None, list[str]]:
    opts = MQTTOptions(uri=args.uri, publishers=args.publishers, consumers=args.consumers, size=args.size,
                       rate=args.rate, pmessages=args.pmessages, cmessages=args.cmessages,
                       time_s=args.time_s, verify=args.verify, qos=args.qos, topic=args.topic)
    r = MQTTThroughputRun(opts, broker=broker, scenario=scenario, broker_rss=broker_rss, progress=progress)
    result = r.run()
    return result, r.verify, r.errors
