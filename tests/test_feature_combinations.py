"""Features that meet: each was built on its own (priority store, streams, delayed exchange,
deduplication, dead-lettering, single active consumer); these tests drive them through each
other on a real node, across both shards and a restart, where the code paths cross."""

from __future__ import annotations

import socket
import time

import pika

from tests.helpers import WAIT, get_one, names_on_different_shards, uid, wait_count

# Queue names are picked per shard by their crc32 (tests/helpers.py): nodes place by name.
QUEUE_PLACEMENT = "hash"

STREAM = {"x-queue-type": "stream"}


def read_stream(conn, q: str, n: int) -> list[tuple[int, bytes, dict]]:
    """The first n messages of stream q from offset 'first': (x-stream-offset, body, headers)."""
    ch = conn.channel()
    ch.basic_qos(prefetch_count=100)
    got: list[tuple[int, bytes, dict]] = []

    def on_message(c, method, props, body):
        got.append((props.headers["x-stream-offset"], body, props.headers))
        c.basic_ack(method.delivery_tag)

    tag = ch.basic_consume(q, on_message, arguments={"x-stream-offset": "first"})
    deadline = time.monotonic() + WAIT
    while len(got) < n:
        assert time.monotonic() < deadline, f"got {len(got)} of {n}"
        conn.process_data_events(time_limit=0.05)
    ch.basic_cancel(tag)
    ch.close()
    return got


def test_delayed_messages_reach_a_priority_queue_and_a_stream_on_both_shards(node):
    conn = node.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    pq, sq = names_on_different_shards(uid("combo"))
    ch.queue_declare(pq, durable=True, arguments={"x-max-priority": 5})
    ch.queue_declare(sq, durable=True, arguments=STREAM)
    x = uid("dx")
    ch.exchange_declare(x, "x-delayed-message", durable=True, arguments={"x-delayed-type": "fanout"})
    ch.queue_bind(pq, x)
    ch.queue_bind(sq, x)
    for body, prio, delay in ((b"low", 1, 300), (b"high", 5, 400), (b"now", 0, 0)):
        ch.basic_publish(x, "", body, pika.BasicProperties(delivery_mode=2, priority=prio,
                                                          headers={"x-delay": delay}))
    wait_count(ch, pq, 3)
    assert [get_one(ch, pq)[2] for _ in range(3)] == [b"high", b"low", b"now"]
    got = read_stream(conn, sq, 3)
    assert [(o, b) for o, b, _h in got] == [(0, b"now"), (1, b"low"), (2, b"high")]
    assert got[1][2]["x-delay"] == -300  # delivered with the delay negated, as RabbitMQ's plugin
    conn.close()


def test_dead_letters_from_a_priority_queue_into_a_stream_survive_a_restart(node):
    conn = node.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    src, log = names_on_different_shards(uid("dl"))
    ch.queue_declare(log, durable=True, arguments=STREAM)
    ch.queue_declare(src, durable=True, arguments={"x-max-priority": 3, "x-dead-letter-exchange": "",
                                                   "x-dead-letter-routing-key": log})
    for body, prio in ((b"a", 0), (b"b", 3), (b"c", 1)):
        ch.basic_publish("", src, body, pika.BasicProperties(delivery_mode=2, priority=prio))
    for _ in range(3):
        method, _props, _body = ch.basic_get(src, auto_ack=False)
        ch.basic_reject(method.delivery_tag, requeue=False)
    got = read_stream(conn, log, 3)
    assert [b for _o, b, _h in got] == [b"b", b"c", b"a"]  # rejected in priority order
    assert got[0][2]["x-death"][0]["reason"] == "rejected"
    conn.close()
    node.restart()
    conn = node.connect()
    assert [(o, b) for o, b, _h in read_stream(conn, log, 3)] == [(0, b"b"), (1, b"c"), (2, b"a")]
    conn.close()


def test_deduplicating_priority_queue(conn):
    ch = conn.channel()
    ch.confirm_delivery()
    q = uid("dp")
    ch.queue_declare(q, arguments={"x-max-priority": 9, "x-message-deduplication": True})

    def publish(body: bytes, key: str, prio: int) -> None:
        ch.basic_publish("", q, body, pika.BasicProperties(priority=prio,
                                                          headers={"x-deduplication-header": key}))

    publish(b"k1-low", "k1", 1)
    publish(b"k1-again-high", "k1", 9)  # a duplicate: dropped whatever its priority
    publish(b"k2-high", "k2", 9)
    wait_count(ch, q, 2)
    assert [get_one(ch, q)[2] for _ in range(2)] == [b"k2-high", b"k1-low"]


def test_single_active_consumer_on_a_priority_queue_hands_over_with_redelivery(node):
    """The active consumer's connection drops with a delivery unacked: that message goes back to its
    priority level before the next consumer is served, so the new active consumer gets it first.
    (A client-side channel.close in pika cancels the consumer first, which hands over before the
    requeue, as in RabbitMQ; a dropped connection does both at once.)"""
    conn = node.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    q = uid("sacp")
    ch.queue_declare(q, arguments={"x-max-priority": 2, "x-single-active-consumer": True})
    for body, prio in ((b"p0", 0), (b"p2", 2)):
        ch.basic_publish("", q, body, pika.BasicProperties(priority=prio))
    got: list[tuple[str, bytes, bool]] = []
    doomed = node.connect()
    first = doomed.channel()
    first.basic_qos(prefetch_count=1)
    first.basic_consume(q, lambda c, m, p, b: got.append(("first", b, m.redelivered)))
    deadline = time.monotonic() + WAIT
    while not got:
        assert time.monotonic() < deadline
        doomed.process_data_events(time_limit=0.05)
    second = conn.channel()
    second.basic_consume(q, lambda c, m, p, b: (got.append(("second", b, m.redelivered)),
                                                c.basic_ack(m.delivery_tag)))
    conn.process_data_events(time_limit=0.3)
    assert got == [("first", b"p2", False)]  # highest first; prefetch 1 holds p0 back; second is idle
    doomed._impl._transport._sock.shutdown(socket.SHUT_RDWR)
    while len(got) < 3:
        assert time.monotonic() < deadline, got
        conn.process_data_events(time_limit=0.05)
    assert got[1:] == [("second", b"p2", True), ("second", b"p0", False)]
    conn.close()
