#!/usr/bin/env python3
"""CPU time the node's workers spend per message, two source trees alternating.

On a shared, loaded machine msg/s swings by +-30 % between runs; the CPU seconds the frontend and
shard processes use for a fixed number of messages hardly move, so small hot-path costs show.
    scripts/ab-cpu.py BASE_TREE HEAD_TREE [MESSAGES] [RUNS]
(make BASE_TREE with `git worktree add --detach /tmp/base REV`; the perf client runs from HEAD_TREE).
Environment: AB_PERF_ARGS replaces the perf tool's `-x 1 -y 1 -s 16` (e.g. `-x 4 -y 4 -s 16 --queues 4`:
MESSAGES is then per publisher and per consumer, and CPU per message divides by all of them);
AB_BASE_ARGS / AB_HEAD_ARGS are extra node arguments per tree (one tree twice with two settings:
`AB_BASE_ARGS="--ipc-transport zmq" scripts/ab-cpu.py . .`). Ports of the MQTT and WebSocket listeners
are off where the tree has them, so concurrent runs on a shared machine do not collide.
Each line also has msg/s, CPU per message per role (the shards' event-loop thread apart), the perf
client's CPU, how busy the machine's cores were, and for the workers' loop threads the time they were
runnable but waited for a core and how often they slept for input (per message): a run that moves
fewer messages with the same CPU per message either waited for a core (oversubscribed machine) or
for its peers (sleeps).
"""
import json
import os
import resource
import shlex
import socket
import subprocess
import sys
import tempfile
import time

from ab_node import free_port

PY = sys.executable
TREES = {"base": os.path.abspath(sys.argv[1]), "head": os.path.abspath(sys.argv[2])}
N = int(sys.argv[3]) if len(sys.argv) > 3 else 200000
PERF_ARGS = shlex.split(os.environ.get("AB_PERF_ARGS", "-x 1 -y 1 -s 16"))
PUBLISHERS = int(PERF_ARGS[PERF_ARGS.index("-x") + 1]) if "-x" in PERF_ARGS else 1
NODE_ARGS = {"base": shlex.split(os.environ.get("AB_BASE_ARGS", "")),
             "head": shlex.split(os.environ.get("AB_HEAD_ARGS", ""))}

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

def cpu(pid: int, thread: bool = False) -> float:
    """User + system seconds of a process (all its threads), or of its main thread alone."""
    with open(f"/proc/{pid}/task/{pid}/stat" if thread else f"/proc/{pid}/stat") as fh:
        f = fh.read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")

def waits(pid: int) -> tuple[float, int]:
    """The main thread's time runnable but not running (s) and its voluntary sleeps (/proc schedstat, status)."""
    with open(f"/proc/{pid}/task/{pid}/schedstat") as fh:
        wait_ns = int(fh.read().split()[1])
    with open(f"/proc/{pid}/task/{pid}/status") as fh:
        sleeps = next(int(line.split()[1]) for line in fh if line.startswith("voluntary_ctxt_switches"))
    return wait_ns / 1e9, sleeps

def role(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as fh:
        cmd = fh.read()
    if b"shard.pair_main" in cmd:  # frontend K + shard K in one process (--colocate)
        return "pair"
    return "shard" if b"shard.main" in cmd else "frontend" if b"frontend.main" in cmd else "other"

def machine_busy() -> tuple[int, int]:
    with open("/proc/stat") as fh:
        f = [int(x) for x in fh.readline().split()[1:]]
    return sum(f) - f[3] - f[4], sum(f)  # busy and all jiffies (idle and iowait left out of busy)

def client_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)  # the perf tool and its joined processes
    return ru.ru_utime + ru.ru_stime

