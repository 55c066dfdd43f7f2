"""A clean stop of a cluster leader settles its shards' forwards once the followers acked them.

Shard 0 of the leader holds a delayed exchange's store; the messages fall due and go to a queue
on shard 1, which stores them and, in a cluster, confirms them after its group sync AND the in-sync
followers' acks. The leader is stopped while those confirms are still owed (shard 1's syncs held by
SHARDMQ_TEST_STALL_FSYNC_WHILE's ``.shard-1`` twin, released once shard 0 says it waits). Replication
stopped before the shards left the confirms nothing to come from: shard 0 waited out its settle and
logged that it stops with forwards unconfirmed (shard/forward_settle.py), and the follower got the
messages routed again. Now the node stops its replication (and its lease) after its shards.

After the failover the new leader holds every message exactly once: the copies the followers acked
before shard 1 confirmed them, and the delay records' removals the old leader's final sync streamed.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pika
import pytest

from broker.routing import delay_store_shard
from tests.cluster_helpers import Cluster, http_get, is_leader, wait_for
from tests.helpers import WAIT, count, names_on_different_shards, uid, wait_count

pytestmark = pytest.mark.integration

QUEUE_PLACEMENT = "hash"  # names picked per shard (tests/helpers.py)

N = 20
WAITS = "shard 0 stops once its peers answer: "  # shard/forward_settle.py's log line
GAVE_UP = "not confirmed by other shards"  # ... and the one it writes when the wait ends in vain


def _wait_log(node, *texts: str) -> None:
    deadline = time.monotonic() + WAIT
    while not any(text in node.log_text() for text in texts):
        assert time.monotonic() < deadline, f"none of {texts!r} logged:\n{node.log_tail()}"
        time.sleep(0.02)


def _bodies(ch, queue: str) -> list[bytes]:
    out = []
    while True:
        method, _p, body = ch.basic_get(queue, auto_ack=True)
        if method is None:
            return out
        out.append(body)


def test_a_stopping_leaders_forwards_settle_with_the_followers_acks(node_factory, etcd, tmp_path):
    # A 20 s lease: the fence watchdog calls shard 1's held sync a stalled disk after half of it (a
    # graceful stop revokes the lease: the failover does not wait for it).
    cluster = Cluster(node_factory, etcd.endpoints, ttl=20)
    stall = tmp_path / "stall"
    leader = cluster.add("n1", shards=2, env={"SHARDMQ_TEST_STALL_FSYNC_WHILE": str(stall)})
    wait_for(lambda: is_leader(leader), 30, "n1 to lead")
    follower = cluster.add("n2", shards=2)
    wait_for(lambda: follower.workdir.name in http_get(leader.http_port, "/api/cluster/status")[1].get("isr", []),
             60, "n2 in the ISR")

    x = names_on_different_shards(uid("dx"))[0]
    assert delay_store_shard("/", x, 2) == 0
    q = names_on_different_shards(uid("dq"))[1]
    conn = leader.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    ch.exchange_declare(x, "x-delayed-message", durable=True, arguments={"x-delayed-type": "fanout"})
    ch.queue_declare(q, durable=True)
    ch.queue_bind(q, x)
    held = Path(f"{stall}.shard-1")
    held.touch()  # shard 1 stores what comes, confirms nothing
    bodies = [b"d%d" % i for i in range(N)]
    try:
        for body in bodies:  # confirmed once in shard 0's delay store (and on the follower)
            ch.basic_publish(x, "", body, pika.BasicProperties(delivery_mode=2, headers={"x-delay": 50}))
        wait_count(ch, q, N)  # due, forwarded and stored by shard 1, not confirmed
        conn.close()

        stopper = threading.Thread(target=leader.stop)
        stopper.start()
        _wait_log(leader, WAITS, "shard 0 stopped")
    finally:
        held.unlink()
    stopper.join(WAIT + 20)
    assert not stopper.is_alive()
    assert WAITS in leader.log_text()  # the forwards were in flight at the stop
    assert GAVE_UP not in leader.log_text(), leader.log_tail()

    wait_for(lambda: is_leader(follower), 60, "n2 to take over")
    conn = follower.connect()
    ch = conn.channel()
    assert count(ch, q) == N
    assert _bodies(ch, q) == bodies
    conn.close()
