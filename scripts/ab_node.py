"""The fresh node that scripts/ab-bind.py and scripts/ab-walks.py start from a source tree per run.

Imported as a sibling module (the scripts run as ``scripts/ab-*.py``, so their folder is on the path).
"""

from __future__ import annotations

import glob
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

PY = sys.executable


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def start_node(tree: str, prefix: str) -> tuple[subprocess.Popen, int, str]:
    """A node from ``tree`` (its code first on the path) on a free port with a fresh data dir, plus
    AB_NODE_ARGS, returned once its AMQP port accepts: (process, port, data dir)."""
    data = tempfile.mkdtemp(prefix=prefix)
    port = free_port()
    node = subprocess.Popen(
        [PY, "-m", "broker.cli", "--data-dir", data, "--port", str(port), "--http-port", "0",
         "--prometheus-port", "0", "--mqtt-port", "0", "--ws-port", "0",
         *shlex.split(os.environ.get("AB_NODE_ARGS", ""))],
        cwd=tree, env=dict(os.environ, PYTHONPATH=tree), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port)).close()
            return node, port, data
        except OSError:
            if time.monotonic() > deadline:
                stop_node(node, data)
                raise SystemExit(f"{tree}: node did not listen") from None
            time.sleep(0.1)


def stop_node(node: subprocess.Popen, data: str, timeout: float = 60, group: bool = False) -> None:
    """SIGTERM the node (SIGKILL after `timeout`), then remove its data dir. `group`: the node was
    started as the leader of its own process group (``process_group=0``), whose members that outlive
    it (a shard, a reaper's ``rm``) are killed too; never for a node started in the caller's group."""
    node.terminate()
    try:
        node.wait(timeout)
    except subprocess.TimeoutExpired:
        node.kill()
        node.wait()
    if group:
        try:
            os.killpg(node.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    shutil.rmtree(data, ignore_errors=True)


def process_name(pid: int) -> str:
    """``node``, or a worker's module folder's first two letters and index (``fr0``, ``sh1``; a pair is ``sh``)."""
    argv = open(f"/proc/{pid}/cmdline").read().split("\0")
    if "broker.cli" in argv:
        return "node"
    return argv[argv.index("-m") + 1].split(".")[0][:2] + argv[argv.index("--index") + 1]


def callgrind_dump(workdir: str, pid: int, wait_s: float = 30) -> int:
    """Dump the counts of the callgrind-run ``pid`` (``--callgrind-out-file=WORKDIR/cg.%p``), return
    the dump's total Ir and remove it. Zeroing, if wanted, is the caller's (``callgrind_control -z``)."""
    before = set(glob.glob(f"{workdir}/cg.{pid}.*"))
    subprocess.run(["callgrind_control", "-d", str(pid)], capture_output=True, check=True)
    deadline = time.monotonic() + wait_s
    while not (new := set(glob.glob(f"{workdir}/cg.{pid}.*")) - before):
        if time.monotonic() > deadline:
            raise SystemExit(f"callgrind wrote no dump for {pid} within {wait_s:.0f} s")
        time.sleep(0.1)
    (path,) = new
    time.sleep(0.5)  # written in one go, but give it a moment
    with open(path) as fh:
        total = next(int(line.split()[1]) for line in fh if line.startswith("totals:"))
    os.unlink(path)
    return total


def wait_listening(node: subprocess.Popen, uri: str, timeout: float, what: str) -> None:
    """Return once the node at ``uri`` takes an AMQP connection; exit naming ``what`` if it dies or
    ``timeout`` passes first."""
    from loadtest.amqp_client import AMQPClient

    deadline = time.monotonic() + timeout
    while True:
        try:
            AMQPClient(uri).connect().close()
            return
        except OSError:
            if time.monotonic() > deadline or node.poll() is not None:
                raise SystemExit(f"{what}: node did not listen") from None
            time.sleep(0.2)
