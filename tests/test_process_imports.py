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

# Separate frontend and shard processes (--colocate off, tests/conftest.py): a frontend's imports (aiohttp with its first WebSocket) are checked apart from a shard's.
COLOCATE = "off"

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


# Modules (pure Python too, which /proc/PID/maps cannot show) a worker must not import at start or
# when its listeners' sessions load: each cost it 0.2-11 MB (docs/benchmarks.md, "Memory").
WORKER_MUST_NOT_IMPORT = (
    "aiohttp", "prometheus_client", "etcd3", "grpc", "cryptography", "pyspark", "pyarrow", "kubernetes",
    "importlib.metadata", "email", "multiprocessing",  # a version lookup, a process name
    "broker.config", "configparser",  # the option table: workers get their settings in SNAPSHOT
    "broker.node", "broker.http", "replication.follower", "replication.leader",  # the node's parts
)
WORKER_START = {
    # What run_worker and the worker class import, and every listener's session (frontend/listeners.py).
    "frontend": "import broker.process, broker.logs, frontend.main, frontend.worker\n"
                "from frontend.listeners import FORWARDED, LISTENERS, load\n"
                "for row in LISTENERS: load(row.session)\n"
                "for path in FORWARDED.values(): load(path)\n"
                "import frontend.ws_listener\n",
    "shard": "import broker.process, broker.logs, shard.main, shard.worker\n",
}


def test_worker_modules_do_not_import_what_only_the_node_needs():
    import subprocess
    import sys

    from tests.harness import REPO_ROOT

    for role, code in WORKER_START.items():
        check = (code + "import sys\n"
                 f"bad = sorted(m for m in sys.modules for x in {WORKER_MUST_NOT_IMPORT!r} "
                 "if m == x or m.startswith(x + '.'))\n"
                 "print(' '.join(bad))\n")
        out = subprocess.run([sys.executable, "-c", check], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.split() == [], f"a {role} imports {out.stdout.split()}: import it where it is used"
