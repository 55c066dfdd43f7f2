"""The replication stream's wire format, sans-IO (bytes in -> events out; events in -> bytes out).

No sockets here: the leader's sender and the follower's receiver feed received bytes to a
:class:`Decoder` and write what the ``encode_*`` functions return. One TCP connection carries one
*stream* (``"node"`` or ``"shard-N"``) from one leader to one follower.

Frame: ``u32 LE length | u8 kind | payload`` (length counts kind + payload, at most
``MAX_FRAME``). Control payloads are msgpack maps; the hot frames (file data, actions, acks)
are packed by hand.

Handshake (HMAC-SHA256 over nonces with the shared secret, never the secret itself, both ways)::

    follower -> HELLO     {v, name, stream, nonce_f[, hb]}
    leader   -> CHALLENGE {v, nonce_l, proof_l = HMAC(secret, "leader"   | stream | nonce_f | nonce_l)[, hb]}
    follower -> AUTH      {proof_f = HMAC(secret, "follower" | stream | name | nonce_l | nonce_f)}
    leader   -> WELCOME   {streams: [...], leader: name}          (or REFUSED {reason}, then close)

The follower checks ``proof_l`` before it answers, so a fake leader learns nothing and cannot
feed it data; the leader checks ``proof_f``. Nonces are fresh per connection (no replay).

Full sync (leader -> follower unless noted)::

    FILE_LIST {dirs: [...], files: [[path, size, crc32], ...]}
    follower -> FILE_REQUEST {paths: [...]}      (what differs or is missing)
    FILE_DATA path, offset, total, crc32(chunk), chunk    (... until offset+len == total;
                                                            total = -1: the file is gone)
    SYNC_DONE {}

then actions, each with the CRC32 of its bytes, which the receiver checks before applying::

    APPEND  path, offset, crc32, data     (write data at offset; the file grows)
    REPLACE path, crc32, data             (tmp + rename)
    DELETE  path                          (a file or a whole directory)

and acks from the follower: ``ACK position, flags`` (flag 1: the full sync is applied) where position counts the bytes of every action
frame (header included) received since SYNC_DONE, acked once the follower has made them durable.

Heartbeats: ``hb`` in HELLO and CHALLENGE is the interval (seconds) at which that side sends
HEARTBEAT (an empty frame) when it has sent nothing else for that long, from the file list on. A
side sends HEARTBEAT only to a peer that announced ``hb`` > 0 too (an older peer does not know the
kind, and ignores the unknown ``hb`` key): version 1 without ``hb`` is version 1 as it was, so a
mixed-version cluster replicates as before, without heartbeats on the links of the older nodes.
Each side drops a heartbeating peer from which nothing arrived for its heartbeat timeout.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from dataclasses import dataclass

import msgpack

from broker.crc import crc32

VERSION = 1
MAX_FRAME = 64 << 20
CHUNK = 1 << 20  # file data chunk size during full sync
NONCE_SIZE = 16
RECV_BUFFER = 512 << 10  # a FrameBuffer's usual size (a sender flushes at 256 KiB)
_MIN_READ = 64 << 10  # FrameBuffer.writable offers at least this much

_HEADER = struct.Struct("<IB")
HEADER_SIZE = _HEADER.size
_U64 = struct.Struct("<Q")
_ACK = struct.Struct("<QB")  # position, flags
ACK_SYNCED = 1  # the follower has applied the full sync (SYNC_DONE) durably
_U16 = struct.Struct("<H")
_APPEND = struct.Struct("<QI")  # offset, crc32
_CRC = struct.Struct("<I")
_DATA = struct.Struct("<QqI")  # offset, total (-1 = gone), crc32

# kinds
HELLO = 1
CHALLENGE = 2
AUTH = 3
WELCOME = 4
REFUSED = 5
FILE_LIST = 10
FILE_REQUEST = 11
FILE_DATA = 12
SYNC_DONE = 13
APPEND = 20
REPLACE = 21
DELETE = 22
ACK = 30
HEARTBEAT = 31  # either way, empty: "still here" on an idle stream (only to a peer that announced hb)

ACTION_KINDS = frozenset((APPEND, REPLACE, DELETE))


class ProtocolError(Exception):
    """The peer sent something that is not a valid frame: drop the connection."""


class CorruptAction(ProtocolError):
    """An action's bytes do not match its CRC32: drop the connection, never apply it."""

    def __init__(self, path: str) -> None:
        super().__init__(f"CRC32 mismatch in an action on {path!r}")
        self.path = path


