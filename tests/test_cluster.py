"""Cluster coordination with a real etcd and real nodes: election, proxying, failover, fencing, status."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pika
import pytest

from loadtest.etcd import EtcdCluster
from tests.cluster_helpers import Cluster, http_get, is_leader, one_leader, wait_for
from tests.harness import REPO_ROOT

pytestmark = pytest.mark.integration


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


def test_graceful_stop_of_the_leader_hands_over_at_once(cluster):
    nodes = cluster.start(2)
    wait_isr(cluster, nodes)
    leader = cluster.leader()
    other = next(n for n in nodes if n is not leader)
    leader.stop()
    # Revoking the lease deletes the leader key at once (no 1 s TTL to wait for), and the stopping
    # leader leaves the ISR alone, so its in-sync follower is elected. (No timing assert: a promotion
    # spawns the workers, which takes seconds on a loaded machine.)
    try:
        wait_for(lambda: is_leader(other), 30, "the follower to take over")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{other.log_tail()}") from None
    code, body = http_get(other.http_port, "/api/cluster/status")
    assert body["role"] == "leader" and other.workdir.name in body["isr"]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "broker.cli", "cluster", *args], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=30,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})


def test_cluster_status_cli_prints_leader_nodes_and_isr(node_factory, etcd):
    # A 10 s lease: this test is about what status prints, and a 1 s lease on a loaded machine can
    # move the leadership between the test's look and the CLI's.
    cluster = Cluster(node_factory, etcd.endpoints, ttl=10)
    nodes = cluster.start(2)
    wait_isr(cluster, nodes)
    leader = cluster.leader()
    follower = next(n for n in nodes if n is not leader)
    # The lags the CLI prints are the leader's: its shards report theirs once a second, so a report from
    # before the follower caught up may still be the latest. Idle, it is caught up once a report says so.
    wait_for(lambda: http_get(leader.http_port, "/api/cluster/status")[1].get("followers", {})
             .get(follower.workdir.name, {}).get("lag_bytes") == 0, 30, "the follower caught up, as the leader sees it")
    # --timeout: the CLI's per-node HTTP deadline (default 2 s), not what this test is about on a loaded host.
    cli = ("status", "--etcd-endpoints", cluster.endpoints, "--etcd-prefix", cluster.prefix, "--timeout", "10")
    out = run_cli(*cli)
    printed = f"exit {out.returncode}\nstdout:\n{out.stdout}\nstderr:\n{out.stderr}"  # every failure shows it
    assert out.returncode == 0, printed
    lines = out.stdout.splitlines()
    assert lines[0] == f"leader: {leader.workdir.name}", printed
    assert lines[1] == "isr: " + ", ".join(sorted(n.workdir.name for n in nodes)), printed
    rows = {line.split()[0]: line.split() for line in lines[3:]}
    assert rows["node"] == ["node", "role", "address", "amqp", "repl", "http", "ready", "in", "ISR", "lag",
                            "bytes", "lag", "s"], printed
    for node in nodes:
        row = rows[node.workdir.name]
        assert row[1] == ("leader" if node is leader else "follower"), printed
        assert row[3] == str(node.port) and row[4] == str(node.replication_port) and row[5] == str(node.http_port)
        assert row[6] == "yes" and row[7] == "yes", printed
    # The follower's lag, in bytes and seconds, as the leader sees it (idle: caught up).
    assert rows[follower.workdir.name][8:] == ["0", "0.000"], printed
    assert rows[leader.workdir.name][8:] == ["-", "-"], printed
    as_json = run_cli(*cli, "--json")
    assert as_json.returncode == 0, as_json.stderr
    state = json.loads(as_json.stdout)
    assert state["leader"] == leader.workdir.name
    assert {n["name"]: n["connected"] for n in state["nodes"]}[follower.workdir.name] is True


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


def publish_until_closed(node, timeout: float, confirming: threading.Event | None = None) -> tuple[int, float]:
    """Publish with confirms until the connection breaks; returns (confirmed, seconds it lasted).
    ``confirming`` is set at the first confirm."""
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
            if confirming is not None:
                confirming.set()
    except (pika.exceptions.AMQPError, OSError):
        return confirmed, time.monotonic() - t0
    finally:
        with contextlib.suppress(Exception):
            conn.close()
    raise AssertionError(f"the connection stayed open for {timeout}s")


def test_leader_cut_off_from_etcd_stops_confirming_and_closes_clients_then_rejoins(node_factory, own_etcd):
    # A 3 s lease: the node fences itself at half of it (1.5 s without a renewal), which leaves 1.5 s
    # for the watchdog and the client to act on a loaded host before the lease could have expired.
    ttl = 3
    cluster = Cluster(node_factory, own_etcd.endpoints, ttl=ttl)
    (node,) = cluster.start(1)
    cluster.leader()
    with node.connect() as conn:
        ch = conn.channel()
        ch.confirm_delivery()
        ch.queue_declare("fence", durable=True)
        ch.basic_publish("", "fence", b"before", pika.BasicProperties(delivery_mode=2))
    member = own_etcd.members[0]
    result: dict = {}
    confirming = threading.Event()

    def publisher():
        result["value"] = publish_until_closed(node, 10, confirming)

    thread = threading.Thread(target=publisher)
    thread.start()
    assert confirming.wait(15), "the publisher got no confirm"
    stopped_at = time.monotonic()
    own_etcd.stop_member(member, signal.SIGKILL)
    thread.join(15)
    confirmed, _lasted = result["value"]
    closed_after = time.monotonic() - stopped_at
    assert confirmed > 0
    # Fenced at half the TTL after the last renewal, i.e. before the lease could expire: the node's
    # own measure of the lease's age when it fenced (from the last renewal it knows was sent) ...
    # The line is written right after the frontends are stopped, so the client may see its
    # connection cut before the line is in the log: wait for it.
    wait_for(lambda: "fenced: etcd lease not renewed" in node.log_text(), 10, "the node's fence line")
    fenced = re.search(r"fenced: etcd lease not renewed for ([\d.]+) s", node.log_text())
    assert fenced, node.log_tail()
    assert ttl / 2 <= float(fenced[1]) < ttl, fenced[0]
    # ... and the client's: closed before a lease renewed as etcd went away could expire.
    assert closed_after < ttl, f"client connection closed {closed_after:.2f}s after etcd went away"
    assert not is_leader(node)
    # etcd back: the node takes a new lease and (alone in the ISR) leads again; the data is there.
    own_etcd.start_member(member)
    wait_for(lambda: is_leader(node), 15, "the node to lead again")
    node.wait_ready()
    with node.connect() as conn:
        count = conn.channel().queue_declare("fence", durable=True, passive=True).method.message_count
    assert count >= confirmed + 1


def in_isr(cluster: Cluster, node) -> bool:
    code, body = http_get(node.http_port, "/api/cluster/status")
    return code == 200 and node.workdir.name in body.get("isr", [])


def wait_isr(cluster: Cluster, nodes, timeout: float = 60.0) -> None:
    leader = cluster.leader(timeout=30)
    try:
        wait_for(lambda: all(n.workdir.name in http_get(leader.http_port, "/api/cluster/status")[1].get("isr", [])
                             for n in nodes), timeout, "every node in the ISR")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; leader {leader.workdir.name}'s status: "
                             f"{http_get(leader.http_port, '/api/cluster/status')[1]}\n{leader.log_tail()}") from None


class ConfirmingPublisher(threading.Thread):
    """Publishes numbered persistent messages with confirms through one node; reconnects on errors."""

    def __init__(self, node, queue: str, tag: str = "m", reconnect: bool = True) -> None:
        super().__init__(daemon=True)
        self.node, self.queue, self.tag = node, queue, tag
        self.reconnect = reconnect  # False: stop when the first connection breaks
        self.confirmed: dict[str, float] = {}  # body -> when its confirm arrived
        self.sent: dict[str, float] = {}  # body -> when it was published
        self.stop_event = threading.Event()
        self.seq = 0

    def run(self) -> None:
        while not self.stop_event.is_set():
            try:
                with self.node.connect(socket_timeout=2, blocked_connection_timeout=5) as conn:
                    ch = conn.channel()
                    ch.confirm_delivery()
                    while not self.stop_event.is_set():
                        self.seq += 1
                        body = f"{self.tag}{self.seq}"
                        self.sent[body] = time.monotonic()
                        ch.basic_publish("", self.queue, body.encode(),
                                         pika.BasicProperties(delivery_mode=2), mandatory=True)
                        self.confirmed[body] = time.monotonic()
            except (pika.exceptions.AMQPError, OSError):
                if not self.reconnect:
                    return
                time.sleep(0.05)


def drain(node, queue: str, expect: set[str], timeout: float = 30.0) -> dict[str, int]:
    """Consume ``queue`` (acking) until every body of ``expect`` arrived or ``timeout``; body -> count."""
    got: dict[str, int] = {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not expect <= got.keys():
        try:
            with node.connect(socket_timeout=2) as conn:
                ch = conn.channel()
                ch.basic_qos(prefetch_count=500)
                for method, _props, body in ch.consume(queue, inactivity_timeout=1.0):
                    if method is None:
                        break
                    key = body.decode()
                    got[key] = got.get(key, 0) + 1
                    ch.basic_ack(method.delivery_tag)
                    if time.monotonic() > deadline:
                        break
        except (pika.exceptions.AMQPError, OSError):
            time.sleep(0.1)
    return got


def test_kill9_of_the_leader_under_confirms_loses_nothing_and_the_old_leader_rejoins(cluster):
    nodes = cluster.start(3)
    wait_isr(cluster, nodes)
    leader = cluster.leader()
    follower = next(n for n in nodes if n is not leader)
    with follower.connect() as conn:
        conn.channel().queue_declare("failover", durable=True)
    # Consume and ack the first part: acked messages must not come back after the failover.
    with follower.connect() as conn:
        ch = conn.channel()
        ch.confirm_delivery()
        for i in range(1, 101):
            ch.basic_publish("", "failover", f"acked{i}".encode(), pika.BasicProperties(delivery_mode=2))
        for _ in range(100):
            method, _p, _b = ch.basic_get("failover")
            ch.basic_ack(method.delivery_tag)
    pub = ConfirmingPublisher(follower, "failover")  # through a follower: it proxies to the leader
    pub.start()
    wait_for(lambda: len(pub.confirmed) > 200, 20, "confirms before the kill")
    t_kill = time.monotonic()
    os.killpg(leader.pid, signal.SIGKILL)
    leader.proc.wait()
    survivors = [n for n in nodes if n is not leader]
    new_leader = one_leader(survivors, timeout=30)
    print(f"takeover after {time.monotonic() - t_kill:.2f} s")
    wait_for(lambda: any(t > t_kill for t in list(pub.confirmed.values())[-20:]), 30, "confirms after the kill")
    pub.stop_event.set()
    pub.join(10)
    confirmed = set(pub.confirmed)
    got = drain(new_leader, "failover", confirmed)
    lost = confirmed - got.keys()
    assert not lost, f"{len(lost)} confirmed messages lost, e.g. {sorted(lost)[:10]}"
    assert not [k for k in got if k.startswith("acked")], "acked messages came back"
    # The old leader rejoins as a follower, resyncs and re-enters the ISR.
    leader.start()
    wait_for(lambda: http_get(leader.http_port, "/api/cluster/status")[1].get("role") == "follower", 20,
             "the old leader to follow")
    wait_isr(cluster, nodes)
    assert not is_leader(leader)


def test_paused_leader_never_confirms_beside_the_new_one(cluster):
    nodes = cluster.start(2)
    wait_isr(cluster, nodes)
    old = cluster.leader()
    other = next(n for n in nodes if n is not old)
    with old.connect() as conn:
        conn.channel().queue_declare("paused", durable=True)
    # A publisher connected to the old leader directly, on one connection: reconnecting would reach
    # the old node once it follows, i.e. the new leader through its proxy, whose confirms are legal.
    pub_old = ConfirmingPublisher(old, "paused", "old", reconnect=False)
    pub_old.start()
    wait_for(lambda: len(pub_old.confirmed) > 50, 20, "confirms from the old leader")
    os.killpg(old.pid, signal.SIGSTOP)
    t_stop = time.monotonic()
    try:
        new = one_leader([other], timeout=15)
        pub_new = ConfirmingPublisher(new, "paused", "new")
        pub_new.start()
        wait_for(lambda: len(pub_new.confirmed) > 50, 20, "confirms from the new leader")
        first_new = min(pub_new.confirmed.values())
    finally:
        os.killpg(old.pid, signal.SIGCONT)
    # The old leader wakes up with its lease expired: it fences itself and follows.
    wait_for(lambda: http_get(old.http_port, "/api/cluster/status")[1].get("role") == "follower", 20,
             "the old leader to step down")
    pub_old.stop_event.set()
    pub_new.stop_event.set()
    pub_old.join(10)
    pub_new.join(10)
    # Two leaders never confirm at the same time: once the new leader confirms, the old one confirms
    # nothing that was published after it was paused (a publish in flight at the pause may see its
    # confirm late; it counts below like every other: it must be on the new leader) ...
    assert first_new > t_stop
    late = sorted(b for b, t in pub_old.confirmed.items() if t > first_new and pub_old.sent[b] > t_stop)
    assert not late, f"the old leader confirmed messages published after it was deposed: {late[:5]}"
    # ... and every confirm of either leader is on the new leader.
    expect = set(pub_old.confirmed) | set(pub_new.confirmed)
    got = drain(new, "paused", expect)
    lost = expect - got.keys()
    assert not lost, f"{len(lost)} confirmed messages lost, e.g. {sorted(lost)[:10]}"


def test_node_started_before_etcd_waits_for_it_then_leads(node_factory, tmp_path):
    etcd = EtcdCluster(1, tmp_path / "late-etcd")
    try:
        cluster = Cluster(node_factory, etcd.endpoints)
        node = cluster.add("n1", wait=False)
        wait_for(lambda: http_get(node.http_port, "/api/cluster/status")[0] == 200, 15, "the HTTP port")
        assert http_get(node.http_port, "/api/health/checks/ready")[0] == 503
        assert node.running()
        etcd.start()
        wait_for(lambda: is_leader(node), 15, "the node to lead once etcd is up")
        node.wait_ready()
    finally:
        etcd.stop()


def test_followers_proxy_mqtt_too(cluster):
    from tests.harness import free_port
    from tests.test_mqtt import Paho

    names = ("n1", "n2")
    nodes = [cluster.add(n, wait=False, mqtt_port=free_port()) for n in names]
    for node in nodes:
        node.wait_ready()
    leader = cluster.leader()
    follower = next(n for n in nodes if n is not leader)
    pub = Paho(leader.mqtt_port)
    sub = Paho(follower.mqtt_port)  # through the follower's proxy
    try:
        assert pub.subscribe(("cluster/other", 0)) == [0]
        assert sub.subscribe(("cluster/t", 1)) == [1]
        pub.publish("cluster/t", b"via the leader", qos=1)
        assert sub.get()[:2] == ("cluster/t", b"via the leader")
    finally:
        sub.close()
        pub.close()


def test_leader_whose_disk_writes_stall_steps_down(cluster):
    """The watchdog's disk probe (write + fsync of run/disk-probe, once a second) is made to block:
    a FIFO without a reader in place of the probe file, so the probe's write never returns."""
    (node,) = cluster.start(1)
    cluster.leader()
    probe = node.data_dir / "run" / "disk-probe"
    wait_for(probe.exists, 10, "the first disk probe")
    probe.unlink()
    os.mkfifo(probe)
    t0 = time.monotonic()
    wait_for(lambda: "disk stalled" in node.log_text(), 15, "the stalled-disk fence")
    wait_for(lambda: not is_leader(node), 15, "the leader to step down")
    print(f"stepped down {time.monotonic() - t0:.2f} s after the stall (probe every 1 s, bound 2 s)")
    # The disk comes back (a reader lets the blocked write through): the node leads again.
    fd = os.open(probe, os.O_RDONLY | os.O_NONBLOCK)
    try:
        wait_for(lambda: is_leader(node), 20, "the node to lead again")
    finally:
        os.close(fd)


