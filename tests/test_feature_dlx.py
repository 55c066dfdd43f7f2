"""Dead-lettering on a real node with pika: reasons, x-death, routing, cycles, other shards, restart.

The node has 2 shards; queue names are chosen so that source and dead-letter
queues land on different shards where the test says so (placement is
crc32(vhost NUL name) % shards, broker.definitions.queue_shard).
"""

from __future__ import annotations

import time

import pika
import pytest

from broker.definitions import queue_shard
from tests.helpers import WAIT, count, get_one, uid, wait_count

# Queue names are picked per shard by their crc32 (tests/helpers.py): nodes place by name.
QUEUE_PLACEMENT = "hash"


def uid_on(shard: int, prefix: str = "q", shards: int = 2) -> str:
    while True:
        name = uid(prefix)
        if queue_shard("/", name, shards) == shard:
            return name


def dlx_pair(ch, *, source_shard: int | None = None, dl_shard: int | None = None, **source_args):
    """A fanout DLX bound to a dead-letter queue, and a source queue using it."""
    dlx = uid("dlx")
    ch.exchange_declare(dlx, "fanout", auto_delete=False)
    dlq = uid_on(dl_shard) if dl_shard is not None else uid("dlq")
    ch.queue_declare(dlq)
    ch.queue_bind(dlq, dlx)
    src = uid_on(source_shard) if source_shard is not None else uid("src")
    ch.queue_declare(src, arguments={"x-dead-letter-exchange": dlx, **source_args})
    return src, dlx, dlq


def test_reject_without_requeue_dead_letters_with_x_death(ch):
    src, dlx, dlq = dlx_pair(ch)
    ch.basic_publish("", src, b"m1", pika.BasicProperties(headers={"app": "yes"}, message_id="id-1"))
    method, _props, _body = get_one_unacked(ch, src)
    ch.basic_reject(method.delivery_tag, requeue=False)
    method, props, body = get_one(ch, dlq)
    assert body == b"m1"
    assert props.message_id == "id-1" and props.headers["app"] == "yes"
    assert method.exchange == dlx and method.routing_key == src
    death = props.headers["x-death"]
    assert len(death) == 1
    d = death[0]
    assert d["count"] == 1 and d["reason"] == "rejected" and d["queue"] == src and d["exchange"] == ""
    assert d["routing-keys"] == [src]
    assert abs(d["time"].timestamp() - time.time()) < 60
    assert "original-expiration" not in d
    h = props.headers
    assert (h["x-first-death-reason"], h["x-first-death-queue"], h["x-first-death-exchange"]) == ("rejected", src, "")
    assert (h["x-last-death-reason"], h["x-last-death-queue"]) == ("rejected", src)
    assert count(ch, src) == 0


def get_one_unacked(ch, queue: str):
    return get_one(ch, queue, auto_ack=False)


def test_nack_requeue_true_does_not_dead_letter(ch):
    src, _dlx, dlq = dlx_pair(ch)
    ch.basic_publish("", src, b"m")
    method, _p, _b = get_one_unacked(ch, src)
    ch.basic_nack(method.delivery_tag, requeue=True)
    method, _p, body = get_one(ch, src)
    assert method.redelivered and body == b"m"
    assert count(ch, dlq) == 0


def test_dead_letter_routing_key_replaces_the_routing_key(ch):
    dlx = uid("dlx")
    ch.exchange_declare(dlx, "direct")
    dlq = uid("dlq")
    ch.queue_declare(dlq)
    ch.queue_bind(dlq, dlx, routing_key="dead")
    src = uid("src")
    ch.queue_declare(src, arguments={"x-dead-letter-exchange": dlx, "x-dead-letter-routing-key": "dead"})
    ch.basic_publish("", src, b"x")
    method, _p, _b = get_one_unacked(ch, src)
    ch.basic_nack(method.delivery_tag, requeue=False)
    method, props, body = get_one(ch, dlq)
    assert body == b"x" and method.routing_key == "dead"
    assert props.headers["x-death"][0]["routing-keys"] == [src]


