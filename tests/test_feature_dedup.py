"""Message deduplication (LavinMQ's x-message-deduplication) on a real node with pika.

Queues: the shard that owns the queue keeps the cache (shard/dedup.py QueueDedup).
Exchanges: the exchange's owner shard keeps it and forwards what is not a duplicate
(shard/dedup.py ExchangeDedup), so retries through another frontend are caught too.
Channels are in confirm mode: ``basic_publish`` returns only once the broker acked.
"""

from __future__ import annotations

import time

import pika
import pytest
from pika.exceptions import NackError

from broker.dedup import exchange_shard
from tests.helpers import (
    channel_error,
    connections_on_two_frontends,
    count,
    names_on_different_shards,
    uid,
    wait_count,
)

# Queue names are picked per shard by their crc32 (tests/helpers.py): nodes place by name.
QUEUE_PLACEMENT = "hash"

DEDUP = {"x-message-deduplication": True}


def props(key=None, header: str = "x-deduplication-header", **extra) -> pika.BasicProperties:
    headers = dict(extra)
    if key is not None:
        headers[header] = key
    return pika.BasicProperties(headers=headers or None)


def bodies(ch, queue: str) -> list[bytes]:
    out = []
    while True:
        method, _props, body = ch.basic_get(queue, auto_ack=True)
        if method is None:
            return out
        out.append(body)


def dedup_queue(ch, **args) -> str:
    q = uid()
    ch.queue_declare(q, arguments={**DEDUP, **args})
    return q


# ----------------------------------------------------------------------------- queues
def test_queue_drops_second_message_with_same_key(ch):
    q = dedup_queue(ch)
    ch.basic_publish("", q, b"first", props("k1"))
    ch.basic_publish("", q, b"dup", props("k1"))  # confirmed (acked), not enqueued
    ch.basic_publish("", q, b"other", props("k2"))
    ch.basic_publish("", q, b"plain-1", props())
    ch.basic_publish("", q, b"plain-2", props())  # no header: never a duplicate
    ch.basic_publish("", q, b"int-1", props(1))
    ch.basic_publish("", q, b"str-1", props("1"))  # another field type is another key
    ch.basic_publish("", q, b"int-dup", props(1))
    assert bodies(ch, q) == [b"first", b"other", b"plain-1", b"plain-2", b"int-1", b"str-1"]


def test_plain_queue_ignores_the_header(ch):
    q = uid()
    ch.queue_declare(q, arguments={"x-message-deduplication": False, "x-cache-size": 1})
    ch.basic_publish("", q, b"a", props("k"))
    ch.basic_publish("", q, b"b", props("k"))
    assert count(ch, q) == 2


def test_cache_size_evicts_the_oldest_key(ch):
    q = dedup_queue(ch, **{"x-cache-size": 2})
    for body, key in ((b"a", "a"), (b"b", "b"), (b"c", "c"),  # c evicts a
                      (b"a-again", "a"),  # passes, evicts b (FIFO: hits do not refresh)
                      (b"c-dup", "c"), (b"b-again", "b")):
        ch.basic_publish("", q, body, props(key))
    assert bodies(ch, q) == [b"a", b"b", b"c", b"a-again", b"b-again"]


def publish_until_accepted(ch, q: str, properties, ttl_s: float) -> float:
    """Publish the same key until the queue holds 2 messages; the time that took."""
    start = time.monotonic()
    ch.basic_publish("", q, b"first", properties)
    while count(ch, q) < 2:
        assert time.monotonic() - start < ttl_s + 10, "the key never expired"
        ch.basic_publish("", q, b"retry", properties)
        time.sleep(0.02)
    return time.monotonic() - start


def test_cache_ttl_argument_expires_keys(ch):
    q = dedup_queue(ch, **{"x-cache-ttl": 300})
    took = publish_until_accepted(ch, q, props("k"), 0.3)
    assert took >= 0.3  # a duplicate within the ttl was dropped
    assert bodies(ch, q) == [b"first", b"retry"]


def test_per_message_cache_ttl_header_overrides(ch):
    q = dedup_queue(ch, **{"x-cache-ttl": 3_600_000})
    took = publish_until_accepted(ch, q, props("k", **{"x-cache-ttl": 300}), 0.3)
    assert took >= 0.3
    # A key remembered with the queue's hour-long ttl is still a duplicate.
    ch.basic_publish("", q, b"long", props("long"))
    ch.basic_publish("", q, b"long-dup", props("long"))
    assert bodies(ch, q) == [b"first", b"retry", b"long"]