def run(name: str, tree: str) -> tuple[float, float, dict]:
    port = free_port()
    data = tempfile.mkdtemp()
    config = open(os.path.join(tree, "broker", "config.py")).read()
    extra = []  # listeners with fixed default ports off, where the tree has them
    for opt, flag in (('"http_port"', "--http-port"), ('"prometheus_port"', "--prometheus-port"),
                      ('"mqtt_port"', "--mqtt-port"), ('"ws_port"', "--ws-port")):
        if opt in config:
            extra += [flag, "0"]
    node = subprocess.Popen([PY, "-m", "broker.cli", "--data-dir", data, "--port", str(port), "--frontends", "1",
                             "--shards", "1", "--log-level", "warning", *extra, *NODE_ARGS[name]], cwd=tree)
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.1)
    time.sleep(1.0)
    kids = children(node.pid)
    before = {k: cpu(k) for k in kids}
    loop_before = {k: cpu(k, thread=True) for k in kids}
    waits_before = {k: waits(k) for k in kids}
    client_before = client_cpu()
    busy_before = machine_busy()
    t = time.time()
    proc = subprocess.run([PY, "-m", "loadtest.cli", "amqp", "throughput", "--uri", f"amqp://guest:guest@127.0.0.1:{port}/",
                    "--json", *PERF_ARGS, "--pmessages", str(N), "--cmessages", str(N)],
                   cwd=TREES["head"], capture_output=True, text=True, check=False)
    wall = time.time() - t
    busy_after = machine_busy()
    extra = {"client": client_cpu() - client_before, "frontend": 0.0, "shard": 0.0, "pair": 0.0,
             "busy": (busy_after[0] - busy_before[0]) / max(1, busy_after[1] - busy_before[1]), "shard_loop": 0.0}
    for k in kids:
        r = role(k)
        if r in extra:
            extra[r] += cpu(k) - before[k]
        if r in ("frontend", "shard", "pair"):  # loop threads: waiting for a core vs sleeping for input
            w = waits(k)
            extra[r + "_wait"] = extra.get(r + "_wait", 0.0) + w[0] - waits_before[k][0]
            extra[r + "_sleeps"] = extra.get(r + "_sleeps", 0) + w[1] - waits_before[k][1]
        if r in ("shard", "pair"):  # the event loop's thread alone (not ZeroMQ's I/O thread, not helper threads)
            extra["shard_loop"] += cpu(k, thread=True) - loop_before[k]
    try:
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        extra["rates"] = f"publish {result['publish_rate']:,.0f} consume {result['consume_rate']:,.0f} msg/s"
    except (ValueError, IndexError, KeyError):
        extra["rates"] = "rates: ?"
    used = sum(cpu(k) - before[k] for k in kids)
    node.terminate()
    node.wait()
    subprocess.run(["rm", "-rf", data], check=False)
    return used, wall, extra

for r in range(int(sys.argv[4]) if len(sys.argv) > 4 else 3):
    for name, tree in TREES.items():
        used, wall, extra = run(name, tree)
        n = N * PUBLISHERS
        load = open("/proc/loadavg").read().split()[0]
        print(f"{name} run{r+1}: workers' CPU {used:.2f} s for {n} msgs = {used / n * 1e6:.2f} us/msg"
              f" (frontends {extra['frontend'] / n * 1e6:.2f}, shards {extra['shard'] / n * 1e6:.2f}"
              + (f", frontend+shard pairs {extra['pair'] / n * 1e6:.2f}" if extra["pair"] else "")
              + f" [loop thread {extra['shard_loop'] / n * 1e6:.2f}],"
              f" perf client {extra['client'] / n * 1e6:.2f}; loops runnable-waiting fe/sh"
              f" {extra.get('frontend_wait', 0) / n * 1e6:.2f}/{extra.get('shard_wait', 0) / n * 1e6:.2f}"
              + (f" (pairs {extra.get('pair_wait', 0) / n * 1e6:.2f})" if extra["pair"] else "") + " us/msg,"
              f" sleeping {extra.get('frontend_sleeps', 0) / n * 1e3:.1f}/{extra.get('shard_sleeps', 0) / n * 1e3:.1f}"
              + (f" (pairs {extra.get('pair_sleeps', 0) / n * 1e3:.1f})" if extra["pair"] else "") +
              f" per 1k msgs; {extra['rates']}; cores busy {extra['busy']:.0%}; wall {wall:.1f} s, load {load})",
              flush=True)
