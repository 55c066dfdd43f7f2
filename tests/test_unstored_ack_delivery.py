"""Transient messages to a waiting manual-ack consumer are held in memory, not stored, until settled.

The shard's publish path hands such a message straight to the consumer (shard/queue.py
``deliver_unstored``) and keeps its body under a virtual id until the ack drops it. A requeue (nack,
reject, basic.recover, channel or connection close, consumer timeout), a later message appended to
the queue, or the queue gaining features (a policy, a per-message dead-letter header) first stores
the held messages in their delivery order (``materialize``), so every position, flag and count is
the stored path's. Shown here on real nodes with pika: the queue's directory gets no segment file
while messages are only held (so the unstored path ran), and each way a held message can leave.
"""

from __future__ import annotations

import hashlib
import os
import time

import pika
import pytest

from shard.queue import HELD_BUDGET, HELD_OVERHEAD
from tests.harness import pumping, wait_until
from tests.helpers import WAIT, uid
from tests.mgmt_api import Api


def _segments(node, name: str) -> list[str]:
    path = os.path.join(str(node.data_dir), hashlib.sha1(b"/").hexdigest(), hashlib.sha1(name.encode()).hexdigest())
    return [f for f in os.listdir(path) if f.startswith("msgs.")] if os.path.isdir(path) else []


def _wait(conn, predicate, what: str, timeout: float = WAIT) -> None:
    wait_until(predicate, timeout, what, pause=pumping(conn))


class Held:
    """A manual-ack consumer on its own connection and channel, and a publisher on another."""

    def __init__(self, node, queue: str, *, durable: bool = False, prefetch: int = 100,
                 arguments: dict | None = None) -> None:
        self.node = node
        self.queue = queue
        self.conn = node.connect()
        self.ch = self.conn.channel()
        self.ch.queue_declare(queue, durable=durable, arguments=arguments)
        self.ch.basic_qos(prefetch_count=prefetch)
        self.got: list[tuple[int, bytes, bool]] = []  # (delivery tag, body, redelivered)
        # consume-ok comes once the shard has the consumer: every publish below finds it waiting.
        self.tag = self.ch.basic_consume(queue, self._on)
        self.pub_conn = node.connect()
        self.pub = self.pub_conn.channel()

    def _on(self, _ch, method, _props, body) -> None:
        self.got.append((method.delivery_tag, body, method.redelivered))

    def publish(self, bodies: list[bytes], persistent: bool = False, **props) -> None:
        for body in bodies:
            self.pub.basic_publish("", self.queue, body,
                                   pika.BasicProperties(delivery_mode=2 if persistent else 1, **props))

    def wait_got(self, n: int) -> None:
        _wait(self.conn, lambda: len(self.got) >= n, f"{n} deliveries (got {len(self.got)})")

    def close(self) -> None:
        for c in (self.conn, self.pub_conn):
            if c.is_open:
                c.close()


def _queue(api: Api, name: str, want: dict) -> dict:
    """The management API's queue once the fields in `want` have those values (stats are periodic)."""
    return api.wait_for(f"/api/queues/%2F/{name}",
                        lambda q: all(q.get(k) == v for k, v in want.items()))


def _get_all(ch, queue: str, n: int) -> list[tuple[bytes, bool]]:
    out = []
    for _ in range(n):
        method, _props, body = ch.basic_get(queue, auto_ack=True)
        assert method is not None, f"only {len(out)} of {n} messages were in the queue: {out}"
        out.append((body, method.redelivered))
    assert ch.basic_get(queue, auto_ack=True)[0] is None, "more messages than expected"
    return out


@pytest.fixture
def node(node_factory):
    return node_factory(name="node", frontends=1, shards=1, extra_args=["--stats-interval", "200"])


def test_acked_held_messages_are_never_stored_and_counted(node):
    qn = uid("held-ack")
    h = Held(node, qn, durable=True)
    api = Api(node.http_port)
    bodies = [f"m{i}".encode() for i in range(20)]
    h.publish(bodies)
    h.wait_got(20)
    assert [(b, r) for _, b, r in h.got] == [(b, False) for b in bodies]
    assert _segments(node, qn) == [], "held transient messages were written to a segment"
    _queue(api, qn, {"messages_unacknowledged": 20, "messages_ready": 0})
    for tag, _, _ in h.got[:10]:
        h.ch.basic_ack(tag)
    h.ch.basic_ack(h.got[-1][0], multiple=True)
    q = _queue(api, qn, {"messages_unacknowledged": 0, "messages_ready": 0})
    stats = api.wait_for(f"/api/queues/%2F/{qn}",
                         lambda q: q.get("message_stats", {}).get("ack") == 20)["message_stats"]
    assert (stats["publish"], stats["deliver"], stats.get("deliver_no_ack", 0)) == (20, 20, 0), stats
    assert q["messages"] == 0
    assert _segments(node, qn) == []
    h.close()


