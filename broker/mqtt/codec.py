"""Sans-IO MQTT 3.1.1 codec: bytes in, packets out (``MQTTParser.feed``); packets in, bytes out (``encode_*``).

No sockets inside, in the manner of h11 and wsproto. The parser checks what the
standard calls malformed or a protocol violation at the packet level (fixed-header
flags, lengths, UTF-8 strings, QoS 3, DUP on QoS 0, packet identifier 0, empty
SUBSCRIBE/UNSUBSCRIBE) and raises ``MQTTProtocolError``: the server then closes
the network connection [MQTT-4.8.0-1]. What needs the session (CONNECT return
codes, topic validation, the order of packets) is checked by the state machine.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

CONNECT = 1
CONNACK = 2
PUBLISH = 3
PUBACK = 4
PUBREC = 5
PUBREL = 6
PUBCOMP = 7
SUBSCRIBE = 8
SUBACK = 9
UNSUBSCRIBE = 10
UNSUBACK = 11
PINGREQ = 12
PINGRESP = 13
DISCONNECT = 14

# CONNACK return codes (3.2.2.3)
ACCEPTED = 0
REFUSED_PROTOCOL_VERSION = 1
REFUSED_IDENTIFIER = 2
REFUSED_SERVER_UNAVAILABLE = 3
REFUSED_BAD_CREDENTIALS = 4
REFUSED_NOT_AUTHORIZED = 5

SUBACK_FAILURE = 0x80
MAX_REMAINING_LENGTH = 268_435_455

_U16 = struct.Struct(">H")
# Fixed-header flags every packet but PUBLISH must carry (2.2.2).
_REQUIRED_FLAGS = {CONNECT: 0, CONNACK: 0, PUBACK: 0, PUBREC: 0, PUBREL: 2, PUBCOMP: 0, SUBSCRIBE: 2,
                   SUBACK: 0, UNSUBSCRIBE: 2, UNSUBACK: 0, PINGREQ: 0, PINGRESP: 0, DISCONNECT: 0}


class MQTTProtocolError(Exception):
    """Malformed packet or protocol violation: close the network connection."""


@dataclass(slots=True)
class Connect:
    protocol_name: str
    protocol_level: int
    clean_session: bool
    keep_alive: int
    client_id: str
    will: Publish | None = None
    username: str | None = None
    password: bytes | None = None


@dataclass(slots=True)
class Publish:
    topic: str
    payload: bytes
    qos: int = 0
    retain: bool = False
    dup: bool = False
    packet_id: int = 0


@dataclass(slots=True)
class Ack:
    """PUBACK, PUBREC, PUBREL, PUBCOMP, UNSUBACK: a packet type and a packet identifier."""
    type: int
    packet_id: int


@dataclass(slots=True)
class Subscribe:
    packet_id: int
    topics: list[tuple[str, int]] = field(default_factory=list)  # (filter, requested QoS)


@dataclass(slots=True)
class Unsubscribe:
    packet_id: int
    topics: list[str] = field(default_factory=list)


@dataclass(slots=True)
class Simple:
    """PINGREQ, PINGRESP, DISCONNECT."""
    type: int


@dataclass(slots=True)
class ConnAck:
    session_present: bool
    return_code: int


@dataclass(slots=True)
class SubAck:
    packet_id: int
    codes: list[int]


Packet = Connect | Publish | Ack | Subscribe | Unsubscribe | Simple | ConnAck | SubAck


class _Reader:
    __slots__ = ("data", "pos", "end")

    def __init__(self, data: bytes | memoryview, pos: int, end: int) -> None:
        self.data = data
        self.pos = pos
        self.end = end

    def u8(self) -> int:
        if self.pos >= self.end:
            raise MQTTProtocolError("packet too short")
        v = self.data[self.pos]
        self.pos += 1
        return v

    def u16(self) -> int:
        if self.pos + 2 > self.end:
            raise MQTTProtocolError("packet too short")
        v = _U16.unpack_from(self.data, self.pos)[0]
        self.pos += 2
        return v

    def binary(self) -> bytes:
        n = self.u16()
        if self.pos + n > self.end:
            raise MQTTProtocolError("length field beyond the packet")
        v = bytes(self.data[self.pos:self.pos + n])
        self.pos += n
        return v

    def string(self) -> str:
        raw = self.binary()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise MQTTProtocolError("string is not well-formed UTF-8") from None  # [MQTT-1.5.3-1]
        if "\x00" in text:
            raise MQTTProtocolError("string contains U+0000")  # [MQTT-1.5.3-2]
        return text

    def rest(self) -> bytes:
        v = bytes(self.data[self.pos:self.end])
        self.pos = self.end
        return v

    @property
    def left(self) -> int:
        return self.end - self.pos


class MQTTParser:
    """Incremental parser of the packets a client sends (``server=True``) or a server sends."""

    def __init__(self, max_packet_size: int = MAX_REMAINING_LENGTH, server: bool = True) -> None:
        self.max_packet_size = max_packet_size
        self.server = server
        self._buf = bytearray()
        self._topics: dict[bytes, str] = {}  # topic bytes already checked and decoded (a client reuses a few)

    def feed(self, data: bytes) -> list[Packet]:
        """Packets completed by ``data``; MQTTProtocolError on the first bad one."""
        buf = self._buf
        buf += data
        out: list[Packet] = []
        pos = 0
        n = len(buf)
        view = memoryview(buf)
        try:
            while pos + 2 <= n:
                first = buf[pos]
                length = 0
                shift = 0
                i = pos + 1
                complete = False
                while i < n:
                    byte = buf[i]
                    i += 1
                    length |= (byte & 0x7F) << shift
                    if not byte & 0x80:
                        complete = True
                        break
                    shift += 7
                    if shift > 21:
                        raise MQTTProtocolError("remaining length longer than 4 bytes")
                if not complete:
                    break
                if length + (i - pos) > self.max_packet_size:
                    raise MQTTProtocolError(f"packet of {length} bytes exceeds the maximum packet size")
                if i + length > n:
                    break
                out.append(self._packet(first, view, i, i + length))
                pos = i + length
        finally:
            view.release()  # before the buffer is resized
            if pos:
                del buf[:pos]
        return out

    def _packet(self, first: int, data: memoryview, start: int, end: int) -> Packet:
        ptype = first >> 4
        flags = first & 0x0F
        if ptype == PUBLISH:
            return self._publish(data, start, end, flags)
        if first == 0x40 and end - start == 2:  # PUBACK, the other packet of the hot path
            return Ack(PUBACK, (data[start] << 8) | data[start + 1])
        r = _Reader(data, start, end)
        required = _REQUIRED_FLAGS.get(ptype)
        if required is None:
            raise MQTTProtocolError(f"reserved packet type {ptype}")
        if flags != required:
            raise MQTTProtocolError(f"invalid fixed-header flags {flags:#x} for packet type {ptype}")
        if ptype in (PUBACK, PUBREC, PUBREL, PUBCOMP, UNSUBACK):
            if r.left != 2:
                raise MQTTProtocolError("acknowledgement must have remaining length 2")
            return Ack(ptype, r.u16())
        if ptype in (PINGREQ, PINGRESP, DISCONNECT):
            if r.left:
                raise MQTTProtocolError("packet must have remaining length 0")
            return Simple(ptype)
        if self.server:
            if ptype == CONNECT:
                return _connect(r)
            if ptype == SUBSCRIBE:
                return _subscribe(r)
            if ptype == UNSUBSCRIBE:
                return _unsubscribe(r)
        else:
            if ptype == CONNACK:
                if r.left != 2:
                    raise MQTTProtocolError("CONNACK must have remaining length 2")
                return ConnAck(bool(r.u8() & 1), r.u8())
            if ptype == SUBACK:
                pid = r.u16()
                return SubAck(pid, list(r.rest()))
        raise MQTTProtocolError(f"packet type {ptype} may not be sent to a {'server' if self.server else 'client'}")


    def _publish(self, data: memoryview, start: int, end: int, flags: int) -> Publish:
        """PUBLISH, the hot path: read in place, the topic decoded and checked once per distinct topic."""
        qos = (flags >> 1) & 3
        if qos == 3:
            raise MQTTProtocolError("PUBLISH with QoS 3")  # [MQTT-3.3.1-4]
        dup = bool(flags & 8)
        if dup and qos == 0:
            raise MQTTProtocolError("DUP set on a QoS 0 PUBLISH")  # [MQTT-3.3.1-2]
        if start + 2 > end:
            raise MQTTProtocolError("packet too short")
        pos = start + 2 + ((data[start] << 8) | data[start + 1])
        if pos > end:
            raise MQTTProtocolError("length field beyond the packet")
        raw = bytes(data[start + 2:pos])
        topic = self._topics.get(raw)
        if topic is None:
            topic = _Reader(data, start, pos).string()  # UTF-8 and U+0000 rules [MQTT-1.5.3-1/2]
            if len(self._topics) >= 1000:
                self._topics.clear()
            self._topics[raw] = topic
        pid = 0
        if qos:
            if pos + 2 > end:
                raise MQTTProtocolError("packet too short")
            pid = (data[pos] << 8) | data[pos + 1]
            if pid == 0:
                raise MQTTProtocolError("packet identifier 0")  # [MQTT-2.3.1-1]
            pos += 2
        return Publish(topic, bytes(data[pos:end]), qos, bool(flags & 1), dup, pid)


def _connect(r: _Reader) -> Connect:
    name = r.string()
    level = r.u8()
    flags = r.u8()
    keep_alive = r.u16()
    if flags & 1:
        raise MQTTProtocolError("reserved connect flag set")  # [MQTT-3.1.2-3]
    will_flag = bool(flags & 0x04)
    will_qos = (flags >> 3) & 3
    will_retain = bool(flags & 0x20)
    if will_qos == 3:
        raise MQTTProtocolError("will QoS 3")  # [MQTT-3.1.2-14]
    if not will_flag and (will_qos or will_retain):
        raise MQTTProtocolError("will QoS/retain without the will flag")  # [MQTT-3.1.2-11/13/15]
    has_user = bool(flags & 0x80)
    has_password = bool(flags & 0x40)
    if has_password and not has_user:
        raise MQTTProtocolError("password flag without the user name flag")  # [MQTT-3.1.2-22]
    client_id = r.string()
    will = None
    if will_flag:
        topic = r.string()
        will = Publish(topic, r.binary(), will_qos, will_retain)
    username = r.string() if has_user else None
    password = r.binary() if has_password else None
    if r.left:
        raise MQTTProtocolError("bytes after the CONNECT payload")
    return Connect(name, level, bool(flags & 0x02), keep_alive, client_id, will, username, password)


def _subscribe(r: _Reader) -> Subscribe:
    pid = r.u16()
    if pid == 0:
        raise MQTTProtocolError("packet identifier 0")
    topics = []
    while r.left:
        topic = r.string()
        qos = r.u8()
        if qos & 0xFC:
            raise MQTTProtocolError("reserved bits of a requested QoS set")  # [MQTT-3.8.3-4]
        topics.append((topic, qos))
    if not topics:
        raise MQTTProtocolError("SUBSCRIBE without a topic filter")  # [MQTT-3.8.3-3]
    return Subscribe(pid, topics)


def _unsubscribe(r: _Reader) -> Unsubscribe:
    pid = r.u16()
    if pid == 0:
        raise MQTTProtocolError("packet identifier 0")
    topics = []
    while r.left:
        topics.append(r.string())
    if not topics:
        raise MQTTProtocolError("UNSUBSCRIBE without a topic filter")  # [MQTT-3.10.3-2]
    return Unsubscribe(pid, topics)


# ------------------------------------------------------------------ encoding
def _remaining(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def encode_connack(session_present: bool, return_code: int) -> bytes:
    return bytes((CONNACK << 4, 2, 1 if session_present else 0, return_code))


def encode_publish(topic: bytes, payload: bytes, qos: int = 0, retain: bool = False, dup: bool = False,
                   packet_id: int = 0) -> bytes:
    """``topic`` already UTF-8 encoded (deliveries encode it once per routing key)."""
    first = (PUBLISH << 4) | (8 if dup else 0) | (qos << 1) | (1 if retain else 0)
    head = _U16.pack(len(topic)) + topic
    if qos:
        head += _U16.pack(packet_id)
    n = len(head) + len(payload)
    if n < 128:  # the common small message: no varint loop
        return b"".join((bytes((first, n)), head, payload))
    return b"".join((bytes((first,)), _remaining(n), head, payload))


def publish_head(topic: bytes, payload_size: int, qos: int) -> bytes:
    """A QoS 1/2 PUBLISH (no DUP, no retain) up to its packet identifier: the packet is
    ``head + packet id (2 bytes) + payload``, so one head serves every subscriber of a message."""
    n = 2 + len(topic) + 2 + payload_size
    first = (PUBLISH << 4) | (qos << 1)
    return b"".join((bytes((first, n)) if n < 128 else bytes((first,)) + _remaining(n), _U16.pack(len(topic)), topic))


def encode_ack(ptype: int, packet_id: int) -> bytes:
    """PUBACK, PUBREC, PUBREL, PUBCOMP or UNSUBACK."""
    return bytes(((ptype << 4) | (2 if ptype == PUBREL else 0), 2, packet_id >> 8, packet_id & 0xFF))


def encode_suback(packet_id: int, codes: list[int]) -> bytes:
    return bytes((SUBACK << 4,)) + _remaining(2 + len(codes)) + _U16.pack(packet_id) + bytes(codes)


PINGRESP_BYTES = bytes((PINGRESP << 4, 0))


# Client-side encoders: used by the tests' raw clients and the load generator.
def _string(text: str) -> bytes:
    raw = text.encode("utf-8")
    return _U16.pack(len(raw)) + raw


def encode_connect(client_id: str, clean_session: bool = True, keep_alive: int = 60, username: str | None = None,
                   password: bytes | None = None, will: Publish | None = None, protocol_name: str = "MQTT",
                   protocol_level: int = 4, reserved: bool = False) -> bytes:
    flags = (0x02 if clean_session else 0) | (1 if reserved else 0)
    payload = _string(client_id)
    if will is not None:
        flags |= 0x04 | (will.qos << 3) | (0x20 if will.retain else 0)
        payload += _string(will.topic) + _U16.pack(len(will.payload)) + will.payload
    if username is not None:
        flags |= 0x80
        payload += _string(username)
    if password is not None:
        flags |= 0x40
        payload += _U16.pack(len(password)) + password
    var = _string(protocol_name) + bytes((protocol_level, flags)) + _U16.pack(keep_alive)
    return bytes((CONNECT << 4,)) + _remaining(len(var) + len(payload)) + var + payload


def encode_subscribe(packet_id: int, topics: list[tuple[str, int]]) -> bytes:
    body = _U16.pack(packet_id) + b"".join(_string(t) + bytes((q,)) for t, q in topics)
    return bytes(((SUBSCRIBE << 4) | 2,)) + _remaining(len(body)) + body


def encode_unsubscribe(packet_id: int, topics: list[str]) -> bytes:
    body = _U16.pack(packet_id) + b"".join(_string(t) for t in topics)
    return bytes(((UNSUBSCRIBE << 4) | 2,)) + _remaining(len(body)) + body
