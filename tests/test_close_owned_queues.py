"""A channel's or connection's close, and a frontend's death, requeue exactly what they held.

A shard finds what a closing channel holds in the queues that channel touched (shard/consumers.py
``ChannelRef.queues``), not by a walk of every queue. These tests check the outcome on real nodes
with two shards and two queues on each: the closed channel's (connection's, frontend's) unacked
messages come back in their order with redelivered set, ahead of the rest; the other channels'
consumers and unacked messages stay as they were. Every test node also compares each close with a
walk of every queue (SHARDMQ_TEST_WALK_CHECK, shard/walk_check.py; tests/conftest.py fails the test
on a miss), which the random sequences below exercise.
"""

from __future__ import annotations

import os

import pika
import pika.exceptions
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shard.store import DELIVERED_MARK, queue_dir
from tests.harness import pumping, wait_until
from tests.helpers import connections_on_two_frontends, names_on_different_shards, uid

# Queue names are picked per shard by their crc32 (tests/helpers.py): nodes place by name.
QUEUE_PLACEMENT = "hash"
# One case kills a frontend and expects the shards to live on (tests/conftest.py module_node_args).
COLOCATE = "off"
N = 10  # messages per queue


def _queues(prefix: str) -> list[str]:
    """Four queue names, two on each of the two shards."""
    return names_on_different_shards(prefix + "-a") + names_on_different_shards(prefix + "-b")


def _publish(conn, queues: list[str], bodies: list[bytes]) -> None:
    ch = conn.channel()
    ch.confirm_delivery()
    for q in queues:
        for body in bodies:
            ch.basic_publish("", q, q.encode() + b":" + body)
    ch.close()


def _consume(conn, queues: list[str], prefetch: int):
    """A channel consuming every queue with manual ack and this prefetch; waits for a full prefetch
    from each. Returns (channel, {queue: [(delivery_tag, body, redelivered)]})."""
    ch = conn.channel()
    ch.basic_qos(prefetch_count=prefetch)
    got: dict[str, list] = {q: [] for q in queues}
    for q in queues:
        ch.basic_consume(q, lambda _c, m, _p, b, q=q: got[q].append((m.delivery_tag, b, m.redelivered)))
    wait_until(lambda: all(len(v) >= prefetch for v in got.values()), 10, f"{prefetch} from each queue",
               pause=pumping(conn), context=lambda: str({q: len(v) for q, v in got.items()}))
    return ch, got


def _drain(conn, queue: str, want: int) -> list[tuple[bytes, bool]]:
    """(body, redelivered) of every ready message, by basic.get, once `want` are ready."""
    ch = conn.channel()
    wait_until(lambda: ch.queue_declare(queue, passive=True).method.message_count == want, 10,
               f"{want} ready in {queue}")
    out = []
    while True:
        method, _p, body = ch.basic_get(queue, auto_ack=True)
        if method is None:
            break
        out.append((body, method.redelivered))
    ch.close()
    return out


def _bodies(q: str, idx) -> list[bytes]:
    return [q.encode() + b":m%d" % i for i in idx]


def _check_alive(conn, ch, got: dict, queues: list[str], other) -> None:
    """The consumer of `ch` still holds its unacked messages (acks them now) and still consumes: a
    fresh message to each queue reaches it (`other` is what else consumes there, full)."""
    for q in queues:
        for tag, _b, _r in got[q]:
            ch.basic_ack(tag)
        got[q].clear()
    _publish(other, queues, [b"fresh"])
    wait_until(lambda: all(got[q] for q in queues), 10, "a fresh message from each queue", pause=pumping(conn),
               context=lambda: str(got))
    for q in queues:
        assert [(b, r) for _t, b, r in got[q]] == [(q.encode() + b":fresh", False)]
        ch.basic_ack(got[q][0][0])


