"""A leader's shard killed with SIGKILL: the followers' streams are back in sync as soon as it is up.

The node hands each follower's shard connection to the shard's unix socket (replication/handoff.py).
A follower reconnects as soon as the dead shard's stream ends, usually before the restarted shard
has loaded its queues and bound that socket; the handoff then waits for the shard instead of
dropping the connection (which made the follower start its whole session again, and once left it
out of sync for 30 s).
"""

from __future__ import annotations

import time

import pika
import pytest

from tests.cluster_helpers import Cluster, http_get, wait_for

pytestmark = pytest.mark.integration

QUEUES = 300  # enough for the restarted shard to take a moment to recover them


def _status(node) -> dict:
    return http_get(node.http_port, "/api/cluster/status")[1]


def _in_sync(leader, follower, sessions_before: int) -> bool:
    """The follower started a new session since the kill and every stream of it is in sync, and the
    leader agrees: the follower is in sync with zero lag and in the ISR."""
    mine = _status(follower).get("replication") or {}
    st = _status(leader)
    theirs = (st.get("followers") or {}).get(follower.workdir.name) or {}
    return (mine.get("sessions", 0) > sessions_before and mine.get("in_sync") is True
            and all(s.get("synced") for s in (mine.get("streams") or {}).values())
            and theirs.get("in_sync") is True and theirs.get("lag_bytes") == 0
            and follower.workdir.name in st.get("isr", []))


def test_kill9_of_a_leader_shard_the_follower_is_back_in_sync_once_the_shard_is_up(node_factory, etcd):
    cluster = Cluster(node_factory, etcd.endpoints, ttl=10)  # the test is about shards, not elections
    nodes = [cluster.add(name, wait=False, shards=2) for name in ("n1", "n2")]
    for node in nodes:
        node.wait_ready()
    leader = cluster.leader(timeout=30)
    follower = next(n for n in nodes if n is not leader)
    with leader.connect() as conn:
        ch = conn.channel()
        ch.confirm_delivery()
        for i in range(QUEUES):
            ch.queue_declare(f"q{i}", durable=True)
            ch.basic_publish("", f"q{i}", b"x" * 100, pika.BasicProperties(delivery_mode=2))
    wait_for(lambda: _in_sync(leader, follower, -1), 60, "the follower in sync before the kill")
    sessions = (_status(follower).get("replication") or {}).get("sessions", 0)
    old_pid = leader.kill_worker("shard", 0)
    t_kill = time.monotonic()
    leader.wait_worker_restarted("shard", 0, old_pid)
    try:
        wait_for(lambda: _in_sync(leader, follower, sessions), 30, "the follower back in sync")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: leader {_status(leader)}, follower {_status(follower)}\n"
                             f"{leader.log_tail(40)}") from None
    print(f"back in sync {time.monotonic() - t_kill:.2f} s after the kill")
    # The handoff waited for the shard: no follower connection was dropped for want of it.
    assert "cannot hand follower" not in leader.log_text()
