"""A clean stop of a cluster leader settles its shards' forwards once the followers acked them.

Shard 0 of the leader forwards messages to a queue on shard 1 (due messages of its delayed
exchange's store; dead letters of its queue, kept in its outbox), which stores them and, in a
cluster, confirms them after its group sync AND the in-sync followers' acks. The leader is stopped
while those confirms are still owed (shard 1's syncs held by SHARDMQ_TEST_STALL_FSYNC_WHILE's
``.shard-1`` twin, released once shard 0 says it waits). Replication stopped before the shards left
the confirms nothing to come from: shard 0 waited out its settle and logged that it stops with
forwards unconfirmed (shard/forward_settle.py), and the follower got the messages routed (or
dead-lettered) again. Now the node stops its replication (and its lease) after its shards.

After the failover the new leader holds every message exactly once: the copies the followers acked
before shard 1 confirmed them, and the removals of the delay (outbox) records that the old leader's
final sync streamed.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pika
import pytest

from broker.routing import delay_store_shard
from tests.cluster_helpers import Cluster, http_get, is_leader, wait_for
from tests.helpers import WAIT, count, names_on_different_shards, reject_all, uid, wait_count

pytestmark = pytest.mark.integration

QUEUE_PLACEMENT = "hash"  # names picked per shard (tests/helpers.py)

N = 20
WAITS = "shard 0 stops once its peers answer: "  # shard/forward_settle.py's log line
GAVE_UP = "not confirmed by other shards"  # ... and the one it writes when the wait ends in vain
# shard/streams_close.py: a shard closed its stream before its peers' final state reached the followers.
CUT_OFF = "had their final state acked by the followers"


def _wait_log(node, *texts: str) -> None:
    deadline = time.monotonic() + WAIT
    while not any(text in node.log_text() for text in texts):
        assert time.monotonic() < deadline, f"none of {texts!r} logged:\n{node.log_tail()}"
        time.sleep(0.02)


def _wait(predicate, what: str, *nodes) -> None:
    try:
        wait_for(predicate, 60, what)
    except AssertionError as exc:
        raise AssertionError("\n".join([str(exc), *(n.log_tail() for n in nodes)])) from None


def _bodies(ch, queue: str) -> list[bytes]:
    out = []
    while True:
        method, _p, body = ch.basic_get(queue, auto_ack=True)
        if method is None:
            return out
        out.append(body)


def _delayed_in_flight(ch, held: Path) -> tuple[str, list[bytes], str]:
    """N delayed messages of shard 0's delay store fall due and are stored by the queue's shard (1),
    unconfirmed. Returns the queue, the bodies and what shard 0 says it waits for."""
    x = names_on_different_shards(uid("dx"))[0]
    assert delay_store_shard("/", x, 2) == 0
    q = names_on_different_shards(uid("dq"))[1]
    ch.exchange_declare(x, "x-delayed-message", durable=True, arguments={"x-delayed-type": "fanout"})
    ch.queue_declare(q, durable=True)
    ch.queue_bind(q, x)
    held.touch()  # shard 1 stores what comes, confirms nothing
    bodies = [b"d%d" % i for i in range(N)]
    for body in bodies:  # confirmed once in shard 0's delay store (and on the follower)
        ch.basic_publish(x, "", body, pika.BasicProperties(delivery_mode=2, headers={"x-delay": 50}))
    wait_count(ch, q, N)  # due, forwarded and stored by shard 1, not confirmed
    return q, bodies, f"{N} due delayed messages"


def _dead_letters_in_flight(ch, held: Path) -> tuple[str, list[bytes], str]:
    """N messages of a queue on shard 0 are rejected into a queue on shard 1 (through a fanout dead-letter
    exchange), kept in shard 0's outbox, stored by shard 1, unconfirmed."""
    src = names_on_different_shards(uid("src"))[0]
    q = names_on_different_shards(uid("dlq"))[1]
    dlx = uid("dlx")
    ch.exchange_declare(dlx, "fanout", durable=True)
    ch.queue_declare(q, durable=True)
    ch.queue_bind(q, dlx)
    ch.queue_declare(src, durable=True, arguments={"x-dead-letter-exchange": dlx})
    bodies = [b"m%d" % i for i in range(N)]
    for body in bodies:
        ch.basic_publish("", src, body, pika.BasicProperties(delivery_mode=2))
    held.touch()  # shard 1 stores what comes, confirms nothing
    reject_all(ch.connection, ch, src, N)
    wait_count(ch, q, N)
    return q, bodies, f"{N} dead letters"


@pytest.mark.parametrize("setup", [_delayed_in_flight, _dead_letters_in_flight], ids=["delayed", "dead-letters"])
def test_a_stopping_leaders_forwards_settle_with_the_followers_acks(node_factory, etcd, tmp_path, setup):
    # A 20 s lease: the fence watchdog calls shard 1's held sync a stalled disk after half of it (a
    # graceful stop revokes the lease: the failover does not wait for it).
    cluster = Cluster(node_factory, etcd.endpoints, ttl=20)
    stall = tmp_path / "stall"
    # A follower starved by a loaded machine must not leave the ISR (3 s without an ack by default):
    # it could not take over then.
    patient = ("--replication-ack-timeout", "30")
    leader = cluster.add("n1", shards=2, env={"SHARDMQ_TEST_STALL_FSYNC_WHILE": str(stall)}, extra=patient)
    _wait(lambda: is_leader(leader), "n1 to lead", leader)
    follower = cluster.add("n2", shards=2, extra=patient)
    _wait(lambda: follower.workdir.name in http_get(leader.http_port, "/api/cluster/status")[1].get("isr", []),
          "n2 in the ISR", leader, follower)

    conn = leader.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    held = Path(f"{stall}.shard-1")
    try:
        q, bodies, waits_for = setup(ch, held)
        conn.close()
        stopper = threading.Thread(target=leader.stop)
        stopper.start()
        _wait_log(leader, WAITS, "shard 0 stopped")
    finally:
        held.unlink(missing_ok=True)
    stopper.join(WAIT + 20)
    assert not stopper.is_alive()
    assert f"{WAITS}{waits_for}" in leader.log_text()  # the forwards were in flight at the stop
    assert GAVE_UP not in leader.log_text(), leader.log_tail()
    assert CUT_OFF not in leader.log_text(), leader.log_tail()

    _wait(lambda: is_leader(follower), "n2 to take over", follower)
    assert "dead letters unconfirmed before the restart are sent again" not in follower.log_text()
    conn = follower.connect()
    ch = conn.channel()
    assert count(ch, q) == N
    assert _bodies(ch, q) == bodies
    conn.close()
