#!/usr/bin/env python3
"""CPU time the node's workers spend per message, two source trees alternating.

On a shared, loaded machine msg/s swings by +-30 % between runs; the CPU seconds the frontend and
shard processes use for a fixed number of messages hardly move, so small hot-path costs show.
    scripts/ab-cpu.py BASE_TREE HEAD_TREE [MESSAGES] [RUNS]
(make BASE_TREE with `git worktree add --detach /tmp/base REV`; the perf client runs from HEAD_TREE).
"""
import os
import socket
import subprocess
import sys
import tempfile
import time

PY = sys.executable
TREES = {"base": os.path.abspath(sys.argv[1]), "head": os.path.abspath(sys.argv[2])}
N = int(sys.argv[3]) if len(sys.argv) > 3 else 200000

def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port

def children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as fh:
                    f = fh.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(f[1]) == pid:
                out.append(int(d))
    return out

def cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        f = fh.read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")

def run(tree: str) -> tuple[float, float]:
    port = free_port()
    data = tempfile.mkdtemp()
    config = open(os.path.join(tree, "broker", "config.py")).read()
    extra = []  # listeners with fixed default ports off, where the tree has them
    for opt, flag in (('"http_port"', "--http-port"), ('"prometheus_port"', "--prometheus-port")):
        if opt in config:
            extra += [flag, "0"]
    node = subprocess.Popen([PY, "-m", "broker.cli", "--data-dir", data, "--port", str(port), "--frontends", "1",
                             "--shards", "1", "--log-level", "warning", *extra], cwd=tree)
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.1)
    time.sleep(1.0)
    kids = children(node.pid)
    before = {k: cpu(k) for k in kids}
    t = time.time()
    subprocess.run([PY, "-m", "loadtest.cli", "amqp", "throughput", "--uri", f"amqp://guest:guest@127.0.0.1:{port}/",
                    "--json", "-x", "1", "-y", "1", "-s", "16", "--pmessages", str(N), "--cmessages", str(N)],
                   cwd=TREES["head"], capture_output=True, text=True, check=False)
    wall = time.time() - t
    used = sum(cpu(k) - before[k] for k in kids)
    node.terminate()
    node.wait()
    subprocess.run(["rm", "-rf", data], check=False)
    return used, wall

for r in range(int(sys.argv[4]) if len(sys.argv) > 4 else 3):
    for name, tree in TREES.items():
        used, wall = run(tree)
        print(f"{name} run{r+1}: workers' CPU {used:.2f} s for {N} msgs = {used / N * 1e6:.2f} us/msg (wall {wall:.1f} s)", flush=True)
