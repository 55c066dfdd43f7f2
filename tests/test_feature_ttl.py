"""Message TTL and queue expiry on a real node with pika.

TTLs are small (100-300 ms); every wait for the broker to act is a bounded poll.
"""

from __future__ import annotations

import time

import pika

from tests.helpers import WAIT, channel_error, count, get_one, uid, wait_count, wait_queue_gone


def test_queue_ttl_expires_without_a_consumer(ch):
    q = uid()
    ch.queue_declare(q, arguments={"x-message-ttl": 200})
    published = time.monotonic()
    for i in range(5):
        ch.basic_publish("", q, b"x%d" % i)
    n = count(ch, q)
    # All five are there, unless the machine was so slow that the first could have expired meanwhile.
    assert n == 5 or time.monotonic() - published >= 0.2, n
    wait_count(ch, q, 0)


def test_queue_ttl_keeps_fresh_messages(ch):
    q = uid()
    ch.queue_declare(q, arguments={"x-message-ttl": 60_000})
    ch.basic_publish("", q, b"fresh")
    time.sleep(0.3)
    assert count(ch, q) == 1


def test_expired_messages_are_dead_lettered_with_reason_expired(ch):
    dlq = uid("dlq")
    ch.queue_declare(dlq)
    q = uid()
    ch.queue_declare(q, arguments={"x-message-ttl": 100, "x-dead-letter-exchange": "",
                                   "x-dead-letter-routing-key": dlq})
    ch.basic_publish("", q, b"old", pika.BasicProperties(expiration="50"))
    _m, props, body = get_one(ch, dlq)
    assert body == b"old"
    d = props.headers["x-death"][0]
    assert d["reason"] == "expired" and d["queue"] == q
    # The per-message TTL is kept as original-expiration and removed from the message.
    assert d["original-expiration"] == "50"
    assert props.expiration is None
    assert count(ch, q) == 0


def test_per_message_expiration_on_a_plain_queue(ch):
    q = uid()
    ch.queue_declare(q)
    ch.basic_publish("", q, b"short", pika.BasicProperties(expiration="150"))
    ch.basic_publish("", q, b"plain")
    wait_count(ch, q, 1)
    _m, _p, body = get_one(ch, q)
    assert body == b"plain"


def test_per_message_ttl_expires_at_the_head_only(ch):
    """A short per-message TTL behind a long-lived message waits for the head (RabbitMQ semantics)."""
    q = uid()
    ch.queue_declare(q)
    ch.basic_publish("", q, b"long", pika.BasicProperties(expiration="60000"))
    ch.basic_publish("", q, b"short", pika.BasicProperties(expiration="100"))
    time.sleep(0.3)
    assert count(ch, q) == 2
    _m, _p, body = get_one(ch, q)
    assert body == b"long"
    # "short" is at the head now and long past its TTL: gone before it can be fetched.
    wait_count(ch, q, 0)
    assert ch.basic_get(q, auto_ack=True)[0] is None


def test_lower_of_queue_and_message_ttl_applies(ch):
    q = uid()
    ch.queue_declare(q, arguments={"x-message-ttl": 60_000})
    ch.basic_publish("", q, b"m", pika.BasicProperties(expiration="100"))
    wait_count(ch, q, 0)


def test_ttl_zero_expires_without_consumer(ch):
    q = uid()
    ch.queue_declare(q, arguments={"x-message-ttl": 0})
    ch.basic_publish("", q, b"now-or-never")
    wait_count(ch, q, 0)


def test_ttl_zero_is_delivered_to_a_waiting_consumer(conn, ch):
    q = uid()
    ch.queue_declare(q, arguments={"x-message-ttl": 0})
    got = []
    cch = conn.channel()
    cch.basic_consume(q, lambda c, m, p, b: got.append(b), auto_ack=True)
    for i in range(5):
        ch.basic_publish("", q, b"n%d" % i)
    deadline = time.monotonic() + WAIT
    while len(got) < 5:
        assert time.monotonic() < deadline, got
        conn.process_data_events(time_limit=0.05)
    assert got == [b"n%d" % i for i in range(5)]


