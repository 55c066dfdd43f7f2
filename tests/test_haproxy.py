"""deploy/haproxy/shardmq.cfg with a real HAProxy (Debian's) in front of three real nodes on loopback.

The shipped file names mq1/mq2/mq3.example.internal and the standard ports; ``render`` rewrites only
the addresses (every node on 127.0.0.1 with its own ports, every frontend on a free port, the stats
socket in the test's directory, no chroot/user/daemon) and keeps every other line as shipped, so
the health checks, timeouts and balancing under test are the operators'. Nodes are standalone (each
is its own leader): the cluster's follower proxying is tested with the cluster.
"""

from __future__ import annotations

import re
import socket
import subprocess
import threading
import urllib.request
from pathlib import Path

import pika
import pika.exceptions
import pytest

from tests.harness import NodeFactory, free_port, wait_until

pytestmark = pytest.mark.integration

CFG = Path(__file__).resolve().parent.parent / "deploy" / "haproxy" / "shardmq.cfg"
HAPROXY = "/usr/sbin/haproxy"
# Standard port of each backend's servers -> the node attribute it becomes on loopback.
NODE_PORTS = {"5672": "port", "15672": "http_port", "1883": "mqtt_port"}
# Parts being built on other branches: their tests run once they are merged.


def haproxy_binary() -> str:
    path = HAPROXY if Path(HAPROXY).exists() else None
    assert path, "haproxy not installed: scripts/test.sh installs Debian's haproxy"
    return path


def render(nodes, frontends: dict[str, int], stats: Path, leader: bool = False,
           closed_port: int | None = None, proxy_v2: bool = False) -> str:
    """The shipped config for ``nodes`` on loopback; ``frontends`` maps frontend name -> listen port.

    ``proxy_v2`` switches to the commented ``default-server ... send-proxy-v2`` line, as the
    operator does once the nodes accept the PROXY protocol.
    """
    text = CFG.read_text()
    out, section = [], None
    for line in text.splitlines():
        stripped = line.strip()
        if proxy_v2 and stripped.startswith("default-server"):
            continue
        if proxy_v2 and stripped.startswith("# default-server") and "send-proxy-v2" in stripped:
            line = "    " + stripped[2:]
            stripped = line.strip()
        if re.match(r"^(global|defaults|frontend|backend|listen)\b", line):
            section = line.split()[1] if len(line.split()) > 1 else line.split()[0]
        if section == "global" and stripped.split(" ")[0] in ("chroot", "user", "group", "daemon"):
            continue
        if section == "global" and stripped.startswith("stats socket"):
            line = f"    stats socket {stats} mode 600 level admin"
        elif section == "global" and stripped.startswith("log "):
            line = "    log stdout format raw local0"  # into the test's haproxy log
        elif section == "global" and stripped.startswith("maxconn"):
            line = "    maxconn 1000"  # a test host's file limit, not a broker host's
        elif stripped.startswith("bind :"):
            line = f"    bind 127.0.0.1:{frontends[section]}"
        elif leader and stripped == "default_backend be_amqp":
            line = "    default_backend be_amqp_leader"
        elif stripped.startswith("server mq"):
            name, addr = stripped.split()[1:3]
            index = int(name[2:]) - 1
            port = addr.rsplit(":", 1)[1]
            attr = NODE_PORTS.get(port)
            # Listeners the nodes do not run (AMQPS/MQTTS, and MQTT before it is built) point at a
            # closed port.
            target = (getattr(nodes[index], attr, 0) if attr else 0) or closed_port
            line = f"    server {name} 127.0.0.1:{target} check port {nodes[index].http_port}"
        out.append(line)
    # Health checks every 2 s, down after 2 failures (as shipped): keep, the test waits for them.
    return "\n".join(out) + "\n"