# ---------------------------------------------------------------- events
@dataclass(slots=True)
class Hello:
    version: int
    name: str
    stream: str
    nonce: bytes
    heartbeat: float = 0.0  # seconds between the follower's heartbeats (0: it sends none, knows none)


@dataclass(slots=True)
class Challenge:
    version: int
    nonce: bytes
    proof: bytes
    heartbeat: float = 0.0  # seconds between the leader's heartbeats (0: an older leader, or off)


@dataclass(slots=True)
class Auth:
    proof: bytes


@dataclass(slots=True)
class Welcome:
    streams: list[str]
    leader: str


@dataclass(slots=True)
class Refused:
    reason: str


@dataclass(slots=True)
class FileList:
    dirs: list[str]
    files: list[tuple[str, int, int]]  # (path, size, crc32)


@dataclass(slots=True)
class FileRequest:
    paths: list[str]


@dataclass(slots=True)
class FileData:
    path: str
    offset: int
    total: int  # -1: the leader does not have this file (any more)
    data: bytes


@dataclass(slots=True)
class SyncDone:
    pass


@dataclass(slots=True)
class Append:
    path: str
    offset: int
    data: bytes
    size: int = 0  # frame bytes (what the stream position counts)


@dataclass(slots=True)
class Replace:
    path: str
    data: bytes
    size: int = 0


@dataclass(slots=True)
class Delete:
    path: str
    size: int = 0


@dataclass(slots=True)
class Ack:
    position: int
    synced: bool = False


@dataclass(slots=True)
class Heartbeat:
    pass


Event = (Hello | Challenge | Auth | Welcome | Refused | FileList | FileRequest | FileData | SyncDone
         | Append | Replace | Delete | Ack | Heartbeat)


# ---------------------------------------------------------------- HMAC
def new_nonce() -> bytes:
    return os.urandom(NONCE_SIZE)


def leader_proof(secret: bytes, stream: str, nonce_f: bytes, nonce_l: bytes) -> bytes:
    return hmac.new(secret, b"leader\0" + stream.encode() + b"\0" + nonce_f + nonce_l, hashlib.sha256).digest()


def follower_proof(secret: bytes, stream: str, name: str, nonce_l: bytes, nonce_f: bytes) -> bytes:
    msg = b"follower\0" + stream.encode() + b"\0" + name.encode() + b"\0" + nonce_l + nonce_f
    return hmac.new(secret, msg, hashlib.sha256).digest()


def check_proof(expected: bytes, got: bytes) -> bool:
    return hmac.compare_digest(expected, got)


# ---------------------------------------------------------------- encoding
def _frame(kind: int, payload: bytes) -> bytes:
    if len(payload) + 1 > MAX_FRAME:
        raise ValueError(f"frame of {len(payload)} bytes is larger than {MAX_FRAME}")
    return _HEADER.pack(len(payload) + 1, kind) + payload


def _control(kind: int, value: dict) -> bytes:
    return _frame(kind, msgpack.packb(value, use_bin_type=True))


def _path(path: str) -> bytes:
    raw = path.encode()
    if len(raw) > 0xFFFF:
        raise ValueError("path too long")
    return _U16.pack(len(raw)) + raw


def _with_heartbeat(value: dict, heartbeat: float) -> dict:
    # Only when on: without it the frame is byte for byte what a node without heartbeats sends.
    if heartbeat > 0:
        value["hb"] = float(heartbeat)
    return value


def encode_hello(name: str, stream: str, nonce: bytes, heartbeat: float = 0.0) -> bytes:
    return _control(HELLO, _with_heartbeat({"v": VERSION, "name": name, "stream": stream, "nonce": nonce},
                                           heartbeat))


def encode_challenge(nonce: bytes, proof: bytes, heartbeat: float = 0.0) -> bytes:
    return _control(CHALLENGE, _with_heartbeat({"v": VERSION, "nonce": nonce, "proof": proof}, heartbeat))


def encode_auth(proof: bytes) -> bytes:
    return _control(AUTH, {"proof": proof})


def encode_welcome(streams: list[str], leader: str) -> bytes:
    return _control(WELCOME, {"streams": list(streams), "leader": leader})


def encode_refused(reason: str) -> bytes:
    return _control(REFUSED, {"reason": reason})


