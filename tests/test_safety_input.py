"""Hostile input on raw sockets against a real node (issue #9, items 6 and 8).

- Before connection.open a frame on a non-zero channel is a connection error from its 7-byte
  header (nothing of it is buffered); after it, content for a channel that is not open is one too.
- Unfinished content is capped per connection (max_message_size in total over all channels).
- The spec-conforming channel.close-ok after a 406 for an oversized message keeps the connection.
- A hypothesis fuzz of content bombs asserts the frontend's RSS stays bounded.
"""

from __future__ import annotations

import os
import socket
import struct
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pamqp import commands as C
from pamqp import frame as pframe
from pamqp import header as pheader
from pamqp.body import ContentBody

from tests.raw_amqp import RawClient

MAX_MESSAGE = 100_000
BOMB_MAX_MESSAGE = 16 << 20


@pytest.fixture(scope="module")
def small_node(tmp_path_factory):
    from tests.harness import NodeFactory

    factory = NodeFactory(tmp_path_factory.mktemp("input_node"))
    try:
        yield factory(name="node", frontends=1, shards=1, extra_args=["--max-message-size", str(MAX_MESSAGE)])
    finally:
        factory.cleanup()


@pytest.fixture(scope="module")
def bomb_node(tmp_path_factory):
    """Messages up to 16 MiB are allowed: a bomb of declared sizes under that is not refused for its size."""
    from tests.harness import NodeFactory

    factory = NodeFactory(tmp_path_factory.mktemp("bomb_node"))
    try:
        yield factory(name="node", frontends=1, shards=1,
                      extra_args=["--max-message-size", str(BOMB_MAX_MESSAGE)])
    finally:
        factory.cleanup()


def _publish_head(channel: int, body_size: int, routing_key: str = "nowhere") -> bytes:
    return (pframe.marshal(C.Basic.Publish(exchange="", routing_key=routing_key), channel)
            + pframe.marshal(pheader.ContentHeader(0, body_size, C.Basic.Properties()), channel))


def _body(channel: int, data: bytes) -> bytes:
    return pframe.marshal(ContentBody(data), channel)


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


# ----------------------------------------------------------------------------- before open-ok

def test_channel_frame_before_open_is_refused_from_its_header(small_node):
    with RawClient(small_node.port) as c:
        c.send_header()
        c.expect(C.Connection.Start)
        # Only the 7-byte header of a 100 kB method frame on channel 1: refused before its payload.
        c.send(struct.pack(">BHI", 1, 1, 100_000))
        close = c.connection_close(timeout=5)
        assert close.reply_code == 505
        assert "channel 1 before connection.open" in close.reply_text
        assert c.read_until_eof(5)


def test_content_on_a_channel_that_is_not_open_is_a_connection_error(small_node):
    with RawClient(small_node.port) as c:
        c.handshake()
        c.send(pframe.marshal(C.Basic.Publish(exchange="", routing_key="q"), 5))  # no header follows
        close = c.connection_close(timeout=5)
        assert close.reply_code == 504
        assert "expected 'channel.open'" in close.reply_text
        assert (close.class_id, close.method_id) == (60, 40)


def test_memory_bomb_before_login_does_not_grow_the_frontend(bomb_node):
    pid = bomb_node.worker_pid("frontend", 0)
    before = _rss_kib(pid)
    socks = []
    try:
        for _ in range(4):
            s = socket.create_connection(("127.0.0.1", bomb_node.port), timeout=5)
            s.sendall(b"AMQP\x00\x00\x09\x01")
            socks.append(s)
        chunk = b"".join(_body(ch, b"b" * 131_000) for ch in (1, 2, 3, 4))
        heads = b"".join(_publish_head(ch, BOMB_MAX_MESSAGE - 1) for ch in (1, 2, 3, 4))
        for s in socks:
            try:
                s.sendall(heads)
                for _ in range(60):  # ~30 MiB per socket unless the node hangs up first
                    s.sendall(chunk)
            except OSError:
                pass  # refused and closed by the node: what we want
        grown = _rss_kib(pid) - before
        assert grown < 20 * 1024, f"frontend grew by {grown} KiB before any login"
    finally:
        for s in socks:
            s.close()


# ----------------------------------------------------------------------------- after open-ok

def test_unfinished_content_is_capped_per_connection(small_node):
    with RawClient(small_node.port) as c:
        c.handshake()
        for ch in (1, 2, 3):
            c.open_channel(ch)
        c.send_method(3, C.Queue.Declare(queue="", exclusive=True))
        queue = c.expect(C.Queue.DeclareOk, channel=3).queue
        # Two messages each within max size, together over it: the second channel gets the 406.
        c.send(_publish_head(1, 90_000, queue) + _body(1, b"a" * 60_000))
        c.send(_publish_head(2, 90_000, queue) + _body(2, b"b" * 60_000))
        close = c.expect(C.Channel.Close, channel=2)
        assert close.reply_code == 406
        assert "unfinished messages of this connection exceed" in close.reply_text
        c.send(_body(2, b"b" * 30_000))  # ignored: channel 2 is closing
        c.send_method(2, C.Channel.CloseOk())
        c.send(_body(1, b"a" * 30_000))  # channel 1's message completes and is stored
        c.send_method(3, C.Basic.Get(queue=queue, no_ack=True))
        c.expect(C.Basic.GetOk, channel=3)
        assert c.next_frame()[1].body_size == 90_000
        body = b""
        while len(body) < 90_000:
            body += c.next_frame()[1].value
        assert body == b"a" * 90_000
        c.open_channel(2)  # the connection lives on


