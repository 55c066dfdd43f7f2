"""A bind's round trip (broker/node.py _commit): bind-ok only once every worker routes through it.

The node sends the requesting frontend its DEFS in the batch of the REPLY (not at once), and that
frontend answers no APPLIED for them; every other worker gets them at once and must answer. What a
client sees must not change: right after bind-ok a publish on any connection of either frontend, the
binder's own frontend included, and a dead letter on either shard route through the new binding;
after unbind-ok nothing does; requests alternating between the frontends (each waiting for the
other's APPLIED) are all answered.
"""

from __future__ import annotations

import pika
import pytest
from pamqp import commands as C

from tests.helpers import connections_on_two_frontends, get_one, uid
from tests.raw_amqp import FrameClient
from tests.test_feature_dlx import uid_on
from tests.test_pipelined_declares import _frames
from tests.test_queues import exists

# uid_on picks names by crc32 to put the dead-letter source and target on given shards.
QUEUE_PLACEMENT = "hash"


def _same_frontend_as(node, other):
    """Another connection served by the same frontend process as `other`."""
    want = other._impl.server_properties["shardmq_frontend"]
    for _ in range(40):
        c = node.connect()
        if c._impl.server_properties["shardmq_frontend"] == want:
            return c
        c.close()
    pytest.fail(f"no second connection landed on frontend {want}")


def test_bind_ok_routes_at_once_on_every_frontend_and_unbind_ok_stops_it(shared_node):
    a, b = connections_on_two_frontends(shared_node)
    a2 = _same_frontend_as(shared_node, a)
    try:
        binders = [a.channel(), b.channel()]
        publishers = {"a2": a2.channel(), "a": a.channel(), "b": b.channel()}
        for ch in publishers.values():
            ch.confirm_delivery()
        x = uid("rt")
        binders[0].exchange_declare(x, "direct")
        queues = [binders[0].queue_declare(uid(f"rt{s}"), exclusive=False).method.queue for s in range(2)]
        for i in range(30):
            # Alternate the binding frontend: each request waits for the APPLIED of the other frontend,
            # whose own request just went before it.
            binder = binders[i % 2]
            q = queues[i % 2]
            key = f"k{i}"
            binder.queue_bind(q, x, key)
            for name, ch in publishers.items():
                # mandatory + confirms: an unroutable publish raises UnroutableError here.
                ch.basic_publish(x, key, f"{i}-{name}".encode(), mandatory=True)
            got = sorted(get_one(binder, q)[2] for _ in publishers)
            assert got == sorted(f"{i}-{name}".encode() for name in publishers)
            binder.queue_unbind(q, x, key)
            for ch in publishers.values():
                with pytest.raises(pika.exceptions.UnroutableError):
                    ch.basic_publish(x, key, b"after unbind", mandatory=True)
        for q in queues:
            binders[0].queue_delete(q)
        binders[0].exchange_delete(x)
    finally:
        for c in (a, b, a2):
            c.close()


@pytest.mark.parametrize("source_shard", [0, 1])
def test_dead_letter_right_after_bind_ok_routes_through_the_binding(shared_node, source_shard):
    a, b = connections_on_two_frontends(shared_node)
    try:
        for binder_conn in (a, b):
            ch = binder_conn.channel()
            ch.confirm_delivery()
            dlx = uid("rtdlx")
            ch.exchange_declare(dlx, "direct")
            dlq = uid_on(1 - source_shard, "rtdlq")
            ch.queue_declare(dlq)
            src = uid_on(source_shard, "rtsrc")
            ch.queue_declare(src, arguments={"x-dead-letter-exchange": dlx, "x-dead-letter-routing-key": "dl"})
            for n in range(5):
                ch.basic_publish("", src, b"m%d" % n)
                method = get_one(ch, src, auto_ack=False)[0]
                # The shard of src dead-letters through its own copy of the bindings: bound just now.
                ch.queue_bind(dlq, dlx, "dl")
                ch.basic_reject(method.delivery_tag, requeue=False)
                assert get_one(ch, dlq)[2] == b"m%d" % n
                ch.queue_unbind(dlq, dlx, "dl")
            ch.queue_delete(src)
            ch.queue_delete(dlq)
            ch.exchange_delete(dlx)
            ch.close()
    finally:
        a.close()
        b.close()


def test_pipelined_binds_are_answered_in_order_and_none_runs_after_a_failed_one(shared_node):
    """Binds sent in one write: each is applied in the order sent (the node handles a bind at once
    only when nothing of its channel is in flight), and after one that fails nothing runs."""
    x = uid("rtpipe")
    q = uid("rtpipeq")
    q2 = uid("rtpipeq2")
    after = uid("rtafter")
    raw = FrameClient(shared_node.port)
    try:
        raw.open_channel(1)
        raw.sock.sendall(_frames(1, C.Exchange.Declare(exchange=x, exchange_type="direct"), C.Queue.Declare(queue=q)))
        raw.expect(1, C.Exchange.DeclareOk)
        raw.expect(1, C.Queue.DeclareOk)
        keys = [f"k{i}" for i in range(60)]
        # Bind every key, unbind the even ones, bind k0 again: the order decides what is bound.
        # A declare (the node asks no shard, but plans it in a task) and a bind of that queue behind it.
        raw.sock.sendall(_frames(
            1, C.Queue.Declare(queue=q2), C.Queue.Bind(queue=q2, exchange=x, routing_key="to-q2"),
            *(C.Queue.Bind(queue=q, exchange=x, routing_key=k) for k in keys),
            *(C.Queue.Unbind(queue=q, exchange=x, routing_key=k) for k in keys[::2]),
            C.Queue.Bind(queue=q, exchange=x, routing_key="k0")))
        raw.expect(1, C.Queue.DeclareOk)
        for _ in range(1 + len(keys)):
            raw.expect(1, C.Queue.BindOk)
        for _ in keys[::2]:
            raw.expect(1, C.Queue.UnbindOk)
        raw.expect(1, C.Queue.BindOk)
        # A bind that fails (no such exchange) in the middle: what follows it never runs.
        raw.sock.sendall(_frames(
            1, C.Queue.Bind(queue=q, exchange=x, routing_key="before"),
            C.Queue.Bind(queue=q, exchange=uid("rtmissing"), routing_key="k"),
            C.Queue.Bind(queue=q, exchange=x, routing_key="behind"),
            C.Queue.Declare(queue=after),
            C.Queue.Unbind(queue=q, exchange=x, routing_key="k1")))
        raw.expect(1, C.Queue.BindOk)
        assert raw.expect(1, C.Channel.Close).reply_code == 404
        raw.send(1, C.Channel.CloseOk())
    finally:
        raw.close()
    conn = shared_node.connect()
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        routed = {"k0", "before", *keys[1::2]}
        for k in ["before", "behind", *keys]:
            if k in routed:
                ch.basic_publish(x, k, k.encode(), mandatory=True)
            else:
                with pytest.raises(pika.exceptions.UnroutableError):
                    ch.basic_publish(x, k, k.encode(), mandatory=True)
        assert ch.queue_declare(q, passive=True).method.message_count == len(routed)
        ch.basic_publish(x, "to-q2", b"q2", mandatory=True)
        assert ch.queue_declare(q2, passive=True).method.message_count == 1
        assert not exists(conn, after)
        ch = conn.channel()
        ch.queue_delete(q)
        ch.queue_delete(q2)
        ch.exchange_delete(x)
    finally:
        conn.close()
