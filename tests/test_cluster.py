"""Cluster coordination with a real etcd and real nodes: election, proxying, failover, fencing, status."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pika
import pytest

from loadtest.etcd import EtcdCluster
from tests.cluster_helpers import Cluster, http_get, is_leader, wait_for
from tests.harness import REPO_ROOT

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    cluster = EtcdCluster(1, tmp_path_factory.mktemp("etcd"))
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def cluster(node_factory, etcd) -> Cluster:
    return Cluster(node_factory, etcd.endpoints)


def test_election_exactly_one_leader_and_health_on_one_node_only(cluster):
    nodes = cluster.start(3)
    leader = cluster.leader()
    for node in nodes:
        assert http_get(node.http_port, "/api/health/checks/ready")[0] == 200
        code, body = http_get(node.http_port, "/api/cluster/status")
        assert code == 200 and body["leader"] == leader.workdir.name and body["node"] == node.workdir.name
        expected = 200 if node is leader else 503
        assert http_get(node.http_port, "/api/health/checks/leader")[0] == expected
    roles = sorted(http_get(n.http_port, "/api/cluster/status")[1]["role"] for n in nodes)
    assert roles == ["follower", "follower", "leader"]


def test_followers_proxy_clients_to_the_leader(cluster):
    nodes = cluster.start(3)
    cluster.leader()
    # Declare through one node, publish through another, read through the third: one broker.
    with nodes[0].connect() as conn:
        conn.channel().queue_declare("proxied", durable=True)
    for i, node in enumerate(nodes):
        with node.connect() as conn:
            ch = conn.channel()
            ch.confirm_delivery()
            ch.basic_publish("", "proxied", f"via {i}".encode(),
                             pika.BasicProperties(delivery_mode=2), mandatory=True)
    with nodes[2].connect() as conn:
        ch = conn.channel()
        bodies = sorted(ch.basic_get("proxied", auto_ack=True)[2] for _ in range(3))
    assert bodies == [b"via 0", b"via 1", b"via 2"]


def test_graceful_stop_of_the_leader_removes_its_key_at_once(cluster):
    nodes = cluster.start(2)
    leader = cluster.leader()
    other = next(n for n in nodes if n is not leader)
    leader.stop()
    # Revoking the lease deletes the leader key at once (well within the 1 s TTL).
    wait_for(lambda: http_get(other.http_port, "/api/cluster/status")[1].get("leader") != leader.workdir.name,
             0.9, "the follower to see the leader key gone")


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "broker.cli", "cluster", *args], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=30,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})


def test_cluster_status_cli_prints_leader_nodes_and_isr(cluster):
    nodes = cluster.start(2)
    leader = cluster.leader()
    out = run_cli("status", "--etcd-endpoints", cluster.endpoints, "--etcd-prefix", cluster.prefix)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == f"leader: {leader.workdir.name}"
    assert lines[1] == f"isr: {leader.workdir.name}"
    rows = {line.split()[0]: line.split() for line in lines[3:]}
    assert rows["node"][:2] == ["node", "role"]
    for node in nodes:
        row = rows[node.workdir.name]
        assert row[1] == ("leader" if node is leader else "follower")
        assert row[3] == str(node.port) and row[5] == str(node.http_port)
        assert row[7] == ("yes" if node is leader else "no")
    as_json = run_cli("status", "--etcd-endpoints", cluster.endpoints, "--etcd-prefix", cluster.prefix, "--json")
    assert json.loads(as_json.stdout)["leader"] == leader.workdir.name


def test_cluster_status_cli_errors_are_clear():
    out = run_cli("status", "--etcd-endpoints", "127.0.0.1:1")
    assert out.returncode == 1 and "etcd unreachable" in out.stderr and "Traceback" not in out.stderr
    out = run_cli("stat")
    assert out.returncode == 2 and "invalid choice" in out.stderr


@pytest.fixture
def own_etcd(tmp_path):
    cluster = EtcdCluster(1, tmp_path / "etcd")
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


def publish_until_closed(node, timeout: float) -> tuple[int, float]:
    """Publish with confirms until the connection breaks; returns (confirmed, seconds it lasted)."""
    conn = node.connect(heartbeat=0, blocked_connection_timeout=timeout)
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare("fence", durable=True)
    confirmed = 0
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < timeout:
            ch.basic_publish("", "fence", b"x", pika.BasicProperties(delivery_mode=2))
            confirmed += 1
    except (pika.exceptions.AMQPError, OSError):
        return confirmed, time.monotonic() - t0
    finally:
        with contextlib.suppress(Exception):
            conn.close()
    raise AssertionError(f"the connection stayed open for {timeout}s")


def test_leader_cut_off_from_etcd_stops_confirming_and_closes_clients_then_rejoins(node_factory, own_etcd):
    cluster = Cluster(node_factory, own_etcd.endpoints)
    (node,) = cluster.start(1)
    cluster.leader()
    with node.connect() as conn:
        ch = conn.channel()
        ch.confirm_delivery()
        ch.queue_declare("fence", durable=True)
        ch.basic_publish("", "fence", b"before", pika.BasicProperties(delivery_mode=2))
    member = own_etcd.members[0]
    result: dict = {}

    def publisher():
        result["value"] = publish_until_closed(node, 10)

    thread = threading.Thread(target=publisher)
    thread.start()
    time.sleep(0.3)  # the publisher is confirming (asserted below by its count)
    stopped_at = time.monotonic()
    own_etcd.stop_member(member, signal.SIGKILL)
    thread.join(15)
    confirmed, _lasted = result["value"]
    closed_after = time.monotonic() - stopped_at
    assert confirmed > 0
    # Fenced at half the 1 s TTL after the last renewal, i.e. before the lease could expire.
    assert closed_after < 1.0, f"client connection closed {closed_after:.2f}s after etcd went away"
    assert not is_leader(node)
    assert "fenced" in node.log_text()
    # etcd back: the node takes a new lease and (alone in the ISR) leads again; the data is there.
    own_etcd.start_member(member)
    wait_for(lambda: is_leader(node), 15, "the node to lead again")
    node.wait_ready()
    with node.connect() as conn:
        count = conn.channel().queue_declare("fence", durable=True, passive=True).method.message_count
    assert count >= confirmed + 1