def test_close_ok_after_oversized_message_keeps_the_connection(small_node):
    """Item 8: the client answers the 406 with close-ok while the parser still expected body frames."""
    with RawClient(small_node.port) as c:
        c.handshake()
        c.open_channel(1)
        c.open_channel(2)
        c.send_method(2, C.Queue.Declare(queue="", exclusive=True))
        queue = c.expect(C.Queue.DeclareOk, channel=2).queue
        c.send(_publish_head(1, MAX_MESSAGE + 1, queue) + _body(1, b"x" * 1000))
        close = c.expect(C.Channel.Close, channel=1)
        assert close.reply_code == 406
        assert f"message size {MAX_MESSAGE + 1} is larger than configured max size" in close.reply_text
        c.send(_body(1, b"x" * 1000))  # more of the body, sent before the client saw the close
        c.send_method(1, C.Channel.CloseOk())
        c.open_channel(1)  # was: connection.close 505 UNEXPECTED_FRAME
        c.send(_publish_head(1, 5, queue) + _body(1, b"after"))
        c.send_method(2, C.Basic.Get(queue=queue, no_ack=True))
        c.expect(C.Basic.GetOk, channel=2)
        _ch, body = c.next_frame()
        _ch, body = c.next_frame()
        assert body.value == b"after"


def test_close_ok_after_an_error_mid_content_keeps_the_connection(small_node):
    """A channel error raised while a message's body is still arriving: its rest is ignored."""
    with RawClient(small_node.port) as c:
        c.handshake()
        c.open_channel(1)
        c.send(pframe.marshal(C.Basic.Publish(exchange="no-such-exchange", routing_key="k"), 1)
               + pframe.marshal(pheader.ContentHeader(0, 10, C.Basic.Properties()), 1) + _body(1, b"12345"))
        c.send(_body(1, b"67890"))
        close = c.expect(C.Channel.Close, channel=1)
        assert close.reply_code == 404
        c.send(_publish_head(1, 50_000) + _body(1, b"y" * 100))  # in flight before the client saw the close
        c.send_method(1, C.Channel.CloseOk())
        c.open_channel(1)


# ----------------------------------------------------------------------------- fuzz with RSS

BOMB = st.lists(
    st.tuples(
        st.integers(1, 6),  # channel
        st.integers(1 << 20, BOMB_MAX_MESSAGE - 1),  # declared body size
        st.integers(0, 150),  # body frames of ~64 KiB actually sent
    ),
    min_size=1, max_size=6, unique_by=lambda t: t[0],
)


@settings(max_examples=int(os.environ.get("SHARDMQ_FUZZ_EXAMPLES", "25")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(login=st.booleans(), open_channels=st.booleans(), bomb=BOMB)
def test_fuzz_content_bombs_keep_frontend_rss_bounded(bomb_node, login, open_channels, bomb):
    """Sockets are kept open across examples, so memory held per connection adds up.

    Only a logged-in connection with open channels may hold unfinished content, at most
    max_message_size of it over all its channels; everything else must cost nothing.
    """
    state = _FUZZ_STATE
    pid = bomb_node.worker_pid("frontend", 0)
    if "base" not in state:
        state["base"] = _rss_kib(pid)
    s = socket.create_connection(("127.0.0.1", bomb_node.port), timeout=5)
    state["socks"].append(s)
    try:
        s.sendall(b"AMQP\x00\x00\x09\x01")
        if login:
            s.sendall(_login_frames())
            if open_channels:
                s.sendall(b"".join(pframe.marshal(C.Channel.Open(), ch) for ch in range(1, 7)))
        sent = 0
        for ch, size, frames in bomb:
            s.sendall(_publish_head(ch, size))
            body = _body(ch, b"z" * 65_000)
            for _ in range(min(frames, size // 65_000)):
                s.sendall(body)
                sent += 65_000
    except OSError:
        pass  # the node hung up on a protocol error
    if login and open_channels:
        state["may_hold"] += min(sent, BOMB_MAX_MESSAGE)
    # Plus slack for buffers and the allocator.
    allowed = 24 * 1024 + state["may_hold"] // 1024
    deadline = time.monotonic() + 2
    while (grown := _rss_kib(pid) - state["base"]) > allowed and time.monotonic() < deadline:
        time.sleep(0.05)
    assert grown <= allowed, f"frontend grew by {grown} KiB with {len(state['socks'])} sockets"


_FUZZ_STATE: dict = {"socks": [], "may_hold": 0}


@pytest.fixture(autouse=True, scope="module")
def _close_fuzz_sockets():
    yield
    for s in _FUZZ_STATE["socks"]:
        s.close()


def _login_frames() -> bytes:
    response = b"\0guest\0guest"
    args = (b"\x00\x00\x00\x00" + b"\x05PLAIN" + struct.pack(">I", len(response)) + response + b"\x05en_US")
    payload = struct.pack(">HH", 10, 11) + args
    start_ok = struct.pack(">BHI", 1, 0, len(payload)) + payload + b"\xce"
    return (start_ok + pframe.marshal(C.Connection.TuneOk(channel_max=0, frame_max=131072, heartbeat=0), 0)
            + pframe.marshal(C.Connection.Open(virtual_host="/"), 0))