def encode_file_list(dirs: list[str], files: list[tuple[str, int, int]]) -> bytes:
    return _control(FILE_LIST, {"dirs": list(dirs), "files": [list(f) for f in files]})


def encode_file_request(paths: list[str]) -> bytes:
    return _control(FILE_REQUEST, {"paths": list(paths)})


def encode_file_data(path: str, offset: int, total: int, data: bytes) -> bytes:
    return _frame(FILE_DATA, _path(path) + _DATA.pack(offset, total, crc32(data)) + bytes(data))


def encode_sync_done() -> bytes:
    return _control(SYNC_DONE, {})


def encode_append(path: str, offset: int, data: bytes) -> bytes:
    return _frame(APPEND, _path(path) + _APPEND.pack(offset, crc32(data)) + bytes(data))


def append_header(path: str, offset: int, data: bytes | bytearray | memoryview) -> bytes:
    """The bytes of an APPEND frame before its data: ``append_header(...) + data == encode_append(...)``.
    Lets a sender join header and data once, without copying the data into a frame first."""
    return append_header_for(path, offset, len(data), crc32(data))


def append_header_for(path: str, offset: int, size: int, crc: int) -> bytes:
    """:func:`append_header` for ``size`` bytes of data whose CRC32 is ``crc`` (computed as the
    data came, in pieces: ``crc32(piece, crc)``)."""
    tail = _path(path) + _APPEND.pack(offset, crc)
    if len(tail) + size + 1 > MAX_FRAME:
        raise ValueError(f"frame of {size} bytes is larger than {MAX_FRAME}")
    return _HEADER.pack(len(tail) + size + 1, APPEND) + tail


def encode_replace(path: str, data: bytes) -> bytes:
    return _frame(REPLACE, _path(path) + _CRC.pack(crc32(data)) + bytes(data))


def encode_delete(path: str) -> bytes:
    return _frame(DELETE, _path(path))


def encode_ack(position: int, synced: bool = False) -> bytes:
    return _frame(ACK, _ACK.pack(position, ACK_SYNCED if synced else 0))


HEARTBEAT_FRAME = _frame(HEARTBEAT, b"")
_HEARTBEAT_EVENT = Heartbeat()


def encode_heartbeat() -> bytes:
    return HEARTBEAT_FRAME


# ---------------------------------------------------------------- decoding
class Decoder:
    """Feed received bytes with :meth:`feed`; it returns the complete events in order.

    Raises :class:`ProtocolError` on a malformed frame and :class:`CorruptAction` on an action or
    file chunk whose CRC32 does not match (nothing of that frame is returned: never apply it).
    """

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[Event]:
        buf = self._buf
        buf += data
        events: list[Event] = []
        pos = 0
        n = len(buf)
        while n - pos >= HEADER_SIZE:
            length, kind = _HEADER.unpack_from(buf, pos)
            if length < 1 or length > MAX_FRAME:
                raise ProtocolError(f"bad frame length {length}")
            end = pos + 4 + length
            if end > n:
                break
            payload = bytes(buf[pos + HEADER_SIZE:end])
            events.append(_decode(kind, payload, 4 + length))
            pos = end
        if pos:
            del buf[:pos]
        return events