def test_default_exchange_as_dlx_routes_by_original_key_and_cc(ch):
    """x-dead-letter-exchange "" with no routing key: routed by the original key and CC keys."""
    dlq1, dlq2 = uid("dlq"), uid("dlq")
    ch.queue_declare(dlq1)
    ch.queue_declare(dlq2)
    x = uid("x")
    ch.exchange_declare(x, "direct")
    src = uid("src")
    ch.queue_declare(src, arguments={"x-dead-letter-exchange": "", "x-message-ttl": 0})
    ch.queue_bind(src, x, routing_key=dlq1)
    ch.queue_bind(src, x, routing_key=dlq2)
    # Reaches src through dlq1's key (and CC dlq2's, deduplicated); expires at once (TTL 0, no consumer).
    ch.basic_publish(x, dlq1, b"cc", pika.BasicProperties(headers={"CC": [dlq2]}))
    for q in (dlq1, dlq2):
        _m, props, body = get_one(ch, q)
        assert body == b"cc"
        assert props.headers["x-death"][0]["routing-keys"] == [dlq1, dlq2]
        assert props.headers["x-death"][0]["reason"] == "expired"


@pytest.mark.parametrize("placement", [(0, 1), (1, 0), (0, 0)], ids=["0to1", "1to0", "same"])
def test_dead_letters_cross_shards(ch, placement):
    src, _dlx, dlq = dlx_pair(ch, source_shard=placement[0], dl_shard=placement[1])
    for i in range(20):
        ch.basic_publish("", src, f"m{i}".encode())
    for _ in range(20):
        method, _p, _b = get_one_unacked(ch, src)
        ch.basic_reject(method.delivery_tag, requeue=False)
    bodies = [get_one(ch, dlq)[2] for _ in range(20)]
    assert bodies == [f"m{i}".encode() for i in range(20)]


@pytest.mark.parametrize("target_shard", [1, 0], ids=["other-shard", "same-shard"])
def test_a_dead_letter_a_full_queue_refused_goes_again_to_it_alone(ch, target_shard):
    """A dead letter to two queues of another shard (or of its own), one of them full (x-max-length
    1, x-overflow reject-publish): the refusing queue gets it once it has room, the other holds one
    copy only (a retry of the whole forward put another in it each time). On its own shard the full
    queue used to drop it (at most once) where another shard's was retried (at least once, as
    RabbitMQ's at-least-once dead-lettering retries a target that rejects): now both retry."""
    dlx = uid("dlx")
    ch.exchange_declare(dlx, "fanout", auto_delete=False)
    full = uid_on(target_shard, "full")
    ch.queue_declare(full, arguments={"x-max-length": 1, "x-overflow": "reject-publish"})
    ch.queue_bind(full, dlx)
    side = uid_on(target_shard, "side")
    ch.queue_declare(side)
    ch.queue_bind(side, dlx)
    src = uid_on(0, "src")
    ch.queue_declare(src, arguments={"x-dead-letter-exchange": dlx})
    ch.basic_publish("", full, b"filler")
    ch.basic_publish("", src, b"m")
    method, _p, _b = get_one_unacked(ch, src)
    ch.basic_reject(method.delivery_tag, requeue=False)
    wait_count(ch, side, 1)  # forwarded: the full queue refused it
    assert count(ch, full) == 1
    assert get_one(ch, full)[2] == b"filler"
    assert get_one(ch, full)[2] == b"m"  # sent again while it waited, taken now
    assert count(ch, side) == 1


def test_missing_dlx_drops_the_message(ch):
    src = uid("src")
    ch.queue_declare(src, arguments={"x-dead-letter-exchange": uid("nonexistent")})
    ch.basic_publish("", src, b"gone")
    method, _p, _b = get_one_unacked(ch, src)
    ch.basic_reject(method.delivery_tag, requeue=False)
    assert count(ch, src) == 0