def test_nack_requeue_keeps_delivery_order_and_sets_redelivered(node):
    qn = uid("held-nack")
    h = Held(node, qn)
    bodies = [f"m{i}".encode() for i in range(6)]
    h.publish(bodies)
    h.wait_got(6)
    assert _segments(node, qn) == []
    h.ch.basic_cancel(h.tag)  # nothing is redelivered while the requeues arrive
    # Requeued in reverse order, one by one: the queue's order is still the delivery order.
    for tag, _, _ in reversed(h.got[1:5]):
        h.ch.basic_nack(tag, requeue=True)
    h.ch.basic_reject(h.got[0][0], requeue=False)  # dropped for good
    assert _get_all(h.pub, qn, 4) == [(b, True) for b in bodies[1:5]]
    h.ch.close()  # m5, never settled, comes back with the channel
    assert _get_all(h.pub, qn, 1) == [(b"m5", True)]
    h.close()


def test_later_stored_message_keeps_its_place_behind_held_ones(node):
    """A persistent message is stored while transient ones are held: the held ones are stored first,
    so a requeue of all of them gives the delivery order, as through the store."""
    qn = uid("held-mixed")
    h = Held(node, qn, durable=True)
    h.publish([b"t0", b"t1"])
    h.wait_got(2)
    assert _segments(node, qn) == []
    h.publish([b"p2"], persistent=True)
    h.publish([b"t3"])
    h.wait_got(4)
    assert _segments(node, qn), "the persistent message was not stored"
    h.ch.basic_recover(requeue=True)
    h.wait_got(8)
    assert [(b, r) for _, b, r in h.got[4:]] == [(b"t0", True), (b"t1", True), (b"p2", True), (b"t3", True)]
    for tag, _, _ in h.got[4:]:
        h.ch.basic_ack(tag)
    # The acks of the redeliveries settled them: nothing comes back when the channel closes.
    h.ch.close()
    assert h.pub.basic_get(qn, auto_ack=True)[0] is None
    h.close()


def test_held_messages_come_back_after_cancel_and_connection_close(node):
    qn = uid("held-close")
    h = Held(node, qn)
    api = Api(node.http_port)
    bodies = [f"m{i}".encode() for i in range(5)]
    h.publish(bodies)
    h.wait_got(5)
    h.ch.basic_cancel(h.tag)
    # After a cancel the deliveries are still the channel's: acking one works, the rest stay unacked.
    h.ch.basic_ack(h.got[2][0])
    _queue(api, qn, {"messages_unacknowledged": 4, "messages_ready": 0})
    h.conn.close()
    q = _queue(api, qn, {"messages_unacknowledged": 0, "messages_ready": 4})
    assert q["consumers"] == 0
    assert _get_all(h.pub, qn, 4) == [(b, True) for b in bodies[:2] + bodies[3:]]
    h.close()


def test_purge_leaves_held_messages_and_queue_delete_drops_them(node):
    qn = uid("held-purge")
    h = Held(node, qn)
    api = Api(node.http_port)
    h.publish([b"a", b"b"])
    h.wait_got(2)
    assert h.pub.queue_purge(qn).method.message_count == 0  # held ones are unacked, not ready
    h.ch.basic_ack(h.got[0][0])
    _queue(api, qn, {"messages_unacknowledged": 1})
    h.pub.queue_delete(qn)
    _wait(h.conn, lambda: not h.ch.consumer_tags, "the consumer's cancel")
    h.pub.queue_declare(qn)
    assert h.pub.basic_get(qn, auto_ack=True)[0] is None
    h.close()


def test_consumer_timeout_requeues_held_messages(node_factory):
    node = node_factory(name="node", frontends=1, shards=1, extra_args=["--consumer-timeout", "300"])
    qn = uid("held-timeout")
    h = Held(node, qn)
    h.publish([b"x", b"y"])
    h.wait_got(2)
    _wait(h.conn, lambda: h.ch.is_closed, "the consumer timeout's channel.close")
    deadline = time.monotonic() + WAIT
    while h.pub.queue_declare(qn, passive=True).method.message_count != 2:
        assert time.monotonic() < deadline, "the timed-out deliveries did not come back"
        time.sleep(0.02)
    assert _get_all(h.pub, qn, 2) == [(b"x", True), (b"y", True)]
    h.close()


