"""replication/protocol.py: round trips (hypothesis), split feeds, corrupted frames, the HMAC handshake."""

from __future__ import annotations

import struct
import zlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replication import protocol as p

SETTINGS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow], max_examples=200)

_segment = st.text(alphabet="abcdef0123456789.-_", min_size=1, max_size=12).filter(lambda s: s not in (".", ".."))
paths = st.lists(_segment, min_size=1, max_size=4).map("/".join)
data = st.binary(max_size=3000)
u64 = st.integers(0, 2**63 - 1)

events = st.one_of(
    st.builds(p.Hello, st.just(p.VERSION), st.text(max_size=20), st.text(max_size=20), st.binary(min_size=16, max_size=16),
              st.sampled_from([0.0, 0.25, 2.0])),
    st.builds(p.Challenge, st.just(p.VERSION), st.binary(max_size=16), st.binary(max_size=32),
              st.sampled_from([0.0, 0.25, 2.0])),
    st.builds(p.Auth, st.binary(max_size=32)),
    st.builds(p.Welcome, st.lists(st.text(max_size=10), max_size=5), st.text(max_size=10)),
    st.builds(p.Refused, st.text(max_size=40)),
    st.builds(p.FileList, st.lists(paths, max_size=5),
              st.lists(st.tuples(paths, st.integers(0, 2**40), st.integers(0, 2**32 - 1)), max_size=5)),
    st.builds(p.FileRequest, st.lists(paths, max_size=5)),
    st.builds(lambda path, off, d, gone: p.FileData(path, off, -1 if gone else off + len(d) + 3, b"" if gone else d),
              paths, st.integers(0, 2**40), data, st.booleans()),
    st.builds(p.SyncDone),
    st.builds(p.Append, paths, u64, data),
    st.builds(p.Replace, paths, data),
    st.builds(p.Delete, paths),
    st.builds(p.Ack, u64, st.booleans()),
    st.builds(p.Heartbeat),
)


def _same(a: p.Event, b: p.Event) -> bool:
    if isinstance(a, (p.Append, p.Replace, p.Delete)):
        b.size = 0  # the decoder reports the frame size; the encoder does not take it
        return a == b
    return a == b


@SETTINGS
@given(st.lists(events, max_size=8), st.integers(1, 64))
def test_roundtrip_any_split(evs, step):
    """Whatever the events and however the bytes are cut, the decoder returns exactly the events."""
    raw = b"".join(p.encode(e) for e in evs)
    dec = p.Decoder()
    out: list = []
    for i in range(0, len(raw), step):
        out.extend(dec.feed(raw[i:i + step]))
    assert len(out) == len(evs)
    assert all(_same(a, b) for a, b in zip(evs, out, strict=True))


@SETTINGS
@given(st.builds(p.Append, paths, u64, data))
def test_action_size_is_frame_length(ev):
    raw = p.encode(ev)
    (got,) = p.Decoder().feed(raw)
    assert got.size == len(raw)


@SETTINGS
@given(st.one_of(st.builds(p.Append, paths, u64, st.binary(min_size=1, max_size=500)),
                 st.builds(p.Replace, paths, st.binary(min_size=1, max_size=500))),
       st.data())
def test_flipped_data_byte_is_refused(ev, draw):
    """Any corrupted byte of an action's data is caught by its CRC32: never returned to be applied."""
    raw = bytearray(p.encode(ev))
    data_start = len(raw) - len(ev.data)
    i = draw.draw(st.integers(data_start, len(raw) - 1))
    raw[i] ^= draw.draw(st.integers(1, 255))
    with pytest.raises(p.CorruptAction) as info:
        p.Decoder().feed(bytes(raw))
    assert info.value.path == ev.path


def test_corrupt_file_chunk_is_refused():
    raw = bytearray(p.encode_file_data("a/msgs.0000000001", 0, 10, b"0123456789"))
    raw[-1] ^= 1
    with pytest.raises(p.CorruptAction):
        p.Decoder().feed(bytes(raw))


