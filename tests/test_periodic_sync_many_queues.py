"""The periodic sync with many queues of which few are written: it visits only the stores that noted
themselves dirty (shard/dirty_stores.py), and what was confirmed or acked on those few survives a
kill -9 of the shards, while the idle ones stay as they were.

Every test node checks each periodic pass against a walk of every store (SHARDMQ_TEST_WALK_CHECK,
shard/walk_check.py; tests/conftest.py fails the test on a dirty store the pass did not visit): the
writes below (confirmed persistent publishes, transient ones no confirm waits for, acks, a priority
queue's levels, a stream) are what that check sees while the passes run.
"""

from __future__ import annotations

import time

import pika

from tests.harness import pumping, wait_until
from tests.helpers import control_lane_barrier, names_on_different_shards, uid
from tests.test_worker_crash import connect_retry

# Queue names are picked per shard by their crc32 (tests/helpers.py): nodes place by name.
QUEUE_PLACEMENT = "hash"
IDLE = 600
PERSISTENT = pika.BasicProperties(delivery_mode=2)
TRANSIENT = pika.BasicProperties(delivery_mode=1)
PERIODIC_S = 1.0  # shard/worker.py _PERIODIC_SYNC_S


def _count(ch, q: str) -> int:
    return ch.queue_declare(q, passive=True).method.message_count


def test_confirmed_and_acked_on_a_few_of_many_queues_survive_a_shard_kill(node_factory):
    node = node_factory(frontends=1, shards=2)
    prefix = uid("many")
    idle = [f"{prefix}-idle-{i}" for i in range(IDLE)]
    written = names_on_different_shards(prefix + "-w1") + names_on_different_shards(prefix + "-w2")
    acked = written[:2]  # one on each shard
    prio = names_on_different_shards(prefix + "-prio")
    stream = names_on_different_shards(prefix + "-stream")[:1]
    conn = node.connect()
    ch = conn.channel()
    for q in idle + written:
        ch.queue_declare(q, durable=True)
    for q in prio:
        ch.queue_declare(q, durable=True, arguments={"x-max-priority": 5})
    ch.queue_declare(stream[0], durable=True, arguments={"x-queue-type": "stream"})
    ch.confirm_delivery()
    for q in written + prio + stream:
        for i in range(20):
            ch.basic_publish("", q, b"%d" % i, pika.BasicProperties(delivery_mode=2, priority=i % 6))
    # Transient messages no confirm waits for: only the periodic sync looks at these stores.
    # The first ones create the segment file (a directory change); after a periodic pass has synced
    # that, the next ones are appends to a clean store: only its append notes it.
    tch = conn.channel()
    for q in idle[:3]:
        for i in range(5):
            tch.basic_publish("", q, b"t%d" % i, TRANSIENT)
    for q in idle[:3]:
        wait_until(lambda q=q: _count(ch, q) == 5, 10, f"transient messages in {q}")
    time.sleep(1.5 * PERIODIC_S)
    for q in idle[:3]:
        for i in range(5, 10):
            tch.basic_publish("", q, b"t%d" % i, TRANSIENT)
    # Consume and ack the first 10 of two queues, and leave 5 more of each unacked.
    cons = conn.channel()
    cons.basic_qos(prefetch_count=15)
    got: dict[str, list] = {q: [] for q in acked}
    tags = [cons.basic_consume(q, lambda _c, m, _p, b, q=q: got[q].append((m.delivery_tag, b))) for q in acked]
    wait_until(lambda: all(len(v) >= 15 for v in got.values()), 10, "15 deliveries from each queue",
               pause=pumping(conn), context=lambda: str({q: len(v) for q, v in got.items()}))
    for tag in tags:  # no more deliveries: the acks below free no prefetch for 15..19
        cons.basic_cancel(tag)
    for q in acked:
        assert [b for _t, b in got[q]] == [b"%d" % i for i in range(15)]
        for tag, _b in got[q][:10]:
            cons.basic_ack(tag)
        control_lane_barrier(conn, q)  # the shard has handled the acks
    for q in idle[:3]:
        wait_until(lambda q=q: _count(ch, q) == 10, 10, f"transient messages in {q}")
    # Two periodic passes while these stores are dirty: the node's walk check compares each pass
    # with every store (the outcome below does not depend on this wait; the check's coverage does).
    time.sleep(2.5 * PERIODIC_S)
    for shard in (0, 1):
        old = node.kill_worker("shard", shard)
        node.wait_worker_restarted("shard", shard, old)
    conn = connect_retry(node)
    ch = conn.channel()
    for q in acked:
        wait_until(lambda q=q: _count(ch, q) == 10, 15, f"10 messages back in {q}")
        bodies = []
        for _ in range(10):
            method, _p, body = ch.basic_get(q, auto_ack=True)
            bodies.append((body, method.redelivered))
        # The 5 unacked at the kill come back redelivered, ahead of the 5 never delivered.
        assert bodies == [(b"%d" % i, True) for i in range(10, 15)] + [(b"%d" % i, False) for i in range(15, 20)]
    for q in written[2:] + prio:
        wait_until(lambda q=q: _count(ch, q) == 20, 15, f"20 messages in {q}")
    for q in idle:  # transient messages do not outlive their shard; nothing else was there
        assert _count(ch, q) == 0, q
    sch = conn.channel()
    sch.basic_qos(prefetch_count=100)
    seen: list[bytes] = []
    sch.basic_consume(stream[0], lambda _c, m, _p, b: (seen.append(b), sch.basic_ack(m.delivery_tag)),
                      arguments={"x-stream-offset": "first"})
    wait_until(lambda: len(seen) >= 20, 15, "the stream's 20 messages", pause=pumping(conn))
    assert seen == [b"%d" % i for i in range(20)]
    conn.close()