def test_deduplication_header_argument_names_the_key_header(ch):
    q = dedup_queue(ch, **{"x-deduplication-header": "msg-id"})
    ch.basic_publish("", q, b"a", props("1", header="msg-id"))
    ch.basic_publish("", q, b"a-dup", props("1", header="msg-id", **{"x-deduplication-header": "x"}))
    ch.basic_publish("", q, b"default-1", props("same"))  # the default header is not looked at
    ch.basic_publish("", q, b"default-2", props("same"))
    assert bodies(ch, q) == [b"a", b"default-1", b"default-2"]


@pytest.mark.parametrize(("args", "text"), [
    ({"x-message-deduplication": "yes"}, "x-message-deduplication header not a Bool"),
    ({**DEDUP, "x-cache-size": "big"}, "x-cache-size header not a Int"),
    ({**DEDUP, "x-cache-size": 0}, "x-cache-size must be between 1 and"),
    ({**DEDUP, "x-cache-ttl": -1}, "x-cache-ttl must be between 0 and"),
    ({**DEDUP, "x-cache-ttl": "1s"}, "x-cache-ttl header not a Int"),
    ({**DEDUP, "x-deduplication-header": 5}, "x-deduplication-header header not a String"),
])
def test_invalid_arguments_are_refused_with_406(conn, args, text):
    q = uid()
    code, reply = channel_error(conn, lambda c: c.queue_declare(q, arguments=args))
    assert code == 406 and text in reply and q in reply, reply
    x = uid("x")
    code, reply = channel_error(conn, lambda c: c.exchange_declare(x, "fanout", arguments=args))
    assert code == 406 and text in reply and x in reply, reply


def test_redeclare_with_other_cache_settings_is_refused(conn, ch):
    q = dedup_queue(ch, **{"x-cache-size": 10})
    ch.queue_declare(q, arguments={**DEDUP, "x-cache-size": 10})  # equivalent: fine
    code, reply = channel_error(conn, lambda c: c.queue_declare(q, arguments={**DEDUP, "x-cache-size": 11}))
    assert code == 406 and "inequivalent arg 'x-cache-size'" in reply
    x = uid("x")
    ch.exchange_declare(x, "fanout", arguments=DEDUP)
    code, reply = channel_error(conn, lambda c: c.exchange_declare(x, "fanout"))
    assert code == 406 and "inequivalent arg 'x-message-deduplication'" in reply


