"""A leader's shard killed with SIGKILL: only that shard's replication stream starts again.

The node hands each follower's shard connection to the shard's unix socket (replication/handoff.py).
A follower reconnects as soon as the dead shard's stream ends, usually before the restarted shard
has loaded its queues and bound that socket; the handoff then waits for the shard instead of
dropping the connection (which made the follower start its whole session again, and once left it
out of sync for 30 s). The follower reconnects that one stream alone: the node's and the other
shards' streams go on (before, any stream that ended made it drop its whole session, so every
other shard's stream resynced too).
"""

from __future__ import annotations

import itertools
import os
import signal
import time

import pika
import pytest

from broker.definitions.entities import queue_shard
from tests.cluster_helpers import Cluster, http_get, one_leader, wait_for
from tests.test_cluster import ConfirmingPublisher, drain

pytestmark = pytest.mark.integration

QUEUES = 300  # enough for the restarted shard to take a moment to recover them


def _status(node) -> dict:
    return http_get(node.http_port, "/api/cluster/status")[1]


def _repl(node) -> dict:
    return _status(node).get("replication") or {}


def _connections(node, stream: str) -> int:
    """How many connections the follower ``node`` has opened for ``stream`` since it started."""
    return ((_repl(node).get("streams") or {}).get(stream) or {}).get("connections", 0)


def _in_sync(leader, follower, stream: str = "", connections_before: int = -1) -> bool:
    """Every stream of the follower is in sync (``stream`` on a connection opened since it had
    ``connections_before``), and the leader agrees: the follower is in sync with zero lag and in the ISR."""
    mine = _repl(follower)
    st = _status(leader)
    theirs = (st.get("followers") or {}).get(follower.workdir.name) or {}
    streams = mine.get("streams") or {}
    return ((not stream or (streams.get(stream) or {}).get("connections", 0) > connections_before)
            and mine.get("in_sync") is True and all(s.get("synced") for s in streams.values())
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
    wait_for(lambda: _in_sync(leader, follower), 60, "the follower in sync before the kill")
    before = _connections(follower, "shard-0")
    old_pid = leader.kill_worker("shard", 0)
    t_kill = time.monotonic()
    leader.wait_worker_restarted("shard", 0, old_pid)
    try:
        wait_for(lambda: _in_sync(leader, follower, "shard-0", before), 30, "the follower back in sync")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: leader {_status(leader)}, follower {_status(follower)}\n"
                             f"{leader.log_tail(40)}") from None
    print(f"back in sync {time.monotonic() - t_kill:.2f} s after the kill")
    # The handoff waited for the shard: no follower connection was dropped for want of it.
    assert "cannot hand follower" not in leader.log_text()


def _queue_on(shard: int, shards: int, prefix: str) -> str:
    return next(name for i in itertools.count() if queue_shard("/", name := f"{prefix}{i}", shards) == shard)


def test_kill9_of_one_leader_shard_under_confirms_resyncs_only_its_stream_and_loses_nothing(node_factory, etcd):
    # A 5 s lease: short enough for the failover at the end, long enough not to fence on a loaded host.
    cluster = Cluster(node_factory, etcd.endpoints, ttl=5)
    nodes = [cluster.add(name, wait=False, shards=2, extra=("--queue-placement", "hash")) for name in ("n1", "n2")]
    for node in nodes:
        node.wait_ready()
    leader = cluster.leader(timeout=30)
    follower = next(n for n in nodes if n is not leader)
    name = follower.workdir.name
    q0, q1 = _queue_on(0, 2, "keep"), _queue_on(1, 2, "kill")
    with leader.connect() as conn:
        ch = conn.channel()
        for q in (q0, q1):
            ch.queue_declare(q, durable=True)
    wait_for(lambda: _in_sync(leader, follower), 60, "the follower in sync before the kill")
    pubs = [ConfirmingPublisher(leader, q0, "a"), ConfirmingPublisher(leader, q1, "b")]
    for pub in pubs:
        pub.start()
    try:
        wait_for(lambda: all(len(p.confirmed) > 100 for p in pubs), 30, "confirms on both shards")
        repl = _repl(follower)
        sessions, restarts = repl["sessions"], repl.get("stream_restarts", 0)
        kept = {s: repl["streams"][s] for s in ("node", "shard-0")}
        shard1_connections = repl["streams"]["shard-1"].get("connections", 0)
        out_of_sync = leader.log_text().count(f"follower {name} is out of sync")
        dropped = follower.log_text().count("dropping the session")

        in_sync = leader.log_text().count(f"follower {name} is in sync")
        old_pid = leader.kill_worker("shard", 1)
        leader.wait_worker_restarted("shard", 1, old_pid)
        t_up = time.monotonic()
        try:
            wait_for(lambda: leader.log_text().count(f"follower {name} is in sync") > in_sync
                     and _in_sync(leader, follower), 60, "the follower back in sync")
        except AssertionError as exc:
            raise AssertionError(f"{exc}: leader {_status(leader)}, follower {_status(follower)}\n"
                                 f"{leader.log_tail(40)}\n{follower.log_tail(40)}") from None
        # While the shard's stream was down the follower was not in sync for it, so it left the
        # ISR: a confirm on that shard never counted on a copy the follower did not have.
        assert leader.log_text().count(f"follower {name} is out of sync") > out_of_sync
        # Only the killed shard's stream started again: the same session, the node's and shard 0's
        # streams on their first connections, their positions never reset (bytes since their file
        # lists: a new connection starts again from 0).
        after = _repl(follower)
        assert after["sessions"] == sessions, f"the follower started a new session: {after}"
        assert after["stream_restarts"] > restarts, after
        assert after["streams"]["shard-1"]["connections"] > shard1_connections, after
        for s, st in kept.items():
            assert after["streams"][s].get("connections") == st.get("connections"), (s, after)
            assert after["streams"][s]["position"] >= st["position"], (s, after)
        assert follower.log_text().count("dropping the session") == dropped
        # Confirms go on on both shards (the restarted one's with the follower in the ISR again),
        # then the failover: every confirmed message, up to the kill, is on the follower.
        wait_for(lambda: all(any(t > t_up for t in list(p.confirmed.values())[-5:]) for p in pubs), 30,
                 "confirms on both shards after the restart")
        os.killpg(leader.pid, signal.SIGKILL)
        leader.proc.wait()
    finally:
        for pub in pubs:
            pub.stop_event.set()
        for pub in pubs:
            pub.join(10)
    new_leader = one_leader([follower], timeout=30)
    for pub, q in zip(pubs, (q0, q1), strict=True):
        confirmed = set(pub.confirmed)
        got = drain(new_leader, q, confirmed)
        lost = confirmed - got.keys()
        assert not lost, f"{q}: {len(lost)} of {len(confirmed)} confirmed messages lost, e.g. {sorted(lost)[:10]}"