class FrameBuffer:
    """A receive buffer reused for the life of a connection, frames read from it in place.

    The socket reads into :meth:`writable` (``asyncio.BufferedProtocol.get_buffer``), then
    :meth:`received`; :meth:`next_frame` returns where the next complete frame's payload lies.
    Unlike :class:`Decoder` nothing is copied per read or per frame, and the memory is the same
    pages every time: a fresh 256 KiB ``recv`` per read (asyncio's default) costs a follower page
    faults and an ``munmap`` for every batch it receives. A frame is valid until the next
    :meth:`writable` call (which may move the unconsumed tail to the front).
    """

    def __init__(self, size: int = RECV_BUFFER) -> None:
        self._size = size
        self.buf = bytearray(size)
        self.view = memoryview(self.buf)
        self.start = 0  # first unconsumed byte
        self.end = 0  # end of the received bytes
        self._need = 0  # the whole size of the incomplete frame at ``start`` (0: not known yet)

    def pending(self) -> int:
        """Received bytes not yet returned as frames."""
        return self.end - self.start

    def writable(self) -> memoryview:
        """Free space to receive into (never empty): room for at least the incomplete frame."""
        if self.start == self.end:
            self.start = self.end = 0
            if len(self.buf) > 4 * self._size and not self._need:  # a huge frame is behind us
                self._replace(self._size, 0)
        need = max(self._need, HEADER_SIZE)
        if len(self.buf) - self.end < _MIN_READ or self.start + need > len(self.buf):
            self._make_room(need)
        return self.view[self.end:]

    def _make_room(self, need: int) -> None:
        pending = self.end - self.start
        size = max(len(self.buf), need + _MIN_READ)
        if size > len(self.buf):
            self._replace(size, pending)
        elif self.start:
            # Through a copy: the tail may overlap the front, and slice assignment would memcpy.
            self.buf[:pending] = bytes(self.view[self.start:self.end])
            self.start, self.end = 0, pending

    def _replace(self, size: int, pending: int) -> None:
        new = bytearray(size)
        new[:pending] = self.view[self.start:self.end]
        self.buf, self.view = new, memoryview(new)
        self.start, self.end = 0, pending

    def received(self, n: int) -> None:
        self.end += n

    def next_frame(self) -> tuple[int, int, int] | None:
        """``(kind, payload_start, frame_end)`` of the next complete frame (consumed), or None.
        The frame's size on the wire is ``frame_end - payload_start + HEADER_SIZE``."""
        pos = self.start
        if self.end - pos < HEADER_SIZE:
            self._need = 0
            return None
        length, kind = _HEADER.unpack_from(self.buf, pos)
        if length < 1 or length > MAX_FRAME:
            raise ProtocolError(f"bad frame length {length}")
        end = pos + 4 + length
        if end > self.end:
            self._need = 4 + length
            return None
        self._need = 0
        self.start = end
        return kind, pos + HEADER_SIZE, end

    def event(self, kind: int, start: int, end: int) -> Event:
        """Decode a frame returned by :meth:`next_frame` into an event (a copy: the slow path)."""
        return _decode(kind, bytes(self.view[start:end]), end - start + HEADER_SIZE)


def append_in_place(view: memoryview, start: int, end: int,
                    paths: dict[bytes, str]) -> tuple[str, int, memoryview]:
    """``(path, offset, data)`` of the APPEND frame whose payload is ``view[start:end]``, its CRC32
    checked (:class:`CorruptAction` if it does not match: apply nothing). ``data`` is a slice of
    ``view``, not a copy. ``paths`` caches checked paths by their raw bytes (appends repeat them)."""
    if end - start < 2:
        raise ProtocolError("truncated path")
    at = start + 2 + _U16.unpack_from(view, start)[0]
    if end - at < _APPEND.size:
        raise ProtocolError("truncated frame")
    raw = bytes(view[start + 2:at])
    path = paths.get(raw)
    if path is None:
        try:
            path = raw.decode()
        except UnicodeDecodeError:
            raise ProtocolError("path is not UTF-8") from None
        check_path(path)
        if len(paths) >= 4096:
            paths.clear()
        paths[raw] = path
    offset, crc = _APPEND.unpack_from(view, at)
    data = view[at + _APPEND.size:end]
    if crc32(data) != crc:
        raise CorruptAction(path)
    return path, offset, data


def _control_map(payload: bytes) -> dict:
    try:
        value = msgpack.unpackb(payload, raw=False)
    except Exception as exc:
        raise ProtocolError(f"bad control payload: {exc}") from None
    if not isinstance(value, dict):
        raise ProtocolError("control payload is not a map")
    return value


def _heartbeat(m: dict) -> float:
    value = float(m.get("hb", 0.0))
    if not 0 <= value <= 86400:  # NaN fails too
        raise ProtocolError(f"bad heartbeat interval {value!r}")
    return value


def _split_path(payload: bytes, need: int) -> tuple[str, int]:
    if len(payload) < 2:
        raise ProtocolError("truncated path")
    plen = _U16.unpack_from(payload, 0)[0]
    end = 2 + plen
    if len(payload) < end + need:
        raise ProtocolError("truncated frame")
    try:
        path = payload[2:end].decode()
    except UnicodeDecodeError:
        raise ProtocolError("path is not UTF-8") from None
    check_path(path)
    return path, end


def check_path(path: str) -> None:
    """A replicated path is relative, normalized and stays inside the data dir."""
    if (not path or path.startswith("/") or "\0" in path
            or any(part in ("", ".", "..") for part in path.split("/"))):
        raise ProtocolError(f"unsafe path {path!r}")


