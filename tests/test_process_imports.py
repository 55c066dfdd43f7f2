"""Frontends and shards do not load what only the node (or a rare listener) needs.

aiohttp (the node's HTTP server, and the WebSocket listener on its first connection), etcd3/grpc
(cluster mode, the node only) cost megabytes per process (docs/benchmarks.md, "Memory"). Each of
them brings compiled extension modules, so a process that imported one has its ``.so`` files mapped:
``/proc/PID/maps`` of a real node's workers shows it, whatever the process's RSS does.
"""

from __future__ import annotations

import time
from pathlib import Path

from tests.harness import free_port

# Directory names of packages a frontend or shard must not load at start (their compiled parts).
HEAVY = ("/aiohttp/", "/multidict/", "/yarl/", "/frozenlist/", "/grpc/", "/google/protobuf/", "/prometheus_client/")


def loaded_heavy(pid: int) -> set[str]:
    maps = Path(f"/proc/{pid}/maps").read_text()
    return {pkg.strip("/") for pkg in HEAVY if pkg in maps}


def test_workers_do_not_load_the_nodes_heavy_modules(node_factory):
    from websockets.sync.client import connect

    ws_port = free_port()
    # --ws-port as a plain argument: the harness would otherwise probe the port at start, and that
    # first connection is what makes the frontend import aiohttp.
    node = node_factory(frontends=1, shards=2, mqtt_port=free_port(), extra_args=["--ws-port", str(ws_port)])
    assert "aiohttp" in loaded_heavy(node.pid)  # the node's HTTP server: the check sees a loaded one
    workers = [node.worker_pid("frontend", 0), node.worker_pid("shard", 0), node.worker_pid("shard", 1)]
    for pid in workers:
        assert loaded_heavy(pid) == set(), (pid, Path(f"/proc/{pid}/cmdline").read_bytes())
    # The WebSocket listener is served from the start; aiohttp comes with its first connection.
    deadline = time.monotonic() + 30
    while True:
        try:  # the WebSocket port is bound after the AMQP port the harness waited for
            ws = connect(f"ws://127.0.0.1:{ws_port}/ws", subprotocols=["mqtt"], open_timeout=30)
            break
        except ConnectionRefusedError:
            assert time.monotonic() < deadline, "the WebSocket port never listened"
            time.sleep(0.1)
    with ws:
        ws.send(b"\x10\x0c\x00\x04MQTT\x04\x02\x00\x3c\x00\x00")  # CONNECT, clean session, empty client id
        assert ws.recv(timeout=30)[:2] == b"\x20\x02"  # CONNACK
    assert "aiohttp" in loaded_heavy(workers[0])
    assert loaded_heavy(workers[1]) == loaded_heavy(workers[2]) == set()