def test_leader_whose_shard_fsync_stalls_steps_down_and_a_follower_takes_over_losing_nothing(cluster, tmp_path):
    """A shard's real group fsync is made to block (SHARDMQ_TEST_STALL_FSYNC_WHILE, a test-only fault
    injection in broker/fsync_beacon.py) while publishers confirm: the leader's watchdog sees the
    shard's fsync beacon grow older than the bound, fences, and the follower takes over."""
    stall = {name: tmp_path / f"stall-{name}" for name in ("n1", "n2")}
    nodes = [cluster.add(name, wait=False, env={"SHARDMQ_TEST_STALL_FSYNC_WHILE": str(stall[name])})
             for name in ("n1", "n2")]
    for node in nodes:
        node.wait_ready()
    wait_isr(cluster, nodes)
    old = cluster.leader()
    other = next(n for n in nodes if n is not old)
    with other.connect() as conn:
        conn.channel().queue_declare("stall", durable=True)
    pub = ConfirmingPublisher(other, "stall")  # through the follower's proxy, then the new leader
    pub.start()
    try:
        wait_for(lambda: len(pub.confirmed) > 100, 30, "confirms before the stall")
        stall[old.workdir.name].touch()
        t_stall = time.monotonic()
        wait_for(lambda: "fsync has not returned" in old.log_text(), 30, "the shard-fsync fence")
        assert "disk stalled: shard 0's fsync" in old.log_text()
        new = one_leader([other], timeout=30)
        assert new is other
        wait_for(lambda: any(t > t_stall for t in list(pub.confirmed.values())[-20:]), 30,
                 "confirms from the new leader")
    finally:
        pub.stop_event.set()
        pub.join(10)
        stall[old.workdir.name].unlink(missing_ok=True)  # the disk comes back
    confirmed = set(pub.confirmed)
    got = drain(other, "stall", confirmed)
    lost = confirmed - got.keys()
    assert not lost, f"{len(lost)} confirmed messages lost, e.g. {sorted(lost)[:10]}"
    # The old leader rejoins as a follower and re-enters the ISR.
    wait_for(lambda: http_get(old.http_port, "/api/cluster/status")[1].get("role") == "follower", 30,
             "the old leader to follow")
    wait_isr(cluster, nodes, timeout=60)
    assert not is_leader(old)


