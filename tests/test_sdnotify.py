"""systemd's notification protocol: a real node under a NOTIFY_SOCKET the test binds (as systemd does
for Type=notify units) sends READY=1 once it serves, WATCHDOG=1 while WATCHDOG_USEC is set, and
STOPPING=1 when it is stopped."""

from __future__ import annotations

import asyncio
import os
import socket
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from broker.sdnotify import Notifier


@pytest.fixture
def notify_socket():
    # AF_UNIX paths are limited to 108 bytes: pytest's tmp_path can be longer, so use a short dir.
    tmp = tempfile.mkdtemp(prefix="sdn")
    path = os.path.join(tmp, "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    try:
        yield sock, path
    finally:
        sock.close()
        os.unlink(path)
        os.rmdir(tmp)


def _receive(sock: socket.socket, wanted: str, timeout: float, seen: list[str]) -> str:
    """Read datagrams until one has the line ``wanted``; every datagram read goes into ``seen``."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            data = sock.recv(4096).decode()
        except TimeoutError:
            break
        seen.append(data)
        if wanted in data.splitlines():
            return data
    raise AssertionError(f"no {wanted!r} within {timeout}s; received {seen!r}")


def _ready_status(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health/checks/ready", timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.mark.integration
def test_node_sends_ready_watchdog_and_stopping(node_factory, notify_socket):
    sock, path = notify_socket
    node = node_factory(start=False, env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "400000"})
    node.start(wait=False)
    seen: list[str] = []
    ready = _receive(sock, "READY=1", 30, seen)
    # READY means what the readiness probe means: the node answers clients now.
    assert _ready_status(node.http_port) == 200
    assert f"STATUS=serving AMQP on 127.0.0.1:{node.port}" in ready.splitlines()  # standalone: its own leader
    node.connect().close()
    # WATCHDOG_USEC=0.4 s: a ping every 0.2 s; wait for two more after READY.
    _receive(sock, "WATCHDOG=1", 5, seen)
    _receive(sock, "WATCHDOG=1", 5, seen)
    # Only the node process talks to systemd: the workers it spawned do not inherit the variables.
    for role in ("frontend", "shard"):
        environ = Path(f"/proc/{node.worker_pid(role, 0)}/environ").read_bytes().split(b"\0")
        assert not any(v.startswith((b"NOTIFY_SOCKET=", b"WATCHDOG_USEC=")) for v in environ)
    assert node.stop() == 0
    _receive(sock, "STOPPING=1", 5, seen)


@pytest.mark.integration
def test_node_without_watchdog_sends_no_pings(node_factory, notify_socket):
    sock, path = notify_socket
    node = node_factory(start=False, env={"NOTIFY_SOCKET": path})
    node.start(wait=False)
    seen: list[str] = []
    _receive(sock, "READY=1", 30, seen)
    assert node.stop() == 0
    _receive(sock, "STOPPING=1", 5, seen)
    assert not [d for d in seen if "WATCHDOG=1" in d.splitlines()]


def test_abstract_socket_and_watchdog_pid_of_another_process():
    name = f"@shardmq-test-{os.getpid()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name[1:])
    try:
        env = {"NOTIFY_SOCKET": name, "WATCHDOG_USEC": "1000", "WATCHDOG_PID": str(os.getpid() + 1)}
        notifier = Notifier.from_env(env)
        assert env == {}  # removed, so spawned workers do not inherit them
        assert notifier.watchdog_usec == 0  # the watchdog is meant for another pid
        assert notifier.notify("STATUS=hello")
        sock.settimeout(5)
        assert sock.recv(100) == b"STATUS=hello"
    finally:
        sock.close()


def test_without_notify_socket_everything_is_a_no_op():
    notifier = Notifier.from_env({})
    assert not notifier.enabled and not notifier.notify("READY=1")

    async def run() -> None:
        notifier.start(lambda: True)
        notifier.stopping()
        notifier.close()

    asyncio.run(run())


def test_status_line_follows_changes_after_ready():
    # The status callable stands for the node's role; a change after READY is sent as STATUS=.
    tmp = tempfile.mkdtemp(prefix="sdn")
    path = os.path.join(tmp, "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    role = ["following"]

    async def run() -> list[bytes]:
        loop = asyncio.get_running_loop()
        notifier = Notifier(path)
        notifier.start(lambda: True, lambda: role[0])
        try:
            got = [await asyncio.wait_for(loop.sock_recv(sock, 100), 10)]
            role[0] = "serving"  # after READY went out: the change comes as a STATUS of its own
            got.append(await asyncio.wait_for(loop.sock_recv(sock, 100), 10))
            return got
        finally:
            notifier.close()

    try:
        sock.setblocking(False)
        assert asyncio.run(run()) == [b"READY=1\nSTATUS=following", b"STATUS=serving"]
    finally:
        sock.close()
        os.unlink(path)
        os.rmdir(tmp)


def _bound_socket(tmpdir: str, name: str) -> tuple[socket.socket, str]:
    path = os.path.join(tmpdir, name)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    return sock, path


@pytest.mark.integration
def test_cluster_leader_and_follower_send_ready_and_the_status_follows_a_failover(node_factory, tmp_path):
    # READY=1 means "serves, or follows and proxies": both nodes of a cluster send it; the STATUS
    # line says which, and changes when the follower is promoted.
    from loadtest.etcd import EtcdCluster
    from tests.cluster_helpers import Cluster, http_get, one_leader, wait_for

    etcd = EtcdCluster(1, tmp_path / "etcd")
    etcd.start()
    tmp = tempfile.mkdtemp(prefix="sdn")
    sockets = {name: _bound_socket(tmp, name) for name in ("n1", "n2")}
    try:
        cluster = Cluster(node_factory, etcd.endpoints, ttl=2)
        nodes = {name: cluster.add(name, wait=False, env={"NOTIFY_SOCKET": sockets[name][1]}) for name in sockets}
        seen: dict[str, list[str]] = {name: [] for name in sockets}
        ready = {name: _receive(sockets[name][0], "READY=1", 60, seen[name]) for name in sockets}
        leader = one_leader(list(nodes.values()))
        follower = next(name for name, node in nodes.items() if node is not leader)
        leader_name = next(name for name, node in nodes.items() if node is leader)
        assert any(line.startswith("STATUS=serving") for line in ready[leader_name].splitlines()), ready
        assert any(line.startswith("STATUS=following") for line in ready[follower].splitlines()), ready
        # Only an ISR member can be promoted: wait until the follower is in sync.
        wait_for(lambda: follower in http_get(leader.http_port, "/api/cluster/status")[1].get("isr", []),
                 30, "the follower in the ISR")
        # `systemctl stop` of the leader (a rolling upgrade): it says STOPPING, the follower is
        # promoted and says so.
        assert leader.stop() == 0
        _receive(sockets[leader_name][0], "STOPPING=1", 10, seen[leader_name])
        _receive(sockets[follower][0], f"STATUS=serving AMQP on 127.0.0.1:{nodes[follower].port}", 30,
                 seen[follower])
        assert nodes[follower].stop() == 0
        _receive(sockets[follower][0], "STOPPING=1", 10, seen[follower])
    finally:
        etcd.stop()
        for sock, path in sockets.values():
            sock.close()
            os.unlink(path)
        os.rmdir(tmp)