@pytest.mark.parametrize("how", ["channel", "connection", "frontend"])
def test_a_close_requeues_exactly_its_unacked_in_order_and_leaves_the_others(node_factory, how):
    """Connection 1 has channels A (prefetch 3) and B (prefetch 2), connection 2 (another frontend)
    channel C (prefetch 1), all consuming four queues on two shards that hold m0..m9: A holds m0-m2,
    B m3-m4, C m5. Closing A (or connection 1, or killing its frontend) puts back m0-m2 (m0-m4),
    redelivered and in order ahead of m6-m9; C (and B) keep theirs and go on consuming."""
    node = node_factory(frontends=2, shards=2)
    queues = _queues(uid("owned"))
    c1, c2 = connections_on_two_frontends(node)
    setup = c2  # the frontend of c1 may be killed: set up and check from the other one
    try:
        ch = setup.channel()
        for q in queues:
            ch.queue_declare(q)
        _publish(setup, queues, [b"m%d" % i for i in range(N)])
        a, got_a = _consume(c1, queues, 3)
        b, got_b = _consume(c1, queues, 2)
        c, got_c = _consume(c2, queues, 1)
        for q in queues:
            assert [x[1] for x in got_a[q]] == _bodies(q, range(3))
            assert [x[1] for x in got_b[q]] == _bodies(q, range(3, 5))
            assert [x[1] for x in got_c[q]] == _bodies(q, [5])
        if how == "channel":
            a.close()  # close-ok comes after the shards requeued (tests/test_channel_close.py)
            back = range(3)
        elif how == "connection":
            c1.close()
            back = range(5)
        else:
            frontend = c1._impl.server_properties["shardmq_frontend"]
            old = node.kill_worker("frontend", int(frontend))
            node.wait_worker_restarted("frontend", int(frontend), old)
            back = range(5)
        for q in queues:
            want = [(b, True) for b in _bodies(q, back)] + [(b, False) for b in _bodies(q, range(6, N))]
            assert _drain(setup, q, len(want)) == want, q
        if how == "channel":
            _check_alive(c1, b, got_b, queues, setup)  # C is full: the fresh ones go to B
            b.close()
        _check_alive(c2, c, got_c, queues, setup)
        for q in queues:
            wait_until(lambda q=q: ch.queue_declare(q, passive=True).method.message_count == 0, 10, q)
    finally:
        for conn in (c1, c2):
            if conn.is_open:
                try:
                    conn.close()
                except (pika.exceptions.AMQPError, OSError):
                    pass


def test_a_get_whose_mark_write_fails_gets_its_message_and_the_close_puts_it_back(shared_node):
    """A manual-ack basic.get whose delivered-mark write fails after the message was taken (the mark
    file cannot be opened: a directory stands in its place; in a full-suite run it was the queue's
    directory gone) is answered with get-ok (the write is retried later, shard/store.py
    ``_write_mark``; it used to raise and answer 541), and the connection's close puts the message
    back, redelivered: the shard indexed the queue in the channel's queues before it touched the
    store (the walk check compares the close with a walk). A get whose store fails before it takes
    anything is answered 541: tests/test_store_faults.py."""
    q = uid("getfail")
    conn = shared_node.connect()
    other = shared_node.connect()
    try:
        ch = conn.channel()
        ch.queue_declare(q)
        _publish(conn, [q], [b"m"])
        # The mark is opened at the queue's first delivery: none so far.
        mark = os.path.join(queue_dir(str(shared_node.data_dir), "/", q), DELIVERED_MARK)
        os.mkdir(mark)
        try:
            method, _p, body = ch.basic_get(q, auto_ack=False)
            assert (body, method.redelivered) == (q.encode() + b":m", False)
            conn.close()
        finally:
            os.rmdir(mark)
        och = other.channel()
        wait_until(lambda: och.queue_declare(q, passive=True).method.message_count == 1, 10,
                   "the taken message back in the queue")
        method, _p, body = och.basic_get(q, auto_ack=True)
        assert (body, method.redelivered) == (q.encode() + b":m", True)
        och.queue_delete(q)
    finally:
        for c in (conn, other):
            if c.is_open:
                c.close()


def test_a_no_ack_get_whose_mark_write_fails_still_gets_its_message(shared_node):
    """The same fault under a no-ack basic.get: the message was taken (removed, no close requeues it)
    and is answered with get-ok, never lost behind an error (this held also when the mark's write
    still raised: the get-ok went out all the same)."""
    q = uid("getfail-noack")
    conn = shared_node.connect()
    try:
        ch = conn.channel()
        ch.queue_declare(q)
        _publish(conn, [q], [b"m", b"n"])
        mark = os.path.join(queue_dir(str(shared_node.data_dir), "/", q), DELIVERED_MARK)
        os.mkdir(mark)
        try:
            method, _p, body = ch.basic_get(q, auto_ack=True)
        finally:
            os.rmdir(mark)
        assert (body, method.redelivered) == (q.encode() + b":m", False)
        method, _p, body = ch.basic_get(q, auto_ack=True)
        assert body == q.encode() + b":n"
        assert ch.queue_declare(q, passive=True).method.message_count == 0
        ch.queue_delete(q)
    finally:
        if conn.is_open:
            conn.close()


# ---------------------------------------------------------------- random sequences
_OPS = st.one_of(
    st.tuples(st.just("consume"), st.integers(0, 3), st.integers(0, 3)),  # channel slot, queue
    st.tuples(st.just("cancel"), st.integers(0, 3), st.integers(0, 3)),
    st.tuples(st.just("get"), st.integers(0, 3), st.integers(0, 3)),
    st.tuples(st.just("ack"), st.integers(0, 3), st.just(0)),
    st.tuples(st.just("recover"), st.integers(0, 3), st.just(0)),
    st.tuples(st.just("close_channel"), st.integers(0, 3), st.just(0)),
    st.tuples(st.just("close_connection"), st.integers(0, 1), st.just(0)),
    st.tuples(st.just("publish"), st.just(0), st.integers(0, 3)),
)


