"""One copy of a fenced DEFS per paired process (broker/pair_defs.py, contract 27).

The node sends a bind's, an unbind's, an exchange declare's or delete's DEFS to a pair once, through
its frontend part, which hands it to its shard part in-process; the shard part applies those and the
DEFS of its own stream in version order.

The node here is one pair (frontend 0 + shard 0 in one process) whose frontend part holds what it
reads on its control plane 300 ms before it handles it (the test-only SHARDMQ_TEST_CONTROL_DELAY_MS),
so the shard part reads the DEFS of a change made after a bind on its own stream before its frontend
part has handed the bind over. A bind (nowait) and a queue.declare pipelined behind it on one
channel: when declare-ok arrives the shard part has applied the declare (the node waits for its
APPLIED), and so must it have applied the bind before it (a dead letter routes through it); the same
for an unbind. Without the shard part reading its frontend part's stream for the DEFS before its own
(``HandedDefs.before``), the bind would reach the shard part after the declare's version and be
dropped (checked by disabling that read: both dead-letter tests fail, the shard logs "arrived after").
"""

from __future__ import annotations

import time

import pytest
from pamqp import commands as C

from broker.definitions import Definitions
from broker.pair_defs import HandedDefs
from tests.conftest import module_node_args
from tests.harness import NodeFactory
from tests.helpers import get_one, uid
from tests.raw_amqp import FrameClient

COLOCATE = "on"  # a pair whatever the machine's core count (tests/conftest.py)
DELAY_MS = 300


@pytest.fixture(scope="module")
def pair_node(tmp_path_factory, request):
    factory = NodeFactory(tmp_path_factory.mktemp("pair_defs"), module_node_args(request.module))
    try:
        yield factory(name="node", frontends=1, shards=1,
                      env={"SHARDMQ_TEST_CONTROL_DELAY_MS": f"frontend:{DELAY_MS}"})
    finally:
        factory.cleanup()


def _no_handover_trouble(node) -> None:
    log = node.log_text()
    assert "arrived after" not in log and "not handed over" not in log and "not here" not in log


def test_bind_then_publish_on_the_same_channel_routes_and_unbind_then_publish_does_not(pair_node):
    conn = pair_node.connect()
    try:
        ch = conn.channel()
        x, q = uid("px"), uid("pq")
        ch.exchange_declare(x, "direct")
        ch.queue_declare(q)
        for n in range(5):
            ch.queue_bind(q, x, "k")
            ch.basic_publish(x, "k", b"routed%d" % n)
            assert get_one(ch, q)[2] == b"routed%d" % n
            ch.queue_unbind(q, x, "k")
            ch.basic_publish(x, "k", b"lost%d" % n)
            # Behind it on the same channel and queue: the first message the queue gets after the unbind.
            ch.basic_publish("", q, b"marker%d" % n)
            assert get_one(ch, q)[2] == b"marker%d" % n
        assert ch.basic_get(q, auto_ack=True)[0] is None
        ch.queue_delete(q)
        ch.exchange_delete(x)
    finally:
        conn.close()
    _no_handover_trouble(pair_node)


def _rejected(ch, src: str, body: bytes) -> None:
    """Publish ``body`` to ``src`` and reject it: the shard dead-letters it with its own definitions."""
    ch.basic_publish("", src, body)
    method = get_one(ch, src, auto_ack=False)[0]
    ch.basic_reject(method.delivery_tag, requeue=False)


