"""A target's answer to a forward of a shard's earlier life settles nothing in its new life.

A deduplicating exchange's owner shard (0) forwards each publish to the queue's shard (1) with a
token as confirm seq; the tokens restart at 1 with each life of shard 0. Shard 1 stores the first
publish and its CONFIRM is late: shard 0 is killed and restarted before it arrives
(SHARDMQ_TEST_HOLD_PEER_ANSWERS=2 on the node: shard 1 sends its first two answers to other
shards together, shard/peer_answer_hold.py). The new life forwards a second publish with token 1,
which shard 1 refuses (the queue is full, x-overflow reject-publish). Shard 0 gets the old life's
CONFIRM [1] first and then the NACK [1]: taking the CONFIRM as its own acked the publisher for a
message no queue holds (shard/forward_lives.py).
"""

from __future__ import annotations

import time

import pika
import pika.exceptions
import pytest

from broker.dedup import exchange_shard
from tests.helpers import WAIT, count, names_on_different_shards, uid, wait_count

QUEUE_PLACEMENT = "hash"  # names picked per shard (tests/helpers.py)


def _wait_logged(node, text: str, n: int) -> None:
    deadline = time.monotonic() + WAIT
    while node.log_text().count(text) < n:
        assert time.monotonic() < deadline, f"{text!r} not logged {n} times:\n{node.log_tail()}"
        time.sleep(0.02)


def test_a_late_confirm_for_a_killed_shards_forward_does_not_settle_a_forward_of_its_next_life(node_factory):
    node = node_factory(frontends=1, shards=2, env={"SHARDMQ_TEST_HOLD_PEER_ANSWERS": "2"})
    x = next(n for i in range(1000) if exchange_shard("/", n := uid(f"dedup{i}"), 2) == 0)
    q = names_on_different_shards(uid("q"))[1]
    conn = node.connect()
    ch = conn.channel()
    ch.exchange_declare(x, "fanout", durable=True, arguments={"x-message-deduplication": True})
    ch.queue_declare(q, durable=True, arguments={"x-max-length": 1, "x-overflow": "reject-publish"})
    ch.queue_bind(q, x)
    # No confirm mode: the dedup key alone makes the owner ask shard 1 for a CONFIRM (token 1).
    ch.basic_publish(x, "", b"first", pika.BasicProperties(delivery_mode=2,
                                                           headers={"x-deduplication-header": "k1"}))
    wait_count(ch, q, 1)  # stored by shard 1; its CONFIRM is held
    conn.close()

    old = node.kill_worker("shard", 0)
    node.wait_worker_restarted("shard", 0, old)
    _wait_logged(node, "shard 0 (pid", 2)  # "shard 0 (pid N) ready": its new life has loaded

    conn = node.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    # Token 1 of the new life; the queue is full, so shard 1 answers CONFIRM_NACK, behind the held
    # CONFIRM of the old life's token 1.
    with pytest.raises(pika.exceptions.NackError):
        ch.basic_publish(x, "", b"second", pika.BasicProperties(delivery_mode=2,
                                                                headers={"x-deduplication-header": "k2"}))
    assert count(ch, q) == 1
    method, _props, body = ch.basic_get(q, auto_ack=True)
    assert method is not None and body == b"first"
    conn.close()
