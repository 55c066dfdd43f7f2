"""A channel's basic.ack before its basic.publish stays before it at the shard (real node, pika).

Acks travel a frontend's control lane, publishes its publish lane, and the shard reads the two
lanes of a frontend in no fixed order. RabbitMQ handles a channel's methods in order, so a
consumer at its prefetch limit that acks and then publishes to the same queue is free again when
that message is routed. Here the publish-lane batch carries how many control-lane items the
frontend had put before it, and the shard handles it only after those (docs/architecture.md).

Setup for the race: the queue's shard is frozen (SIGSTOP) while thousands of acks of another
channel of the same connection, for a queue on the same shard, fill the control lane ahead of our
ack (several batches of at most 512 items), and the publish lane holds just the one publish. Read
fairly from both lanes once the shard runs again, the publish used to overtake the ack. (The pause
before SIGCONT only lets the frontend pass everything on, which the failure without the ordering
needs; with it the test passes however long the frontend takes.)
"""

from __future__ import annotations

import os
import signal

from broker.definitions import queue_shard
from tests.harness import pumping, wait_until
from tests.helpers import WAIT, same_shard_name, uid, wait_count

# Queue names are picked per shard by their crc32 (tests/helpers.py): nodes place by name.
QUEUE_PLACEMENT = "hash"

BACKLOG = 4000


def test_ack_then_publish_on_one_channel_is_handled_in_that_order(node):
    conn = node.connect()
    q = uid("lane")
    busy = same_shard_name(q, prefix="busy")
    setup = conn.channel()
    setup.queue_declare(q)
    setup.queue_declare(busy)
    for i in range(BACKLOG):
        setup.basic_publish("", busy, b"b%d" % i)
    wait_count(setup, busy, BACKLOG)

    got: list[tuple[str, bytes, int]] = []

    def into(name):
        return lambda _ch, method, _p, body: got.append((name, body, method.delivery_tag))

    high = conn.channel()
    high.basic_qos(prefetch_count=1)
    high.basic_consume(q, into("high"), arguments={"x-priority": 10})
    low = conn.channel()
    low.basic_consume(q, into("low"), auto_ack=True)  # takes whatever the high one cannot
    acker = conn.channel()
    busy_tags: list[int] = []
    acker.basic_consume(busy, lambda _ch, method, _p, _b: busy_tags.append(method.delivery_tag))

    def wait_for(predicate, what: str) -> None:
        wait_until(predicate, WAIT, what, pause=pumping(conn),
                   context=lambda: f"{got[-5:]}, {len(busy_tags)} busy deliveries")

    wait_for(lambda: len(busy_tags) == BACKLOG, "backlog delivered")
    high.basic_publish("", q, b"first")
    wait_for(lambda: got and got[-1][1] == b"first", "first delivered")
    assert got[-1][0] == "high"  # room for one: it is blocked now
    shard = node.worker_pid("shard", queue_shard("/", q, node.shards))
    os.kill(shard, signal.SIGSTOP)
    try:
        for t in busy_tags:  # the control lane fills up ahead of the ack below
            acker.basic_ack(t)
        high.basic_ack(got[-1][2])
        high.basic_publish("", q, b"second")
        conn.process_data_events(time_limit=0.5)
    finally:
        os.kill(shard, signal.SIGCONT)
    wait_for(lambda: got[-1][1] == b"second", "second delivered")
    # The ack came first on that channel: the high consumer had room again.
    assert got[-1][0] == "high", got[-3:]
    wait_count(setup, busy, 0)
    conn.close()