def test_dead_letter_after_a_bind_and_a_declare_pipelined_behind_it(pair_node):
    conn = pair_node.connect()
    raw = FrameClient(pair_node.port)
    try:
        ch = conn.channel()
        dlx, dlq, stay = uid("pdlx"), uid("pdlq"), uid("pstay")
        ch.exchange_declare(dlx, "direct")
        ch.queue_declare(dlq)
        ch.queue_declare(stay)
        ch.queue_bind(stay, dlx, "dl")  # a binding that stays: where the unbound dead letters go
        src = ch.queue_declare(uid("psrc"), arguments={"x-dead-letter-exchange": dlx,
                                                       "x-dead-letter-routing-key": "dl"}).method.queue
        raw.open_channel(1)
        for n in range(3):
            # The bind's DEFS go to the pair through its (late) frontend part, the declare's to both parts.
            raw.send(1, C.Queue.Bind(queue=dlq, exchange=dlx, routing_key="dl", nowait=True),
                     C.Queue.Declare(queue=uid("pnext")))
            raw.expect(1, C.Queue.DeclareOk)
            _rejected(ch, src, b"bound%d" % n)
            assert get_one(ch, dlq)[2] == b"bound%d" % n
            assert get_one(ch, stay)[2] == b"bound%d" % n

            raw.send(1, C.Queue.Unbind(queue=dlq, exchange=dlx, routing_key="dl"),
                     C.Queue.Declare(queue=uid("pnext")))
            raw.expect(1, C.Queue.UnbindOk)
            raw.expect(1, C.Queue.DeclareOk)
            _rejected(ch, src, b"unbound%d" % n)
            # Routed once, to every queue bound then: in `stay`, and so not in dlq.
            assert get_one(ch, stay)[2] == b"unbound%d" % n
            assert ch.basic_get(dlq, auto_ack=True)[0] is None
    finally:
        raw.close()
        conn.close()
    _no_handover_trouble(pair_node)


def test_the_frontend_delay_is_in_effect(pair_node):
    """The scenario above needs the frontend part late: a queue.declare's answer waits for it."""
    conn = pair_node.connect()
    try:
        ch = conn.channel()
        start = time.monotonic()
        ch.queue_declare(uid("pslow"), auto_delete=True)
        assert time.monotonic() - start >= DELAY_MS / 1000 * 0.9
    finally:
        conn.close()


# ------------------------------------------------------------------ HandedDefs, in-process


def _bind(q: str) -> list:
    return ["bind", "/", "x", "queue", q, "k", {}]


class _Part:
    """A shard part's definitions and version, as shard/worker.py keeps them."""

    def __init__(self) -> None:
        self.defs = Definitions()
        self.defs.apply_all([["vhost.put", "/"], ["exchange.declare", "/", "x", {"type": "direct"}],
                             ["queue.declare", "/", "a", {}], ["queue.declare", "/", "b", {}]])
        self.version = self.defs.version

    def apply(self, version: int, ops: list) -> None:
        self.version = version
        self.defs.apply_all(ops)

    def bound(self) -> set:
        return {b[2] for b in self.defs.bindings("/") if b[0] == "x"}


def test_handed_defs_ahead_of_the_own_stream_wait_for_it():
    part = _Part()
    handed = HandedDefs(part.apply, lambda: part.version, "test", lambda fn: fn())
    v = part.version
    # The node applied a declare (v + 1) before this bind (v + 2); the shard part has not read it yet.
    handed.add(v + 2, [_bind("c")])
    assert part.version == v and len(handed.pending) == 1 and not part.bound()
    handed.before(v)  # the own-stream DEFS starting at v is next: nothing handed comes before it
    assert part.version == v and len(handed.pending) == 1
    part.apply(v + 1, [["queue.declare", "/", "c", {}]])  # the own-stream DEFS
    handed.apply_ready()
    assert part.version == v + 2 and not handed.pending and part.bound() == {"c"}


def test_handed_defs_in_order_apply_at_once():
    part = _Part()
    handed = HandedDefs(part.apply, lambda: part.version, "test", lambda fn: fn())
    v = part.version
    handed.add(v + 1, [_bind("a")])
    assert part.bound() == {"a"}
    handed.add(v + 3, [_bind("b"), ["unbind", "/", "x", "queue", "a", "k", {}]])
    assert part.version == v + 3 and not handed.pending and part.bound() == {"b"}


def test_handed_defs_apply_in_a_callback_of_their_own_or_when_needed():
    part = _Part()
    soon: list = []
    handed = HandedDefs(part.apply, lambda: part.version, "test", soon.append)
    v = part.version
    handed.add(v + 1, [_bind("a")])
    handed.add(v + 2, [_bind("b")])
    assert part.version == v and len(soon) == 1  # one callback for both, not run yet
    soon.pop()()
    assert part.version == v + 2 and part.bound() == {"a", "b"}
    handed.add(v + 3, [["unbind", "/", "x", "queue", "a", "k", {}]])
    handed.before(v + 3)  # an own-stream DEFS after it is next: it is applied first
    assert part.version == v + 3 and part.bound() == {"b"} and not handed.pending