def test_dead_letters_from_another_shard_are_deduplicated(ch):
    src, dst = names_on_different_shards(uid("dl"))
    ch.queue_declare(dst, arguments=DEDUP)
    ch.queue_declare(src, arguments={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": dst})
    for body in (b"one", b"two", b"three"):
        ch.basic_publish("", src, body, props("same"))
    ch.basic_publish("", src, b"four", props("other"))
    for _ in range(4):
        method, _p, _b = ch.basic_get(src)
        ch.basic_reject(method.delivery_tag, requeue=False)
    wait_count(ch, dst, 2)
    assert bodies(ch, dst) == [b"one", b"four"]


# -------------------------------------------------------------------------- exchanges
def dedup_exchange(ch, queues: list[str], kind: str = "fanout", x: str | None = None, **args) -> str:
    x = x or uid("x")
    ch.exchange_declare(x, kind, arguments={**DEDUP, **args})
    for q in queues:
        ch.queue_declare(q)
        ch.queue_bind(q, x, routing_key="rk")
    return x


def test_exchange_drops_duplicates_before_routing_to_queues_on_both_shards(ch):
    queues = names_on_different_shards(uid("xq")) + names_on_different_shards(uid("xq"))
    x = dedup_exchange(ch, queues, "direct")
    ch.basic_publish(x, "rk", b"m1", props("k1"))
    ch.basic_publish(x, "rk", b"m1-dup", props("k1"))
    ch.basic_publish(x, "rk", b"m2", props("k2"))
    ch.basic_publish(x, "rk", b"plain", props())
    ch.basic_publish(x, "rk", b"plain", props())
    ch.basic_publish(x, "other-rk", b"unroutable", props("k3"))  # confirmed, nowhere to go
    for q in queues:
        assert bodies(ch, q) == [b"m1", b"m2", b"plain", b"plain"], q


def test_exchange_dedup_across_frontends(node):
    a, b = connections_on_two_frontends(node)
    cha, chb = a.channel(), b.channel()
    cha.confirm_delivery()
    chb.confirm_delivery()
    queues = names_on_different_shards(uid("fq"))
    x = dedup_exchange(cha, queues, **{"x-cache-ttl": 60_000})
    cha.basic_publish(x, "rk", b"k1-a", props("k1"))
    chb.basic_publish(x, "rk", b"k1-b", props("k1"))  # a retry through the other frontend
    chb.basic_publish(x, "rk", b"k2-b", props("k2"))
    cha.basic_publish(x, "rk", b"k2-a", props("k2"))
    for q in queues:
        assert bodies(cha, q) == [b"k1-a", b"k2-b"], q
    a.close()
    b.close()


def test_exchange_dedup_keeps_order_without_confirms(node):
    connection = node.connect()
    ch = connection.channel()
    queues = names_on_different_shards(uid("oq"))
    x = dedup_exchange(ch, queues, **{"x-cache-size": 1000})
    expected = []
    seen = set()
    for i in range(300):
        key = f"k{i // 2}" if i % 3 else None  # duplicates, unique keys and no key interleaved
        ch.basic_publish(x, "rk", b"%d" % i, props(key))
        if key is None or key not in seen:
            expected.append(b"%d" % i)
            seen.add(key)
    for q in queues:
        wait_count(ch, q, len(expected))
        assert bodies(ch, q) == expected, q
    connection.close()


def test_restart_forgets_the_caches(node):
    """As LavinMQ's, the caches live in memory: after a restart a key is accepted once more."""
    connection = node.connect()
    ch = connection.channel()
    ch.confirm_delivery()
    q = uid()
    ch.queue_declare(q, durable=True, arguments=DEDUP)
    xqs = names_on_different_shards(uid("rq"))
    x = uid("x")
    ch.exchange_declare(x, "fanout", durable=True, arguments=DEDUP)
    for xq in xqs:
        ch.queue_declare(xq, durable=True)
        ch.queue_bind(xq, x)
    persistent = {"delivery_mode": 2, "headers": {"x-deduplication-header": "k"}}
    for _ in range(2):
        ch.basic_publish("", q, b"before", pika.BasicProperties(**persistent))
        ch.basic_publish(x, "", b"before", pika.BasicProperties(**persistent))
    connection.close()
    node.restart()
    connection = node.connect()
    ch = connection.channel()
    ch.confirm_delivery()
    for _ in range(2):
        ch.basic_publish("", q, b"after", pika.BasicProperties(**persistent))
        ch.basic_publish(x, "", b"after", pika.BasicProperties(**persistent))
    for name in [q, *xqs]:
        assert bodies(ch, name) == [b"before", b"after"], name
    connection.close()


def test_dead_letters_to_a_dedup_exchange_are_deduplicated(ch):
    queues = names_on_different_shards(uid("dq"))
    x = dedup_exchange(ch, queues)
    src = uid()
    ch.queue_declare(src, arguments={"x-dead-letter-exchange": x})
    for body, key in ((b"one", "same"), (b"two", "same"), (b"three", "other"), (b"four", None)):
        ch.basic_publish("", src, body, props(key))
    for _ in range(4):
        method, _p, _b = ch.basic_get(src)
        ch.basic_reject(method.delivery_tag, requeue=False)
    for q in queues:
        wait_count(ch, q, 3)
        assert bodies(ch, q) == [b"one", b"three", b"four"], q


def test_owner_keeps_its_cache_when_another_shard_restarts(node):
    x = next(n for i in range(100) if exchange_shard("/", n := f"x-owner-{i}", 2) == 0)
    queues = names_on_different_shards(uid("sq"))
    connection = node.connect()
    ch = connection.channel()
    ch.confirm_delivery()
    dedup_exchange(ch, queues, x=x)
    ch.basic_publish(x, "rk", b"k1", props("k1"))
    connection.close()
    old = node.kill_worker("shard", 1)
    node.wait_worker_restarted("shard", 1, old)
    # Until the owner and the frontends have seen shard 1's new epoch, publishes may be nacked
    # (the owner nacks what the restarted shard never confirmed) or the connection refused.
    deadline = time.monotonic() + 20
    while True:
        assert time.monotonic() < deadline, "shard 1 never took publishes again"
        connection = None
        try:
            connection = node.connect()
            ch = connection.channel()
            ch.confirm_delivery()
            ch.basic_publish(x, "rk", b"probe", props())
            if count(ch, queues[1]) > 0:
                break
        except (pika.exceptions.AMQPError, NackError):
            pass
        if connection is not None and connection.is_open:
            connection.close()
        time.sleep(0.1)
    for q in queues:
        bodies(ch, q)
    ch.basic_publish(x, "rk", b"k1-again", props("k1"))  # the owner (shard 0) still remembers k1
    ch.basic_publish(x, "rk", b"k2", props("k2"))
    for q in queues:
        assert bodies(ch, q) == [b"k2"], q
    connection.close()


def test_a_nacked_message_leaves_the_cache_so_its_retry_passes(ch):
    full = {"x-max-length": 1, "x-overflow": "reject-publish"}
    # Queue level: a message refused by reject-publish is not remembered.
    q = dedup_queue(ch, **full)
    ch.basic_publish("", q, b"m1", props("k1"))
    with pytest.raises(NackError):
        ch.basic_publish("", q, b"m2", props("k2"))
    ch.queue_purge(q)
    ch.basic_publish("", q, b"m2-retry", props("k2"))
    assert bodies(ch, q) == [b"m2-retry"]
    # Exchange level: one refusing queue nacks the message; the owner forgets its key.
    roomy, tight = names_on_different_shards(uid("nq"))
    x = dedup_exchange(ch, [roomy])
    ch.queue_declare(tight, arguments=full)
    ch.queue_bind(tight, x)
    ch.basic_publish(x, "rk", b"m1", props("k1"))
    with pytest.raises(NackError):
        ch.basic_publish(x, "rk", b"m2", props("k2"))
    ch.queue_purge(tight)
    ch.basic_publish(x, "rk", b"m2-retry", props("k2"))
    with pytest.raises(NackError):  # tight is full again; k1 is still remembered, so no nack for it
        ch.basic_publish(x, "rk", b"m3", props("k3"))
    ch.basic_publish(x, "rk", b"m1-dup", props("k1"))
    assert bodies(ch, tight) == [b"m2-retry"]
    assert bodies(ch, roomy) == [b"m1", b"m2", b"m2-retry", b"m3"]


def test_exchange_remembers_the_key_of_an_unroutable_message(ch):
    """RabbitMQ's deduplication exchange caches the key before routing: an unroutable message's
    retry is still a duplicate once a queue is bound (and a mandatory one is returned)."""
    x = uid("x")
    ch.exchange_declare(x, "direct", arguments=DEDUP)
    with pytest.raises(pika.exceptions.UnroutableError):
        ch.basic_publish(x, "rk", b"first", props("k1"), mandatory=True)
    ch.basic_publish(x, "rk", b"nowhere", props("k2"))  # confirmed, nowhere to go, key kept
    q = uid("xq")
    ch.queue_declare(q)
    ch.queue_bind(q, x, routing_key="rk")
    ch.basic_publish(x, "rk", b"retry-1", props("k1"))
    ch.basic_publish(x, "rk", b"retry-2", props("k2"))
    ch.basic_publish(x, "rk", b"new", props("k3"))
    assert bodies(ch, q) == [b"new"]


def test_a_mandatory_duplicate_is_returned_before_its_confirm(ch):
    """A duplicate routes nowhere: a mandatory one comes back as basic.return (NO_ROUTE), as from
    RabbitMQ's deduplication exchange; a non-mandatory one is confirmed and dropped."""
    q = uid("xq")
    x = dedup_exchange(ch, [q], "direct")
    ch.basic_publish(x, "rk", b"first", props("k1"), mandatory=True)
    with pytest.raises(pika.exceptions.UnroutableError) as returned:
        ch.basic_publish(x, "rk", b"again", props("k1"), mandatory=True)
    [message] = returned.value.messages
    assert (message.method.reply_code, message.method.reply_text, message.body) == (312, "NO_ROUTE", b"again")
    ch.basic_publish(x, "rk", b"quiet-dup", props("k1"))
    assert bodies(ch, q) == [b"first"]
