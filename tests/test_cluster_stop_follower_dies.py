"""An ISR follower dies while its leader stops cleanly: what the failover keeps.

The leader's stopping shards confirm their forwards between shards (due delayed messages, dead
letters: tests/test_cluster_forward_stop.py) once every follower of the ISR acked them. The ISR
does not change during a stop (ReplicationLeader.keep_isr, no etcd write), so when one of them dies
meanwhile those forwards are never confirmed: the sending shard keeps its delay (outbox) records
and the node taking over routes them again. The target's copies reached the surviving follower as
well, so they arrive twice: at least once, never lost. Every message a client had confirmed was
acked by every ISR member, the survivor included. (docs/cluster.md "A follower that dies during the
leader's clean stop".)
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest

from tests.cluster_helpers import Cluster, http_get, is_leader
from tests.helpers import WAIT
from tests.test_cluster_forward_stop import GAVE_UP, WAITS, _bodies, _delayed_in_flight, _wait, _wait_log

pytestmark = pytest.mark.integration

QUEUE_PLACEMENT = "hash"  # names picked per shard (tests/helpers.py)


def test_an_isr_follower_killed_during_the_leaders_stop_leaves_its_forwards_at_least_once(node_factory, etcd,
                                                                                         tmp_path):
    cluster = Cluster(node_factory, etcd.endpoints, ttl=20)  # see test_cluster_forward_stop.py
    stall = tmp_path / "stall"
    patient = ("--replication-ack-timeout", "30")
    leader = cluster.add("n1", shards=2, env={"SHARDMQ_TEST_STALL_FSYNC_WHILE": str(stall)}, extra=patient)
    _wait(lambda: is_leader(leader), "n1 to lead", leader)
    survivor = cluster.add("n2", shards=2, extra=patient)
    doomed = cluster.add("n3", shards=2, extra=patient)
    _wait(lambda: {"n2", "n3"} <= set(http_get(leader.http_port, "/api/cluster/status")[1].get("isr", [])),
          "n2 and n3 in the ISR", leader, survivor, doomed)

    conn = leader.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    held = Path(f"{stall}.shard-1")
    try:
        q, bodies, _waits_for = _delayed_in_flight(ch, held)
        conn.close()
        stopper = threading.Thread(target=leader.stop)
        stopper.start()
        _wait_log(leader, WAITS)  # shard 0 waits for shard 1's confirms, shard 1's syncs are held
        os.killpg(doomed.pid, signal.SIGKILL)
        doomed.proc.wait()
        _wait_log(leader, "replication shard-1: follower n3 detached")
    finally:
        held.unlink(missing_ok=True)
    stopper.join(WAIT + 30)
    assert not stopper.is_alive()
    # Shard 1 did not confirm without n3 (still in the ISR, which a stop does not shrink), so shard 0
    # kept its delay records.
    assert GAVE_UP in leader.log_text(), leader.log_tail()

    _wait(lambda: is_leader(survivor), "n2 to take over", survivor)
    conn = survivor.connect()
    ch = conn.channel()
    got: list[bytes] = []

    def all_there() -> bool:
        got.extend(_bodies(ch, q))  # consumed as they come: the re-routed ones arrive after the boot
        return set(bodies) <= set(got)
    try:
        _wait(all_there, "every forwarded message on the new leader", survivor)
    except AssertionError as exc:
        raise AssertionError(f"lost {sorted(set(bodies) - set(got))}: {exc}") from None
    conn.close()
    # At least once: each one once or twice (the target's copy and the re-routed delay record).
    assert all(1 <= got.count(b) <= 2 for b in bodies), got
    print(f"{len(got) - len(bodies)} of {len(bodies)} forwards delivered twice after the failover")