class _Slots:
    """Four channel slots over two connections (slots 0-1 on the first, 2-3 on the second),
    opened on first use, each with its consumers and the delivery tags it has not acked."""

    def __init__(self, node) -> None:
        self.node = node
        self.conns: list = [None, None]
        self.chans: list = [None] * 4
        self.tags: list[dict[str, str]] = [{} for _ in range(4)]
        self.unacked: list[list[int]] = [[] for _ in range(4)]

    def chan(self, slot: int):
        ci = slot // 2
        if self.conns[ci] is None or not self.conns[ci].is_open:
            self.conns[ci] = self.node.connect()
            for s in (2 * ci, 2 * ci + 1):
                self.chans[s] = None
        if self.chans[slot] is None or not self.chans[slot].is_open:
            ch = self.chans[slot] = self.conns[ci].channel()
            ch.basic_qos(prefetch_count=2)
            self.tags[slot] = {}
            self.unacked[slot] = []
        return self.chans[slot]

    def pump(self) -> None:
        for conn in self.conns:
            if conn is not None and conn.is_open:
                conn.process_data_events(0.01)

    def forget(self, slot: int) -> None:
        self.chans[slot] = None
        self.tags[slot] = {}
        self.unacked[slot] = []

    def close_all(self) -> None:
        for conn in self.conns:
            if conn is not None and conn.is_open:
                conn.close()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(_OPS, min_size=5, max_size=30))
def test_random_consume_cancel_get_ack_close_sequences_lose_and_strand_nothing(shared_node, ops):
    """Whatever the order of consumes, cancels, gets, acks, recovers and closes over four queues on two
    shards, every close finds all its channel's consumers and unacked messages (the node's walk check
    compares each with a walk of every queue), and at the end every message not acked is ready again."""
    queues = _queues(uid("rand"))
    setup = shared_node.connect()
    sch = setup.channel()
    for q in queues:
        sch.queue_declare(q)
    _publish(setup, queues, [b"%d" % i for i in range(4)])
    published = {q: 4 for q in queues}
    acked = {q: 0 for q in queues}
    slots = _Slots(shared_node)
    try:
        for op, slot, qi in ops:
            q = queues[qi]
            if op == "consume":
                ch = slots.chan(slot)
                if q not in slots.tags[slot]:
                    def on_msg(c, m, _p, _b, slot=slot, q=q):
                        if c is slots.chans[slot]:  # not a late one of an earlier opening of the slot
                            slots.unacked[slot].append((m.delivery_tag, q))
                    slots.tags[slot][q] = ch.basic_consume(q, on_msg)
            elif op == "cancel":
                tag = slots.tags[slot].pop(q, None)
                if tag is not None and slots.chans[slot] is not None and slots.chans[slot].is_open:
                    slots.chans[slot].basic_cancel(tag)
            elif op == "get":
                ch = slots.chan(slot)
                method, _p, _b = ch.basic_get(q, auto_ack=False)
                if method is not None:
                    slots.unacked[slot].append((method.delivery_tag, q))
            elif op == "ack":
                if slots.chans[slot] is not None and slots.chans[slot].is_open:
                    for tag, aq in slots.unacked[slot]:
                        slots.chans[slot].basic_ack(tag)
                        acked[aq] += 1
                    slots.unacked[slot] = []
            elif op == "recover":
                # Only without consumers on the channel: what it holds then came from basic.get (and
                # from cancelled consumers, all dispatched by the pump), none of it redelivered to it.
                if slots.chans[slot] is not None and slots.chans[slot].is_open and not slots.tags[slot]:
                    slots.pump()
                    slots.chans[slot].basic_recover(requeue=True)
                    slots.unacked[slot] = []
            elif op == "close_channel":
                if slots.chans[slot] is not None and slots.chans[slot].is_open:
                    slots.chans[slot].close()
                slots.forget(slot)
            elif op == "close_connection":
                if slots.conns[slot] is not None and slots.conns[slot].is_open:
                    slots.conns[slot].close()
                for s in (2 * slot, 2 * slot + 1):
                    slots.forget(s)
            elif op == "publish":
                _publish(setup, [q], [b"p"])
                published[q] += 1
            slots.pump()
        slots.close_all()
        for q in queues:
            want = published[q] - acked[q]
            wait_until(lambda q=q, want=want: sch.queue_declare(q, passive=True).method.message_count == want,
                       10, f"{want} ready in {q}")
            assert sch.queue_declare(q, passive=True).method.consumer_count == 0
    finally:
        slots.close_all()
        for q in queues:
            sch.queue_delete(q)
        setup.close()
