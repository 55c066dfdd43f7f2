"""The node handles a worker's control batch for about 1 ms per loop turn and leaves the rest, with
what that worker sends meanwhile, in order for the next turns (broker/node.py _on_control,
_CONTROL_TURN_S): 500 pipelined queue.delete in one batch no longer make one long node turn. The
test-only SHARDMQ_TEST_NODE_TURN_US=0 makes every batch of more than 8 requests go over several
turns, and the node read one frame (batch) of a worker per turn (its control socket's turn_s), so these tests fail if the requests left for later are lost, reordered, handled before
those read first, or their definitions lost across a kill -9 of the node."""

from __future__ import annotations

import pytest
from pamqp import commands

from broker.amqp import encoder, events
from loadtest.amqp_client import AMQPClient

pytestmark = pytest.mark.integration

N = 300


def _encode(method, channel: int = 1) -> bytes:
    return encoder.encode_method(channel, method)


def _connect(node) -> AMQPClient:
    return AMQPClient(node.url.rstrip("/") + "/%2F", timeout=20).connect()


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
def slicing_node(node_factory):
    return node_factory(name="node", frontends=1, shards=2, env={"SHARDMQ_TEST_NODE_TURN_US": "0"})


def test_pipelined_declares_binds_and_deletes_over_many_node_turns_answer_in_order(slicing_node):
    names = [f"nt-{i:03d}" for i in range(N)]
    with _connect(slicing_node) as c:
        c.exchange_declare("nt-x", "direct")
        # One write: declares, a bind of each (behind its declare), a publish through the last
        # binding, a passive declare that counts it.
        c.send(b"".join(_encode(commands.Queue.Declare(queue=q)) for q in names)
               + b"".join(_encode(commands.Queue.Bind(queue=q, exchange="nt-x", routing_key=q)) for q in names)
               + encoder.encode_publish(1, "nt-x", names[-1], False, b"\x00\x00", b"routed", c.frame_max)
               + _encode(commands.Queue.Declare(queue=names[-1], passive=True)))
        got = _replies(c, 2 * N + 1)
        assert [type(m) for m in got] == [commands.Queue.DeclareOk] * N + [commands.Queue.BindOk] * N + [
            commands.Queue.DeclareOk]
        assert [m.queue for m in got[:N]] == names
        assert got[-1].message_count == 1  # routed through the binding answered before it
        # Unbinds then deletes of every queue in one write: all applied, in order, the counts their own.
        c.send(b"".join(_encode(commands.Queue.Unbind(queue=q, exchange="nt-x", routing_key=q)) for q in names)
               + b"".join(_encode(commands.Queue.Delete(queue=q)) for q in names))
        got = _replies(c, 2 * N)
        assert [type(m) for m in got] == [commands.Queue.UnbindOk] * N + [commands.Queue.DeleteOk] * N
        assert [m.message_count for m in got[N:]] == [0] * (N - 1) + [1]
        for q in names:
            assert not c.queue_exists(q)


def test_two_connections_pipelining_at_once_each_get_their_own_replies_in_order(slicing_node):
    a_names = [f"nta-{i:03d}" for i in range(N)]
    b_names = [f"ntb-{i:03d}" for i in range(N)]
    with _connect(slicing_node) as a, _connect(slicing_node) as b:
        a.send(b"".join(_encode(commands.Queue.Declare(queue=q)) for q in a_names))
        b.send(b"".join(_encode(commands.Queue.Declare(queue=q)) for q in b_names))
        assert [m.queue for m in _replies(a, N)] == a_names
        assert [m.queue for m in _replies(b, N)] == b_names
        a.send(b"".join(_encode(commands.Queue.Delete(queue=q)) for q in a_names))
        b.send(b"".join(_encode(commands.Queue.Delete(queue=q)) for q in b_names))
        assert [type(m) for m in _replies(a, N)] == [commands.Queue.DeleteOk] * N
        assert [type(m) for m in _replies(b, N)] == [commands.Queue.DeleteOk] * N
        for q in (a_names[0], a_names[-1], b_names[0], b_names[-1]):
            assert not a.queue_exists(q)


def test_definitions_answered_over_many_node_turns_survive_a_kill9(slicing_node):
    """Durable declares and deletes acknowledged while the node sliced their batch are on disk."""
    names = [f"ntd-{i:03d}" for i in range(N)]
    with _connect(slicing_node) as c:
        c.send(b"".join(_encode(commands.Queue.Declare(queue=q, durable=True)) for q in names)
               + b"".join(_encode(commands.Queue.Bind(queue=q, exchange="amq.direct", routing_key=q))
                          for q in names[: N // 2]))
        assert len(_replies(c, N + N // 2)) == N + N // 2
    slicing_node.kill9()
    slicing_node.restart()
    with _connect(slicing_node) as c:
        assert all(c.queue_exists(q) for q in names)
        # The bindings came back too: a publish through one of them lands in its queue.
        c.confirm_select()
        c.send(encoder.encode_publish(1, "amq.direct", names[0], True, b"\x00\x00", b"bound", c.frame_max))
        while not isinstance(ev := c.next_event(), events.Ack):
            c._handle_close(ev)
            assert not isinstance(ev, events.ContentMethod), "returned: the binding was lost"
        c.send(b"".join(_encode(commands.Queue.Delete(queue=q)) for q in names[: N // 2]))
        assert [m.message_count for m in _replies(c, N // 2)] == [1] + [0] * (N // 2 - 1)
    slicing_node.kill9()
    slicing_node.restart()
    with _connect(slicing_node) as c:
        assert not any(c.queue_exists(q) for q in names[: N // 2])
        assert all(c.queue_exists(q) for q in names[N // 2:])