def test_x_death_count_increments_and_moves_to_front(ch):
    """Reject in A, dead-letter to B, reject in B back to A, reject in A again: A/rejected count 2, first."""
    a, b = uid("a"), uid("b")
    ch.queue_declare(a, arguments={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": b})
    ch.queue_declare(b, arguments={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": a})
    ch.basic_publish("", a, b"loop")
    for q in (a, b, a):
        method, _p, _b = get_one_unacked(ch, q)
        ch.basic_reject(method.delivery_tag, requeue=False)
    _m, props, body = get_one(ch, b)
    deaths = props.headers["x-death"]
    assert [(d["queue"], d["reason"], d["count"]) for d in deaths] == [(a, "rejected", 2), (b, "rejected", 1)]
    assert props.headers["x-first-death-queue"] == a
    assert props.headers["x-last-death-queue"] == a


def test_expired_cycle_is_dropped(ch):
    """A -> B -> A by TTL with no rejection: RabbitMQ drops it on the way back into A."""
    a, b = uid("a"), uid("b")
    ch.queue_declare(a, arguments={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": b,
                                   "x-message-ttl": 50})
    ch.queue_declare(b, arguments={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": a,
                                   "x-message-ttl": 50})
    ch.basic_publish("", a, b"cyc")
    deadline = time.monotonic() + WAIT
    while count(ch, a) + count(ch, b):
        assert time.monotonic() < deadline, "the cycling message was never dropped"
        time.sleep(0.05)
    time.sleep(0.2)  # one more round would have put it back
    assert count(ch, a) + count(ch, b) == 0


def test_self_dead_letter_after_reject_is_not_a_cycle(ch):
    """Dead-lettered back into the same queue after a client reject: kept (a client was involved)."""
    a = uid("a")
    ch.queue_declare(a, arguments={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": a})
    ch.basic_publish("", a, b"again")
    method, _p, _b = get_one_unacked(ch, a)
    ch.basic_reject(method.delivery_tag, requeue=False)
    _m, props, body = get_one(ch, a)
    assert body == b"again" and props.headers["x-death"][0]["reason"] == "rejected"


def test_dead_lettered_message_survives_restart_with_x_death(node):
    conn = node.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    dlq = uid_on(1, "dlq")
    ch.queue_declare(dlq, durable=True)
    src = uid_on(0, "src")
    ch.queue_declare(src, durable=True, arguments={"x-dead-letter-exchange": "",
                                                    "x-dead-letter-routing-key": dlq})
    ch.basic_publish("", src, b"keep", pika.BasicProperties(delivery_mode=2))
    method, _p, _b = get_one_unacked(ch, src)
    ch.basic_reject(method.delivery_tag, requeue=False)
    deadline = time.monotonic() + WAIT
    while count(ch, dlq) != 1:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    conn.close()
    node.restart()
    conn = node.connect()
    ch = conn.channel()
    _m, props, body = get_one(ch, dlq)
    assert body == b"keep" and props.delivery_mode == 2
    assert props.headers["x-death"][0]["queue"] == src
    conn.close()


def test_dead_letters_to_a_restarting_shard_are_sent_again_until_confirmed(node_factory):
    """Cross-shard dead letters carry peer confirms: the ones sent while the target shard is
    down or restarting (dropped there by epoch) are sent again once it is ready; none is lost."""
    # --colocate off: the test's connection stays open while shard 1 is killed, on whichever frontend.
    node = node_factory(name="node", frontends=2, shards=2, extra_args=["--colocate", "off"])
    conn = node.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    source, _dlx, target = dlx_pair(ch, source_shard=0, dl_shard=1, **{"x-message-ttl": 30})
    ch.queue_declare(target, passive=True)
    old = node.kill_worker("shard", 1)
    n = 200
    for i in range(n):  # each expires after 30 ms and is dead-lettered towards the dead shard
        ch.basic_publish("", source, b"m%d" % i, pika.BasicProperties(delivery_mode=2))
    node.wait_worker_restarted("shard", 1, old)
    deadline = time.monotonic() + WAIT
    while True:
        try:
            probe = node.connect()
            try:
                got = count(probe.channel(), target)
            finally:
                probe.close()
        except pika.exceptions.AMQPError:
            got = -1  # the restarted shard is not serving yet
        if got >= n:
            break
        assert time.monotonic() < deadline, f"{got} of {n} dead letters reached the restarted shard"
        time.sleep(0.1)
    conn.close()
    conn = node.connect()
    ch = conn.channel()
    bodies = []
    while (got_one := ch.basic_get(target, auto_ack=True))[0] is not None:
        bodies.append(got_one[2])
    # at least once: one the old incarnation stored but had not confirmed may come twice
    assert set(bodies) == {b"m%d" % i for i in range(n)}
    conn.close()
