"""A frontend handles a read's events for about 1 ms per loop turn and leaves the rest, in order,
for the next turns (frontend/amqp/connection.py DISPATCH_TURN_S): a client pipelining hundreds of
queue.delete in one write no longer holds the frontend for one long turn. The test-only
SHARDMQ_TEST_DISPATCH_TURN_US=0 makes every read of more than 8 methods go over several turns, so
these tests fail if the events left for later are lost, reordered or handled before those read first."""

from __future__ import annotations

import threading
import time

import pytest
from pamqp import commands

from broker.amqp import encoder, events
from loadtest.amqp_client import AMQPClient

pytestmark = pytest.mark.integration

N = 300


def _encode(method, channel: int = 1) -> bytes:
    return encoder.encode_method(channel, method)


def _connect(node) -> AMQPClient:
    c = AMQPClient(node.url.rstrip("/") + "/%2F", timeout=10).connect()
    return c


def _replies(c: AMQPClient, n: int) -> list:
    """The next n methods on channel 1 (any kind), in the order they came."""
    out = []
    while len(out) < n:
        ev = c.next_event()
        c._handle_close(ev)
        if isinstance(ev, events.MethodFrame) and ev.channel == 1:
            out.append(ev.method)
    return out


@pytest.fixture
def deferring_node(node_factory):
    return node_factory(name="node", frontends=1, shards=2, env={"SHARDMQ_TEST_DISPATCH_TURN_US": "0"})


def test_pipelined_methods_in_one_write_are_answered_in_order_with_publishes_between(deferring_node):
    names = [f"dt-{i:03d}" for i in range(N)]
    with _connect(deferring_node) as c:
        props = b"\x00\x00"
        # One write: N declares, a publish to the last queue declared, a passive declare of it.
        c.send(b"".join(_encode(commands.Queue.Declare(queue=q)) for q in names)
               + encoder.encode_publish(1, "", names[-1], False, props, b"after-declares", c.frame_max)
               + _encode(commands.Queue.Declare(queue=names[-1], passive=True)))
        got = _replies(c, N + 1)
        assert [type(m) for m in got] == [commands.Queue.DeclareOk] * (N + 1)
        assert [m.queue for m in got] == names + [names[-1]]
        assert got[-1].message_count == 1  # the publish read between them went to the queue, in order
        # One write: N deletes; the queue holding the message counts it.
        c.send(b"".join(_encode(commands.Queue.Delete(queue=q)) for q in names))
        got = _replies(c, N)
        assert [type(m) for m in got] == [commands.Queue.DeleteOk] * N
        assert [m.message_count for m in got] == [0] * (N - 1) + [1]
        for q in (names[0], names[N // 2], names[-1]):  # gone
            assert not c.queue_exists(q)


def test_another_connection_publishes_with_confirms_while_a_client_pipelines_deletes(deferring_node):
    """The other connection's confirmed publishes all arrive while the deletes go over many turns."""
    names = [f"dd-{i:03d}" for i in range(N)]
    with _connect(deferring_node) as c:
        c.send(b"".join(_encode(commands.Queue.Declare(queue=q)) for q in names))
        assert len(_replies(c, N)) == N
        confirmed = []
        errors: list[BaseException] = []

        def publisher() -> None:
            try:
                with _connect(deferring_node) as p:
                    p.queue_declare("dt-probe")
                    p.confirm_select()
                    frame = encoder.encode_publish(1, "", "dt-probe", False, b"\x00\x00", b"x" * 16, p.frame_max)
                    deadline = time.monotonic() + 30
                    while len(confirmed) < 200 and time.monotonic() < deadline:
                        p.send(frame)
                        while True:
                            ev = p.next_event()
                            p._handle_close(ev)
                            if isinstance(ev, events.Ack):
                                confirmed.append(ev)
                                break
            except BaseException as exc:  # reported below
                errors.append(exc)

        t = threading.Thread(target=publisher)
        t.start()
        c.send(b"".join(_encode(commands.Queue.Delete(queue=q)) for q in names))
        assert [type(m) for m in _replies(c, N)] == [commands.Queue.DeleteOk] * N
        t.join(60)
        assert not errors and len(confirmed) == 200
        _, count, _ = c.queue_declare("dt-probe", passive=True)
        assert count == 200


def test_a_big_first_write_split_across_parse_slices_keeps_frames_whole(deferring_node):
    """A connection that has not published yet parses a big read a slice a turn (PARSE_SLICE, 1 KiB): a
    publish whose 20 KB body straddles the slices arrives whole, between the methods around it."""
    body = bytes(range(256)) * 80  # 20,480 bytes
    with _connect(deferring_node) as c:
        c.send(_encode(commands.Queue.Declare(queue="dt-big"))
               + encoder.encode_publish(1, "", "dt-big", False, b"\x00\x00", body, c.frame_max)
               + b"".join(_encode(commands.Queue.Declare(queue="dt-big", passive=True)) for _ in range(40))
               + _encode(commands.Basic.Get(queue="dt-big", no_ack=True)))
        got = _replies(c, 41)
        assert [m.message_count for m in got] == [0] + [1] * 40
        while True:
            ev = c.next_event()
            c._handle_close(ev)
            if isinstance(ev, events.ContentMethod):
                break
        assert isinstance(ev.method, commands.Basic.GetOk) and ev.body == body