def test_policy_arriving_while_held_gives_delivery_limit_and_dead_lettering(node):
    """A policy turns the queue into a feature queue while messages are held: they are stored with
    their virtual ids still valid for the client's acks, counted for x-delivery-limit, and a reject
    dead-letters them."""
    qn = uid("held-policy")
    dlq = uid("held-dlq")
    api = Api(node.http_port)
    h = Held(node, qn)
    h.pub.queue_declare(dlq)
    h.publish([b"a", b"b", b"c"])
    h.wait_got(3)
    api.put(f"/api/policies/%2F/{qn}", {"pattern": f"^{qn}$", "apply-to": "queues", "definition": {
        "dead-letter-exchange": "", "dead-letter-routing-key": dlq, "delivery-limit": 1}})
    _queue(api, qn, {"policy": qn})
    h.ch.basic_ack(h.got[0][0])  # a: acked by its virtual id after the upgrade
    h.ch.basic_reject(h.got[1][0], requeue=False)  # b: dead-lettered
    h.ch.basic_nack(h.got[2][0], requeue=True)  # c: redelivered once (the limit), then dead-lettered
    h.wait_got(4)
    assert h.got[3][1:] == (b"c", True)
    h.ch.basic_nack(h.got[3][0], requeue=True)
    deadline = time.monotonic() + WAIT
    while h.pub.queue_declare(dlq, passive=True).method.message_count != 2:
        assert time.monotonic() < deadline, "the rejected messages were not dead-lettered"
        time.sleep(0.02)
    assert [b for b, _ in _get_all(h.pub, dlq, 2)] == [b"b", b"c"]
    _queue(api, qn, {"messages_unacknowledged": 0, "messages_ready": 0})
    h.close()


def test_per_message_dead_letter_header_on_a_held_message(node):
    qn = uid("held-dlx-hdr")
    dlq = uid("held-dlx-target")
    h = Held(node, qn)
    h.pub.queue_declare(dlq)
    h.publish([b"bad"], headers={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": dlq})
    h.wait_got(1)
    h.ch.basic_reject(h.got[0][0], requeue=False)
    deadline = time.monotonic() + WAIT
    while h.pub.queue_declare(dlq, passive=True).method.message_count != 1:
        assert time.monotonic() < deadline, "the rejected message was not dead-lettered"
        time.sleep(0.02)
    assert _get_all(h.pub, dlq, 1) == [(b"bad", False)]
    h.close()


def test_clean_restart_drops_held_transient_and_keeps_persistent(node):
    """As through the store: transient messages do not survive a restart, delivered or not; a
    persistent one delivered and unacked comes back redelivered."""
    qn = uid("held-restart")
    h = Held(node, qn, durable=True)
    h.publish([b"t0"])
    h.wait_got(1)
    h.publish([b"p1"], persistent=True)
    h.publish([b"t2"])
    h.wait_got(3)
    h.publish([b"t3"])  # and one held at the stop, never stored
    h.wait_got(4)
    node.restart()  # a clean stop with all four delivered and unacked
    conn = node.connect()
    ch = conn.channel()
    assert _get_all(ch, qn, 1) == [(b"p1", True)]
    conn.close()


def test_held_bytes_have_a_budget_beyond_which_messages_are_stored(node):
    """A consumer without prefetch that does not ack gets its credit back as its frontend writes: the
    shard holds at most HELD_BUDGET bytes of bodies, then stores, behind the held ones."""
    qn = uid("held-budget")
    h = Held(node, qn, durable=True, prefetch=0)
    size = 1 << 20
    fit = HELD_BUDGET // (size + HELD_OVERHEAD)
    for i in range(fit):
        h.publish([bytes([i]) * size])
        h.wait_got(i + 1)  # the queue is empty and the consumer waiting at each publish
    assert _segments(node, qn) == [], "messages within the budget were stored"
    h.publish([bytes([fit]) * size])
    h.wait_got(fit + 1)
    assert _segments(node, qn), "a message over the budget was held, not stored"
    h.ch.close()
    got = _get_all(h.pub, qn, fit + 1)
    assert [(b[0], len(b), r) for b, r in got] == [(i, size, True) for i in range(fit + 1)]
    h.close()