@pytest.mark.parametrize("frame", [
    struct.pack("<IB", 0, p.ACK),  # zero length
    struct.pack("<IB", p.MAX_FRAME + 1, p.APPEND),  # too long
    struct.pack("<IB", 3, 99) + b"xx",  # unknown kind
    struct.pack("<IB", 5, p.ACK) + b"abcd",  # short ack
    struct.pack("<IB", 3, p.HELLO) + b"\xc1\xc1",  # not msgpack
    struct.pack("<IB", 2, p.SYNC_DONE) + b"\x01",  # msgpack but not a map
    struct.pack("<IB", 2, p.HEARTBEAT) + b"\x00",  # a heartbeat has no payload
    p._control(p.HELLO, {"v": 1, "name": "n", "stream": "node", "nonce": b"x" * 16, "hb": -1.0}),
    p._control(p.CHALLENGE, {"v": 1, "nonce": b"x", "proof": b"y", "hb": "soon"}),
])
def test_malformed_frames(frame):
    with pytest.raises(p.ProtocolError):
        p.Decoder().feed(frame)


@pytest.mark.parametrize("path", ["/etc/passwd", "../x", "a/../../b", "a//b", "./a", ""])
def test_unsafe_paths_refused(path):
    raw = path.encode()
    payload = struct.pack("<H", len(raw)) + raw + struct.pack("<QI", 0, zlib.crc32(b"x")) + b"x"
    with pytest.raises(p.ProtocolError):
        p.Decoder().feed(struct.pack("<IB", len(payload) + 1, p.APPEND) + payload)


def test_partial_frame_waits():
    raw = p.encode_append("q/msgs.0000000001", 4, b"hello")
    dec = p.Decoder()
    assert dec.feed(raw[:-1]) == []
    (ev,) = dec.feed(raw[-1:])
    assert (ev.path, ev.offset, ev.data) == ("q/msgs.0000000001", 4, b"hello")


def test_handshake_proofs():
    secret, nf, nl = b"s3cret", p.new_nonce(), p.new_nonce()
    lp = p.leader_proof(secret, "shard-0", nf, nl)
    assert p.check_proof(p.leader_proof(secret, "shard-0", nf, nl), lp)
    assert not p.check_proof(p.leader_proof(b"other", "shard-0", nf, nl), lp)
    assert not p.check_proof(p.leader_proof(secret, "shard-1", nf, nl), lp)  # bound to the stream
    fp = p.follower_proof(secret, "shard-0", "n2", nl, nf)
    assert fp != lp  # the two directions never share a proof (no reflection)
    assert not p.check_proof(p.follower_proof(secret, "shard-0", "n3", nl, nf), fp)
    # the secret itself never appears in any handshake frame
    frames = (p.encode_hello("n2", "shard-0", nf) + p.encode_challenge(nl, lp) + p.encode_auth(fp))
    assert secret not in frames


def test_heartbeats_are_announced_only_when_on_and_the_version_stays_1():
    """A node with heartbeats off sends the handshake of a node that has none, byte for byte; with
    them on it adds only the "hb" key (an older node reads the keys it knows and ignores it), so a
    mixed-version cluster still shakes hands, without heartbeats on the older nodes' links."""
    import msgpack

    nonce = b"n" * 16
    off = msgpack.unpackb(p.encode_hello("n2", "node", nonce)[p.HEADER_SIZE:])
    assert off == {"v": 1, "name": "n2", "stream": "node", "nonce": nonce}
    on = msgpack.unpackb(p.encode_hello("n2", "node", nonce, 2.0)[p.HEADER_SIZE:])
    assert on == {**off, "hb": 2.0} and p.VERSION == 1
    challenge = msgpack.unpackb(p.encode_challenge(nonce, b"proof", 0.5)[p.HEADER_SIZE:])
    assert challenge == {"v": 1, "nonce": nonce, "proof": b"proof", "hb": 0.5}
    # What an older node sends decodes as "no heartbeats".
    (hello,) = p.Decoder().feed(p._control(p.HELLO, off))
    assert hello.heartbeat == 0.0
    assert p.encode_heartbeat() == struct.pack("<IB", 1, p.HEARTBEAT)


def test_heartbeat_frames_are_read_in_place_between_actions():
    buf = p.FrameBuffer(64)
    raw = p.encode_heartbeat() + p.encode_delete("q/x") + p.encode_heartbeat()
    buf.writable()[:len(raw)] = raw
    buf.received(len(raw))
    kinds = []
    while (fr := buf.next_frame()) is not None:
        kinds.append(fr[0])
        ev = buf.event(*fr)
        assert isinstance(ev, p.Heartbeat) == (fr[0] == p.HEARTBEAT)
    assert kinds == [p.HEARTBEAT, p.DELETE, p.HEARTBEAT] and p.HEARTBEAT not in p.ACTION_KINDS


