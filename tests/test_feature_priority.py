"""Priority queues (x-max-priority) on a real node: order, clamping, requeue, restart, combinations, 406s."""

from __future__ import annotations

import asyncio
import time

import aio_pika
import pika
import pytest
from pika.exceptions import NackError

from tests.helpers import WAIT, channel_error, count, get_one, uid, wait_count


def pq(ch, max_priority: int = 10, **args) -> str:
    q = uid("pq")
    ch.queue_declare(q, durable=True, arguments={"x-max-priority": max_priority, **args})
    return q


def pub(ch, q: str, body: bytes, priority: int | None, **props) -> None:
    ch.basic_publish("", q, body, pika.BasicProperties(priority=priority, delivery_mode=2, **props))


def drain(ch, q: str) -> list[bytes]:
    out = []
    while True:
        method, _props, body = ch.basic_get(q, auto_ack=True)
        if method is None:
            return out
        out.append(body)


def publish_mixed(ch, q: str, prios: list[int | None]) -> list[bytes]:
    """Publish b"i:p" for each priority; returns the bodies in the order RabbitMQ delivers them."""
    for i, p in enumerate(prios):
        pub(ch, q, b"%d:%s" % (i, str(p).encode()), p)
    order = sorted(range(len(prios)), key=lambda i: (-(prios[i] or 0), i))
    return [b"%d:%s" % (i, str(prios[i]).encode()) for i in order]


PRIOS = [0, 3, None, 7, 3, 10, 1, 7, None, 10, 2, 0]


def test_get_highest_priority_first_fifo_within_a_priority(ch):
    q = pq(ch)
    expected = publish_mixed(ch, q, PRIOS)
    assert count(ch, q) == len(PRIOS)  # declare-ok counts every level
    assert drain(ch, q) == expected


def test_consumer_with_prefetch_gets_priority_order(ch):
    q = pq(ch)
    expected = publish_mixed(ch, q, PRIOS)
    ch.basic_qos(prefetch_count=1)
    got = []
    for method, _props, body in ch.consume(q, inactivity_timeout=WAIT):
        assert method is not None, "consumer starved"
        got.append(body)
        # A higher priority published while the consumer works overtakes what is still queued.
        if len(got) == 3:
            pub(ch, q, b"late:10", 10)
            expected.insert(3, b"late:10")
        ch.basic_ack(method.delivery_tag)
        if len(got) == len(expected):
            break
    ch.cancel()
    assert got == expected


def test_priority_above_max_is_max_and_absent_is_zero(ch):
    q = pq(ch, max_priority=5)
    pub(ch, q, b"a:none", None)
    pub(ch, q, b"b:0", 0)
    pub(ch, q, b"c:200", 200)  # treated as 5
    pub(ch, q, b"d:5", 5)
    pub(ch, q, b"e:1", 1)
    pub(ch, q, b"f:6", 6)  # treated as 5
    assert drain(ch, q) == [b"c:200", b"d:5", b"f:6", b"e:1", b"a:none", b"b:0"]


def test_delivered_priority_property_is_unchanged(ch):
    q = pq(ch, max_priority=2)
    pub(ch, q, b"x", 9)
    _m, props, _b = get_one(ch, q)
    assert props.priority == 9  # clamping decides the order only, as in RabbitMQ


def test_requeue_goes_back_ahead_of_newer_of_its_priority(conn, ch):
    q = pq(ch)
    for body, p in ((b"h1", 5), (b"h2", 5), (b"l1", 1)):
        pub(ch, q, body, p)
    m1, _, b1 = get_one(ch, q, auto_ack=False)
    m2, _, b2 = get_one(ch, q, auto_ack=False)
    assert (b1, b2) == (b"h1", b"h2")
    pub(ch, q, b"h3", 5)
    pub(ch, q, b"top", 9)
    ch.basic_nack(m2.delivery_tag, requeue=True)
    ch.basic_reject(m1.delivery_tag, requeue=True)
    got = []
    while len(got) < 5:
        method, _props, body = get_one(ch, q)
        got.append((body, method.redelivered))
    assert got == [(b"top", False), (b"h1", True), (b"h2", True), (b"h3", False), (b"l1", False)]
    # Requeued by a channel close, too.
    pub(ch, q, b"x1", 3)
    pub(ch, q, b"x2", 3)
    other = conn.channel()
    m, _p, body = get_one(other, q, auto_ack=False)
    assert body == b"x1"
    pub(ch, q, b"x3", 3)
    other.close()
    got = [(body, method.redelivered) for method, _p, body in (get_one(ch, q) for _ in range(3))]
    assert got == [(b"x1", True), (b"x2", False), (b"x3", False)]