def test_leader_whose_mqtt_kv_fsync_stalls_steps_down(cluster, tmp_path):
    """Only the MQTT KV store's fsync is made to block (``<stall file>.kv``, broker/fsync_beacon.py):
    a retained message's write waits on it, the shard's beacon shows it, and the leader fences."""
    from tests.harness import free_port
    from tests.test_mqtt import Paho

    stall = {name: tmp_path / f"stall-{name}" for name in ("n1", "n2")}
    nodes = [cluster.add(name, wait=False, mqtt_port=free_port(),
                         env={"SHARDMQ_TEST_STALL_FSYNC_WHILE": str(stall[name])}) for name in ("n1", "n2")]
    for node in nodes:
        node.wait_ready()
    wait_isr(cluster, nodes)
    old = cluster.leader()
    other = next(n for n in nodes if n is not old)
    client = Paho(old.mqtt_port)
    kv_stall = stall[old.workdir.name].with_name(stall[old.workdir.name].name + ".kv")
    try:
        client.publish("kv/before", b"retained", qos=1, retain=True)  # the KV path works
        kv_stall.touch()
        client.client.publish("kv/stalled", b"retained", qos=1, retain=True)  # its fsync blocks
        wait_for(lambda: "fsync has not returned" in old.log_text(), 30, "the KV-fsync fence")
        assert "disk stalled: shard 0's fsync" in old.log_text()
        assert one_leader([other], timeout=30) is other
    finally:
        kv_stall.unlink(missing_ok=True)  # the disk comes back
        client.client.loop_stop()
    wait_for(lambda: http_get(old.http_port, "/api/cluster/status")[1].get("role") == "follower", 30,
             "the old leader to follow")