def test_requeued_message_keeps_its_expiry(ch):
    q = uid()
    ch.queue_declare(q, arguments={"x-message-ttl": 300})
    ch.basic_publish("", q, b"r")
    method, _p, _b = ch.basic_get(q, auto_ack=False)
    assert method is not None
    time.sleep(0.4)
    ch.basic_nack(method.delivery_tag, requeue=True)
    wait_count(ch, q, 0)


def test_x_expires_deletes_an_unused_queue(conn, ch):
    q = uid()
    ch.queue_declare(q, arguments={"x-expires": 200})
    wait_queue_gone(ch, q)
    code, _text = channel_error(conn, lambda c: c.queue_declare(q, passive=True))
    assert code == 404


def test_x_expires_waits_while_a_consumer_is_attached(conn, ch):
    q = uid()
    ch.queue_declare(q, arguments={"x-expires": 150})
    tag = ch.basic_consume(q, lambda *a: None, auto_ack=True)
    time.sleep(0.4)
    assert ch.queue_declare(q, passive=True).method.consumer_count == 1
    ch.basic_cancel(tag)
    wait_queue_gone(ch, q)


def test_ttl_still_applies_after_restart(node):
    conn = node.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    q, dlq = uid(), uid("dlq")
    ch.queue_declare(dlq, durable=True)
    ch.queue_declare(q, durable=True, arguments={"x-message-ttl": 1500, "x-dead-letter-exchange": "",
                                                 "x-dead-letter-routing-key": dlq})
    ch.basic_publish("", q, b"t", pika.BasicProperties(delivery_mode=2))
    p = uid()
    ch.queue_declare(p, durable=True)
    ch.basic_publish("", p, b"p", pika.BasicProperties(delivery_mode=2, expiration="1500"))
    conn.close()
    node.stop()
    time.sleep(1.6)  # both expired while the node was down
    node.start()
    conn = node.connect()
    ch = conn.channel()
    wait_count(ch, q, 0)
    wait_count(ch, p, 0)
    _m, props, body = get_one(ch, dlq)
    assert body == b"t" and props.headers["x-death"][0]["reason"] == "expired"
    conn.close()



def test_expiring_message_behind_a_plain_head_still_expires_after_restart(node):
    """After a restart, a message with a per-message TTL that is not at the head expires when it
    gets there instead of being delivered late (the queue's .expiring marker reopens it with TTL
    handling; its head alone has no expiration)."""
    conn = node.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    q = uid()
    ch.queue_declare(q, durable=True)
    ch.basic_publish("", q, b"head", pika.BasicProperties(delivery_mode=2))
    ch.basic_publish("", q, b"expiring", pika.BasicProperties(delivery_mode=2, expiration="300"))
    ch.basic_publish("", q, b"tail", pika.BasicProperties(delivery_mode=2))
    conn.close()
    node.stop()
    node.start()
    conn = node.connect()
    ch = conn.channel()
    time.sleep(0.4)  # the second message's TTL has passed; the head keeps it from expiring yet
    assert get_one(ch, q)[2] == b"head"
    assert get_one(ch, q)[2] == b"tail"
    wait_count(ch, q, 0)
    conn.close()

def test_policy_message_ttl_and_dead_letter_exchange(node_factory, tmp_path):
    """Policy keys message-ttl / dead-letter-exchange / dead-letter-routing-key apply like arguments,
    also to a queue that existed before the policy (SIGHUP re-reads the definitions file)."""
    import json
    import os
    import signal

    defs = tmp_path / "definitions.json"
    defs.write_text(json.dumps({"policies": []}))
    node = node_factory(frontends=1, shards=2, extra_args=["--definitions", str(defs)])
    conn = node.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare("pol.dead")
    ch.queue_declare("pol.src")
    ch.basic_publish("", "pol.src", b"before")
    defs.write_text(json.dumps({"policies": [{
        "vhost": "/", "name": "ttl", "pattern": r"^pol\.src$", "apply-to": "queues", "priority": 0,
        "definition": {"message-ttl": 100, "dead-letter-exchange": "", "dead-letter-routing-key": "pol.dead"},
    }]}))
    os.kill(node.pid, signal.SIGHUP)
    _m, props, body = get_one(ch, "pol.dead")
    assert body == b"before" and props.headers["x-death"][0]["reason"] == "expired"
    ch.basic_publish("", "pol.src", b"after")
    _m, props, body = get_one(ch, "pol.dead")
    assert body == b"after"
    conn.close()