@SETTINGS
@given(paths, u64, data)
def test_append_header_plus_data_is_the_frame(path, offset, d):
    assert p.append_header(path, offset, bytearray(d)) + d == p.encode_append(path, offset, d)


def _read_frames(raw: bytes, cuts: list[int], size: int) -> list:
    """Receive ``raw`` through a FrameBuffer as a socket would (into ``writable()``, cut at ``cuts``),
    APPEND frames in place, everything else as events: what the follower's receiver does."""
    fb = p.FrameBuffer(size)
    out: list = []
    pos = 0
    for cut in [*cuts, len(raw)]:
        while pos < cut:
            room = fb.writable()
            assert len(room) > 0
            n = min(len(room), cut - pos)
            room[:n] = raw[pos:pos + n]
            del room  # a socket drops the buffer it read into; the next writable() may move it
            fb.received(n)
            pos += n
            while (fr := fb.next_frame()) is not None:
                kind, start, end = fr
                if kind == p.APPEND:
                    path, offset, d = p.append_in_place(fb.view, start, end, {})
                    out.append(p.Append(path, offset, bytes(d), end - start + p.HEADER_SIZE))
                else:
                    out.append(fb.event(kind, start, end))
    assert fb.pending() == 0
    return out


@SETTINGS
@given(st.lists(events, max_size=8), st.lists(st.integers(0, 30000), max_size=6), st.sampled_from([64, 1000, 4096]))
def test_frame_buffer_in_place_matches_the_decoder(evs, cuts, size):
    """However the bytes arrive and however small the buffer (frames larger than it make it grow),
    frames read in place are exactly the events, APPEND sizes included."""
    raw = b"".join(p.encode(e) for e in evs)
    got = _read_frames(raw, sorted(c for c in cuts if c <= len(raw)), size)
    assert got == p.Decoder().feed(raw)


@SETTINGS
@given(st.builds(p.Append, paths, u64, st.binary(min_size=1, max_size=500)), st.data())
def test_frame_buffer_flipped_append_byte_is_refused(ev, draw):
    raw = bytearray(p.encode(ev))
    i = draw.draw(st.integers(len(raw) - len(ev.data), len(raw) - 1))
    raw[i] ^= draw.draw(st.integers(1, 255))
    with pytest.raises(p.CorruptAction) as info:
        _read_frames(bytes(raw), [], 4096)
    assert info.value.path == ev.path


@pytest.mark.parametrize("path", ["/etc/passwd", "../x", "a/../../b", "a//b", "./a", ""])
def test_frame_buffer_unsafe_append_paths_refused(path):
    raw = path.encode()
    payload = struct.pack("<H", len(raw)) + raw + struct.pack("<QI", 0, zlib.crc32(b"x")) + b"x"
    with pytest.raises(p.ProtocolError):
        _read_frames(struct.pack("<IB", len(payload) + 1, p.APPEND) + payload, [], 4096)


def test_frame_buffer_bad_length_and_short_append():
    with pytest.raises(p.ProtocolError):
        _read_frames(struct.pack("<IB", p.MAX_FRAME + 1, p.APPEND), [], 4096)
    with pytest.raises(p.ProtocolError):
        _read_frames(struct.pack("<IB", 4, p.APPEND) + struct.pack("<H", 0) + b"x", [], 4096)


def test_frame_buffer_reuses_its_memory():
    """Frames that fit are received into the same buffer every time (no new memory per read)."""
    fb = p.FrameBuffer(1 << 16)
    first = fb.buf
    frame = p.encode_append("q/msgs.0000000001", 0, b"x" * 3000)
    for _ in range(100):
        room = fb.writable()
        room[:len(frame)] = frame
        del room
        fb.received(len(frame))
        assert fb.next_frame() is not None
    assert fb.buf is first


@SETTINGS
@given(paths, u64, st.lists(st.binary(max_size=300), max_size=6))
def test_append_header_for_pieces_is_the_frame(path, offset, pieces):
    """A header made from the size and the CRC32 computed piece by piece, then the pieces: the frame."""
    crc = 0
    for piece in pieces:
        crc = zlib.crc32(piece, crc)
    whole = b"".join(pieces)
    assert p.append_header_for(path, offset, len(whole), crc) + whole == p.encode_append(path, offset, whole)
