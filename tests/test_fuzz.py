"""Hostile input on raw sockets against a real node: random bytes and mutated valid sessions.

After every example the node must still serve a fresh pika client (declare, publish, get),
no worker may have restarted, and nothing may have been logged as an internal error: bad
input is the client's problem (a protocol error and a closed socket), never the node's.
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

from tests.raw_amqp import PROTOCOL_HEADER, RawClient

# SHARDMQ_FUZZ_EXAMPLES=1000 for a longer hunt; the default keeps each test under ~20 s.
FUZZ_SETTINGS = settings(max_examples=int(os.environ.get("SHARDMQ_FUZZ_EXAMPLES", "60")), deadline=None, derandomize=False,
                         suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def _start_ok() -> bytes:
    response = b"\0guest\0guest"
    args = (b"\x00\x00\x00\x00" + b"\x05PLAIN" + struct.pack(">I", len(response)) + response + b"\x05en_US")
    payload = struct.pack(">HH", 10, 11) + args
    return struct.pack(">BHI", 1, 0, len(payload)) + payload + b"\xce"


def _session_frames() -> list[bytes]:
    """What a well-behaved client sends for connect, declare, publish, get, ack, close (pipelined)."""
    m = pframe.marshal
    body = b"fuzz body " * 30
    return [
        PROTOCOL_HEADER,
        _start_ok(),
        m(C.Connection.TuneOk(channel_max=0, frame_max=4096, heartbeat=0), 0),
        m(C.Connection.Open(virtual_host="/"), 0),
        m(C.Channel.Open(), 1),
        m(C.Queue.Declare(queue="fuzz-q", auto_delete=True), 1),
        m(C.Confirm.Select(), 1),
        m(C.Basic.Publish(exchange="", routing_key="fuzz-q"), 1),
        m(pheader.ContentHeader(0, len(body), C.Basic.Properties(delivery_mode=2, headers={"k": "v"})), 1),
        m(ContentBody(body[:100]), 1),
        m(ContentBody(body[100:]), 1),
        m(C.Basic.Qos(prefetch_count=5), 1),
        m(C.Basic.Get(queue="fuzz-q"), 1),
        m(C.Basic.Ack(delivery_tag=1), 1),
        m(C.Basic.Consume(queue="fuzz-q", consumer_tag="fz"), 1),
        m(C.Basic.Cancel(consumer_tag="fz"), 1),
        b"\x08\x00\x00\x00\x00\x00\x00\xce",
        m(C.Channel.Close(reply_code=200, reply_text="", class_id=0, method_id=0), 1),
        m(C.Connection.Close(reply_code=200, reply_text="", class_id=0, method_id=0), 0),
    ]


SESSION = _session_frames()


@st.composite
def mutated_sessions(draw) -> bytes:
    frames = list(SESSION)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "truncate", "duplicate", "drop", "swap", "insert", "resize"]))
        i = draw(st.integers(1, len(frames) - 1))  # keep the protocol header: get past it
        f = frames[i]
        if op == "flip" and f:
            pos = draw(st.integers(0, len(f) - 1))
            frames[i] = f[:pos] + bytes((draw(st.integers(0, 255)),)) + f[pos + 1:]
        elif op == "truncate":
            frames[i] = f[: draw(st.integers(0, max(0, len(f) - 1)))]
        elif op == "duplicate":
            frames.insert(i, f)
        elif op == "drop" and len(frames) > 2:
            del frames[i]
        elif op == "swap":
            j = draw(st.integers(1, len(frames) - 1))
            frames[i], frames[j] = frames[j], frames[i]
        elif op == "insert":
            frames.insert(i, draw(st.binary(min_size=1, max_size=64)))
        elif op == "resize" and len(f) >= 7:
            # lie about the payload size: shorter, longer, or absurd
            size = draw(st.sampled_from([0, 1, 4, 0xFFFF, 0x7FFFFFFF, 0xFFFFFFFF, len(f) - 6, len(f) - 9]))
            frames[i] = f[:3] + struct.pack(">I", max(0, size)) + f[7:]
    return b"".join(frames)


random_input = st.one_of(
    st.binary(max_size=2048),
    st.binary(max_size=2048).map(lambda b: PROTOCOL_HEADER + b),
    st.binary(max_size=2048).map(lambda b: b"".join(SESSION[:4]) + b),  # random frames after open
)


def _send_and_wait(port: int, data: bytes, splits: list[int]) -> None:
    """Send data in pieces, then read until the node closes or 0.25 s pass; never blocks longer."""
    raw = RawClient(port, timeout=2.0)
    try:
        pieces, last = [], 0
        for cut in sorted(set(s % (len(data) + 1) for s in splits)):
            pieces.append(data[last:cut])
            last = cut
        pieces.append(data[last:])
        for piece in pieces:
            if piece:
                try:
                    raw.send(piece)
                except (BrokenPipeError, ConnectionResetError):
                    return  # the node already closed on us: fine
        raw.read_until_eof(0.25)
    except (TimeoutError, ConnectionResetError):
        pass
    finally:
        raw.close()


class NodeWatch:
    """The invariants checked after every example."""

    def __init__(self, node) -> None:
        self.node = node
        self.pids = self._worker_pids()
        self.log_offset = len(node.log_text())
        self.n = 0

    def _worker_pids(self) -> dict:
        pids = self.node.pids()
        return {role: dict(pids[role]) for role in ("frontend", "shard")}

    def check(self) -> None:
        self.n += 1
        conn = self.node.connect(socket_timeout=5, blocked_connection_timeout=5)
        try:
            ch = conn.channel()
            q = ch.queue_declare(f"fuzz-check-{self.n}-{time.monotonic_ns()}", auto_delete=True).method.queue
            ch.basic_publish("", q, b"still alive")
            method, _props, body = ch.basic_get(q, auto_ack=True)
            assert method is not None and body == b"still alive"
        finally:
            conn.close()
        assert self._worker_pids() == self.pids, "a worker restarted while handling hostile input"
        new_log = self.node.log_text()[self.log_offset:]
        for bad in ("Traceback", "internal error", "INTERNAL_ERROR"):
            assert bad not in new_log, f"node logged {bad!r} for client input:\n{new_log[-3000:]}"


@pytest.fixture(scope="module")
def watch(shared_node):
    return NodeWatch(shared_node)


@FUZZ_SETTINGS
@given(data=random_input, splits=st.lists(st.integers(0, 4096), max_size=4))
def test_random_bytes_never_hurt_the_node(shared_node, watch, data, splits):
    _send_and_wait(shared_node.port, data, splits)
    watch.check()


@FUZZ_SETTINGS
@given(data=mutated_sessions(), splits=st.lists(st.integers(0, 4096), max_size=4))
def test_mutated_sessions_never_hurt_the_node(shared_node, watch, data, splits):
    _send_and_wait(shared_node.port, data, splits)
    watch.check()


def test_the_unmutated_session_is_valid(shared_node):
    """The fuzz corpus is a real session: without mutation the node answers every step."""
    raw = RawClient(shared_node.port)
    try:
        raw.send(b"".join(SESSION))
        raw.expect(C.Connection.Start)
        raw.expect(C.Connection.Tune)
        raw.expect(C.Connection.OpenOk)
        raw.expect(C.Channel.OpenOk)
        raw.expect(C.Queue.DeclareOk)
        raw.expect(C.Confirm.SelectOk)
        seen = []
        while True:
            got = raw.next_frame(5.0)
            assert got is not None, f"session stalled after {seen}"
            seen.append(type(got[1]).__name__)
            if isinstance(got[1], C.Connection.CloseOk):
                break
        for name in ("Ack", "QosOk", "GetOk", "ContentHeader", "ConsumeOk", "CancelOk", "CloseOk"):
            assert name in seen, (name, seen)
        assert raw.read_until_eof(5.0)
    finally:
        raw.close()


def test_many_parallel_garbage_connections(shared_node, watch):
    """Fifty sockets at once, each with a different kind of garbage, some left half-open."""
    socks = []
    try:
        for i in range(50):
            s = socket.create_connection(("127.0.0.1", shared_node.port), timeout=2.0)
            if i % 3 == 0:
                s.sendall(PROTOCOL_HEADER + bytes(range(i, i + 40)))
            elif i % 3 == 1:
                s.sendall(b"".join(SESSION[: 1 + i % len(SESSION)]))  # stops mid-session
            else:
                s.sendall(struct.pack(">BHI", 1, 0, 0xFFFFFFFF) * 3)  # before the header even
            socks.append(s)
        watch.check()
    finally:
        for s in socks:
            s.close()
    watch.check()