def stats_of(sock_path: Path) -> dict[tuple[str, str], dict[str, str]]:
    """`show stat` over the admin socket: (proxy, server) -> fields."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        sock.connect(str(sock_path))
        sock.sendall(b"show stat\n")
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    lines = data.decode().splitlines()
    header = lines[0].lstrip("# ").split(",")
    rows = {}
    for line in lines[1:]:
        if line.strip():
            row = dict(zip(header, line.split(","), strict=False))
            rows[(row["pxname"], row["svname"])] = row
    return rows


def wait_for(predicate, timeout: float, what: str):
    return wait_until(predicate, timeout, what, 0.1)


def servers_up(sock_path: Path, backend: str) -> list[str]:
    # "UP 1/2" is a server going down (one check failed): still in the pool until it is "DOWN".
    return sorted(sv for (px, sv), row in stats_of(sock_path).items()
                  if px == backend and sv.startswith("mq") and row["status"].startswith("UP"))


@pytest.fixture(scope="module")
def three_nodes(tmp_path_factory):
    # One set for the module (node startups dominate the time); a test that stops one restarts it.
    factory = NodeFactory(tmp_path_factory.mktemp("haproxy_nodes"))
    try:
        yield [factory(name=f"mq{i}", frontends=1, shards=1, **_mqtt_kwargs()) for i in (1, 2, 3)]
    finally:
        factory.cleanup()


def _mqtt_kwargs() -> dict:
    return {"mqtt_port": free_port()}


@pytest.fixture
def haproxy(tmp_path, three_nodes):
    procs: list[subprocess.Popen] = []

    def start(leader: bool = False, nodes=None, proxy_v2: bool = False):
        frontends = {name: free_port() for name in ("fe_amqp", "fe_amqps", "fe_mqtt", "fe_mqtts", "fe_http")}
        stats = tmp_path / f"haproxy{len(procs)}.sock"
        cfg = tmp_path / f"haproxy{len(procs)}.cfg"
        cfg.write_text(render(nodes or three_nodes, frontends, stats, leader=leader, closed_port=free_port(),
                              proxy_v2=proxy_v2))
        check = subprocess.run([haproxy_binary(), "-c", "-f", str(cfg)], capture_output=True, text=True)
        assert check.returncode == 0, check.stderr
        log = open(tmp_path / f"haproxy{len(procs)}.log", "wb")
        proc = subprocess.Popen([haproxy_binary(), "-db", "-f", str(cfg)], stdout=log, stderr=subprocess.STDOUT)
        procs.append(proc)
        wait_for(lambda: stats.exists() or proc.poll() is not None, 10, "haproxy's stats socket")
        assert proc.poll() is None, (tmp_path / f"haproxy{len(procs) - 1}.log").read_text()
        return frontends, stats

    yield start
    for proc in procs:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def connect(port: int) -> pika.BlockingConnection:
    return pika.BlockingConnection(pika.ConnectionParameters(
        host="127.0.0.1", port=port, credentials=pika.PlainCredentials("guest", "guest"),
        connection_attempts=1, socket_timeout=5, blocked_connection_timeout=10))


def roundtrip(port: int, queue: str) -> None:
    conn = connect(port)
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        ch.queue_declare(queue, auto_delete=False)
        ch.basic_publish("", queue, b"through haproxy")
        method, _props, body = ch.basic_get(queue, auto_ack=True)
        assert body == b"through haproxy"
        ch.queue_delete(queue)
    finally:
        conn.close()


def test_shipped_config_is_valid():
    proc = subprocess.run([haproxy_binary(), "-c", "-f", str(CFG)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    # The example host names do not resolve here; nothing else may warn.
    warnings = [line for line in proc.stderr.splitlines() if "WARNING" in line]
    assert all("could not resolve address 'mq" in w for w in warnings), warnings
    text = CFG.read_text()
    assert text.count("GET /api/health/checks/ready") == 5 and "GET /api/health/checks/leader" in text
    # PROXY protocol is only offered as a comment until the nodes accept it.
    assert all(line.lstrip().startswith("#") for line in text.splitlines() if "send-proxy-v2" in line)


def test_clients_through_haproxy_and_a_stopped_node_is_taken_out(three_nodes, haproxy):
    frontends, stats = haproxy()
    wait_for(lambda: servers_up(stats, "be_amqp") == ["mq1", "mq2", "mq3"], 15, "all three nodes UP")
    roundtrip(frontends["fe_amqp"], "haproxy-q")
    # leastconn spreads long-lived connections: three at once land on three nodes (once the
    # round trip's connection is gone from haproxy's counts).
    wait_for(lambda: all(row["scur"] == "0" for (px, sv), row in stats_of(stats).items()
                         if px == "be_amqp" and sv.startswith("mq")), 5, "no open sessions")
    conns = [connect(frontends["fe_amqp"]) for _ in range(3)]
    try:
        cur = wait_for(lambda: {sv: row["scur"] for (px, sv), row in stats_of(stats).items()
                                if px == "be_amqp" and sv.startswith("mq") and row["scur"] == "1"},
                       5, "one connection per node")
        assert sorted(cur) == ["mq1", "mq2", "mq3"]
    finally:
        for c in conns:
            c.close()
    # The health routes are reachable through the HTTP frontend.
    url = f"http://127.0.0.1:{frontends['fe_http']}/api/health/checks/ready"
    with urllib.request.urlopen(url, timeout=5) as resp:
        assert resp.status == 200
    # A stopped node fails its health check and leaves the pool; clients still get through.
    three_nodes[1].stop()
    wait_for(lambda: servers_up(stats, "be_amqp") == ["mq1", "mq3"], 15, "mq2 marked DOWN")
    for i in range(6):
        roundtrip(frontends["fe_amqp"], f"after-stop-{i}")
    # It comes back when the node does.
    three_nodes[1].start()
    wait_for(lambda: servers_up(stats, "be_amqp") == ["mq1", "mq2", "mq3"], 15, "mq2 back UP")


def test_leader_check_variant(three_nodes, haproxy):
    frontends, stats = haproxy(leader=True)
    # Standalone nodes are their own leaders: all pass /api/health/checks/leader.
    wait_for(lambda: servers_up(stats, "be_amqp_leader") == ["mq1", "mq2", "mq3"], 15, "leader checks UP")
    roundtrip(frontends["fe_amqp"], "leader-q")
    row = stats_of(stats)[("be_amqp_leader", "BACKEND")]
    assert int(row["stot"]) >= 1 and stats_of(stats)[("be_amqp", "BACKEND")]["stot"] == "0"


def mqtt_roundtrip(port: int, topic: str) -> None:
    import paho.mqtt.client as mqtt

    got, subscribed = threading.Event(), threading.Event()
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"haproxy-{topic}")
    client.username_pw_set("guest", "guest")
    client.on_subscribe = lambda *_args: subscribed.set()
    client.on_message = lambda _c, _u, msg: got.set() if msg.payload == b"via haproxy" else None
    client.connect("127.0.0.1", port, keepalive=30)
    client.loop_start()
    try:
        client.subscribe(topic, qos=1)
        assert subscribed.wait(10), "no SUBACK through haproxy"
        client.publish(topic, b"via haproxy", qos=1).wait_for_publish(10)
        assert got.wait(10), "the MQTT message did not come back through haproxy"
    finally:
        client.disconnect()
        client.loop_stop()


def test_mqtt_through_haproxy(three_nodes, haproxy):
    frontends, stats = haproxy()
    wait_for(lambda: servers_up(stats, "be_mqtt") == ["mq1", "mq2", "mq3"], 15, "MQTT backends UP")
    mqtt_roundtrip(frontends["fe_mqtt"], "deploy/haproxy")


def test_send_proxy_v2_variant_with_nodes_that_expect_it(node_factory, haproxy):
    # The commented send-proxy-v2 line, switched on, in front of nodes run with --proxy-protocol 1:
    # clients get through haproxy, while a client that connects to a node directly (no PROXY
    # header) does not, so the header is what haproxy sent. (AMQP only: on main at 5fd4cf1
    # the first MQTT SUBSCRIBE after AMQP traffic through send-proxy-v2 gets no SUBACK about one
    # run in four; reported to the mqtt engineer.)
    nodes = [node_factory(name=f"pp{i}", frontends=1, shards=1, start=False,
                          extra_args=["--proxy-protocol", "1"], **_mqtt_kwargs()) for i in (1, 2, 3)]
    for node in nodes:
        node.start(wait=False)
    frontends, stats = haproxy(nodes=nodes, proxy_v2=True)
    wait_for(lambda: servers_up(stats, "be_amqp") == ["mq1", "mq2", "mq3"], 30, "nodes UP")
    wait_for(lambda: _connects(frontends["fe_amqp"]), 30, "an AMQP connection through haproxy")
    roundtrip(frontends["fe_amqp"], "proxy-v2-q")
    with pytest.raises(pika.exceptions.AMQPError):
        connect(nodes[0].port).close()


def _connects(port: int) -> bool:
    try:
        connect(port).close()
        return True
    except pika.exceptions.AMQPError:
        return False