def test_purge_and_counts_across_levels(ch):
    q = pq(ch)
    publish_mixed(ch, q, PRIOS)
    assert ch.queue_purge(q).method.message_count == len(PRIOS)
    assert count(ch, q) == 0
    pub(ch, q, b"after", 4)
    assert drain(ch, q) == [b"after"]
    assert ch.queue_delete(q).method.message_count == 0


def test_max_priority_declare_errors(conn):
    for value, err in ((256, "{max_value_exceeded,256}"), (-1, "{value_negative,-1}"),
                       ("high", '{unacceptable_type,"expected integer"}')):
        q = uid("bad")
        code, text = channel_error(conn, lambda c, q=q, v=value: c.queue_declare(
            q, arguments={"x-max-priority": v}))
        assert code == 406
        assert text == f"PRECONDITION_FAILED - invalid arg 'x-max-priority' for queue '{q}' in vhost '/': {err}"
    ch = conn.channel()
    q = uid("pq")
    ch.queue_declare(q, arguments={"x-max-priority": 4})
    code, text = channel_error(conn, lambda c: c.queue_declare(q, arguments={"x-max-priority": 5}))
    assert code == 406 and "x-max-priority" in text and "inequivalent arg" in text


def test_max_priority_zero_is_a_one_level_queue(ch):
    # RabbitMQ accepts 0 (check_non_neg_int_arg): every message is treated as priority 0.
    q = pq(ch, max_priority=0)
    pub(ch, q, b"a", 9)
    pub(ch, q, b"b", None)
    pub(ch, q, b"c", 3)
    assert drain(ch, q) == [b"a", b"b", b"c"]


@pytest.mark.parametrize("how", ["graceful", "kill9"])
def test_restart_keeps_messages_and_their_order(node, how):
    conn = node.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    q = pq(ch)
    expected = publish_mixed(ch, q, PRIOS * 3)
    ch.basic_publish("", q, b"transient", pika.BasicProperties(priority=4))  # dropped on restart
    # Take and ack the first two, leave the third unacked (ready again after the restart).
    for _ in range(2):
        m, _p, _b = get_one(ch, q, auto_ack=False)
        ch.basic_ack(m.delivery_tag)
    get_one(ch, q, auto_ack=False)
    if how == "kill9":
        node.kill9()
    else:
        conn.close()
    node.restart()
    conn = node.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    assert count(ch, q) == len(expected) - 2
    assert drain(ch, q) == expected[2:]
    pub(ch, q, b"new:1", 1)
    pub(ch, q, b"new:8", 8)
    assert drain(ch, q) == [b"new:8", b"new:1"]
    conn.close()


def test_ttl_expires_at_the_priority_head(ch):
    dlq = uid("dlq")
    ch.queue_declare(dlq)
    q = pq(ch, **{"x-dead-letter-exchange": "", "x-dead-letter-routing-key": dlq})
    pub(ch, q, b"low-keeps", 1)
    pub(ch, q, b"high-expires", 9, expiration="50")
    method, props, body = get_one(ch, dlq)
    assert body == b"high-expires" and props.headers["x-death"][0]["reason"] == "expired"
    assert count(ch, q) == 1
    # A short TTL behind a higher priority waits for the head, as in RabbitMQ: stuck, never delivered.
    pub(ch, q, b"low-short", 0, expiration="50")
    time.sleep(0.2)
    assert count(ch, dlq) == 0
    assert get_one(ch, q)[2] == b"low-keeps"
    method, _props, body = get_one(ch, dlq)
    assert body == b"low-short"
    assert count(ch, q) == 0


def test_queue_ttl_with_priorities_dead_letters_everything(ch):
    dlq = uid("dlq")
    ch.queue_declare(dlq)
    q = pq(ch, **{"x-message-ttl": 100, "x-dead-letter-exchange": "", "x-dead-letter-routing-key": dlq})
    publish_mixed(ch, q, [1, 5, None, 9])
    wait_count(ch, dlq, 4)
    assert count(ch, q) == 0


def test_max_length_drop_head_drops_the_highest_priority(ch):
    dlq = uid("dlq")
    ch.queue_declare(dlq)
    q = pq(ch, **{"x-max-length": 2, "x-dead-letter-exchange": "", "x-dead-letter-routing-key": dlq})
    pub(ch, q, b"p1", 1)
    pub(ch, q, b"p5", 5)
    pub(ch, q, b"p3", 3)  # over the limit: the head (p5) goes, as RabbitMQ documents
    _m, props, body = get_one(ch, dlq)
    assert body == b"p5" and props.headers["x-death"][0]["reason"] == "maxlen"
    assert drain(ch, q) == [b"p3", b"p1"]