def _decode(kind: int, payload: bytes, size: int) -> Event:
    try:
        if kind == APPEND:
            path, at = _split_path(payload, _APPEND.size)
            offset, crc = _APPEND.unpack_from(payload, at)
            data = payload[at + _APPEND.size:]
            if crc32(data) != crc:
                raise CorruptAction(path)
            return Append(path, offset, data, size)
        if kind == REPLACE:
            path, at = _split_path(payload, _CRC.size)
            crc = _CRC.unpack_from(payload, at)[0]
            data = payload[at + _CRC.size:]
            if crc32(data) != crc:
                raise CorruptAction(path)
            return Replace(path, data, size)
        if kind == DELETE:
            path, at = _split_path(payload, 0)
            if at != len(payload):
                raise ProtocolError("trailing bytes in DELETE")
            return Delete(path, size)
        if kind == ACK:
            if len(payload) != _ACK.size:
                raise ProtocolError("bad ACK")
            position, flags = _ACK.unpack(payload)
            return Ack(position, bool(flags & ACK_SYNCED))
        if kind == HEARTBEAT:
            if payload:
                raise ProtocolError("bad HEARTBEAT")
            return _HEARTBEAT_EVENT
        if kind == FILE_DATA:
            path, at = _split_path(payload, _DATA.size)
            offset, total, crc = _DATA.unpack_from(payload, at)
            data = payload[at + _DATA.size:]
            if crc32(data) != crc:
                raise CorruptAction(path)
            if total < -1 or (total >= 0 and offset + len(data) > total):
                raise ProtocolError("bad FILE_DATA bounds")
            return FileData(path, offset, total, data)
        m = _control_map(payload)
        if kind == HELLO:
            return Hello(int(m["v"]), str(m["name"]), str(m["stream"]), bytes(m["nonce"]), _heartbeat(m))
        if kind == CHALLENGE:
            return Challenge(int(m["v"]), bytes(m["nonce"]), bytes(m["proof"]), _heartbeat(m))
        if kind == AUTH:
            return Auth(bytes(m["proof"]))
        if kind == WELCOME:
            return Welcome([str(s) for s in m["streams"]], str(m["leader"]))
        if kind == REFUSED:
            return Refused(str(m["reason"]))
        if kind == FILE_LIST:
            files = [(str(p), int(s), int(c)) for p, s, c in m["files"]]
            for p, _s, _c in files:
                check_path(p)
            dirs = [str(d) for d in m["dirs"]]
            for d in dirs:
                check_path(d)
            return FileList(dirs, files)
        if kind == FILE_REQUEST:
            paths = [str(p) for p in m["paths"]]
            for p in paths:
                check_path(p)
            return FileRequest(paths)
        if kind == SYNC_DONE:
            return SyncDone()
    except ProtocolError:
        raise
    except (KeyError, TypeError, ValueError, struct.error) as exc:
        raise ProtocolError(f"bad frame of kind {kind}: {exc}") from None
    raise ProtocolError(f"unknown frame kind {kind}")


def encode(event: Event) -> bytes:
    """Bytes of any event (tests and tools; the sender calls the encode_* functions directly)."""
    if isinstance(event, Hello):
        return encode_hello(event.name, event.stream, event.nonce, event.heartbeat)
    if isinstance(event, Challenge):
        return encode_challenge(event.nonce, event.proof, event.heartbeat)
    if isinstance(event, Auth):
        return encode_auth(event.proof)
    if isinstance(event, Welcome):
        return encode_welcome(event.streams, event.leader)
    if isinstance(event, Refused):
        return encode_refused(event.reason)
    if isinstance(event, FileList):
        return encode_file_list(event.dirs, event.files)
    if isinstance(event, FileRequest):
        return encode_file_request(event.paths)
    if isinstance(event, FileData):
        return encode_file_data(event.path, event.offset, event.total, event.data)
    if isinstance(event, SyncDone):
        return encode_sync_done()
    if isinstance(event, Append):
        return encode_append(event.path, event.offset, event.data)
    if isinstance(event, Replace):
        return encode_replace(event.path, event.data)
    if isinstance(event, Delete):
        return encode_delete(event.path)
    if isinstance(event, Ack):
        return encode_ack(event.position, event.synced)
    if isinstance(event, Heartbeat):
        return encode_heartbeat()
    raise TypeError(f"not a replication event: {event!r}")