def _etcd_requests(etcd, method: str) -> int:
    """etcd's count of ``method`` RPCs started so far (its /metrics, all clients)."""
    import urllib.request

    total = 0
    for m in etcd.members:
        with urllib.request.urlopen(f"http://{m.endpoint}/metrics", timeout=5) as resp:
            for line in resp.read().decode().splitlines():
                if line.startswith("grpc_server_started_total{") and f'grpc_method="{method}"' in line \
                        and "etcdserverpb" in line:
                    total += int(float(line.rsplit(" ", 1)[1]))
    return total


def test_idle_followers_watch_etcd_instead_of_polling_it(node_factory, etcd):
    """Followers learn of leader changes from an etcd watch: idle, a cluster reads the leader key
    only at the safety poll (every 2 s per follower), where the old loop read it every 0.25 s (24
    reads by two followers in 3 s). The takeover is covered by the failover tests. (A 10 s lease:
    a 1 s lease on a loaded machine may move the leadership, and every election reads etcd.)"""
    cluster = Cluster(node_factory, etcd.endpoints, ttl=10)
    nodes = cluster.start(3)
    wait_isr(cluster, nodes)
    assert _etcd_requests(etcd, "Watch") >= 3  # one watch stream per node
    before, t0 = _etcd_requests(etcd, "Range"), time.monotonic()
    wait_for(lambda: time.monotonic() - t0 >= 3.0, 10, "a 3 s window")
    reads = _etcd_requests(etcd, "Range") - before
    elapsed = time.monotonic() - t0
    # Two followers at one read per 2 s, one more each for a wake-up (an ISR write) in the window.
    assert reads <= 2 * (elapsed / 2.0 + 2), f"{reads} reads of etcd in {elapsed:.1f} s by an idle cluster"