def test_max_length_reject_publish_with_priorities(ch):
    q = pq(ch, **{"x-max-length": 2, "x-overflow": "reject-publish"})
    pub(ch, q, b"a", 1)
    pub(ch, q, b"b", 2)
    with pytest.raises(NackError):
        pub(ch, q, b"c", 9)
    assert drain(ch, q) == [b"b", b"a"]


def test_dead_letter_from_and_into_priority_queues(ch):
    dlq = uid("dlq")
    ch.queue_declare(dlq, arguments={"x-max-priority": 10})
    q = pq(ch, **{"x-dead-letter-exchange": "", "x-dead-letter-routing-key": dlq})
    publish_mixed(ch, q, [1, 8, 4])
    for _ in range(3):
        m, _p, _b = get_one(ch, q, auto_ack=False)
        ch.basic_reject(m.delivery_tag, requeue=False)
    wait_count(ch, dlq, 3)
    _m, props, body = get_one(ch, dlq)
    assert body == b"1:8" and props.priority == 8 and props.headers["x-death"][0]["reason"] == "rejected"
    pub(ch, dlq, b"direct:9", 9)
    assert drain(ch, dlq) == [b"direct:9", b"2:4", b"0:1"]


def test_delivery_limit_with_priorities(ch):
    q = pq(ch, **{"x-delivery-limit": 1})
    pub(ch, q, b"hi", 7)
    pub(ch, q, b"lo", 1)
    for _ in range(2):
        m, _p, body = get_one(ch, q, auto_ack=False)
        assert body == b"hi"
        ch.basic_nack(m.delivery_tag, requeue=True)
    assert drain(ch, q) == [b"lo"]  # "hi" went over the limit and was dropped


def test_aio_pika_consumer_sees_priority_order(shared_node):
    async def run() -> list[bytes]:
        connection = await aio_pika.connect(shared_node.url)
        async with connection:
            channel = await connection.channel(publisher_confirms=True)
            queue = await channel.declare_queue(uid("apq"), arguments={"x-max-priority": 3})
            for i, p in enumerate([0, 1, 2, 3, 2, 1, 0]):
                await channel.default_exchange.publish(aio_pika.Message(b"%d" % i, priority=p),
                                                       routing_key=queue.name)
            await channel.set_qos(prefetch_count=1)
            got = []
            async with queue.iterator() as it:
                async for message in it:
                    async with message.process():
                        got.append(message.body)
                    if len(got) == 7:
                        break
            return got

    assert asyncio.run(asyncio.wait_for(run(), WAIT)) == [b"3", b"2", b"4", b"1", b"5", b"0", b"6"]


def test_per_message_ttl_on_a_priority_queue_without_feature_arguments(ch):
    q = pq(ch)  # only x-max-priority: a plain Queue over a PriorityStore until the expiration arrives
    pub(ch, q, b"keep", 1)
    pub(ch, q, b"gone", 5, expiration="30")
    deadline = time.monotonic() + WAIT
    while count(ch, q) != 1:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert drain(ch, q) == [b"keep"]


def test_ttl_zero_reaches_a_waiting_consumer_or_expires(ch):
    q = pq(ch, **{"x-message-ttl": 0})
    pub(ch, q, b"old-hi", 9)  # nobody consumes: gone at once
    assert count(ch, q) == 0
    ch.basic_qos(prefetch_count=10)
    got = []
    tag = ch.basic_consume(q, lambda c, m, p, b: got.append(b), auto_ack=True)
    pub(ch, q, b"lo", 1)
    pub(ch, q, b"hi", 8)
    deadline = time.monotonic() + WAIT
    while len(got) < 2:
        assert time.monotonic() < deadline, got
        ch.connection.process_data_events(time_limit=0.05)
    ch.basic_cancel(tag)
    assert sorted(got) == [b"hi", b"lo"]


def test_delete_and_redeclare_starts_empty(ch):
    q = pq(ch)
    publish_mixed(ch, q, [1, 2, 3])
    assert ch.queue_delete(q).method.message_count == 3
    ch.queue_declare(q, durable=True, arguments={"x-max-priority": 10})
    assert count(ch, q) == 0
    pub(ch, q, b"fresh", 2)
    assert drain(ch, q) == [b"fresh"]
