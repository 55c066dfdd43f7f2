#!/usr/bin/env python3
"""Paired (``--colocate on``) against split (``off``) workers, alternating: latency, context switches, CPU.

    scripts/ab-colocate.py RUNS [perf args...]
    e.g. scripts/ab-colocate.py 4 -x 1 -y 1 -s 16 --rate 1000 -z 6

Each run starts a fresh node from this tree (``--frontends F --shards S`` from AB_NODE_ARGS, default
1 and 1; AB_NODE_CPUS pins it with taskset), runs ``python -m loadtest.cli amqp throughput`` against it and prints one JSON line: the
setting, msg/s, latency p50/p99, and per message: voluntary context switches of every worker thread
(``/proc/PID/task/*/status``) and of the perf client (``wait4``'s rusage), CPU µs of the workers
and of the client; and the load average before the run. Runs alternate on, off, on, off...
"""
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time

from ab_node import free_port

PY = sys.executable
TREE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = int(sys.argv[1]) if len(sys.argv) > 1 else 4
PERF = sys.argv[2:] or ["-x", "1", "-y", "1", "-s", "16", "--rate", "1000", "-z", "6"]
NODE_ARGS = shlex.split(os.environ.get("AB_NODE_ARGS", "--frontends 1 --shards 1"))
SETTINGS = os.environ.get("AB_SETTINGS", "on,off").split(",")
# AB_NODE_CPUS=0: the node (and so its workers) pinned to those cores with taskset, e.g. a 1-core node.
TASKSET = ["taskset", "-c", os.environ["AB_NODE_CPUS"]] if os.environ.get("AB_NODE_CPUS") else []
TICK = os.sysconf("SC_CLK_TCK")


def worker_pids(node_pid: int, run_dir: str) -> set[int]:
    with open(os.path.join(run_dir, "pids.json")) as fh:
        pids = json.load(fh)
    return {int(p) for role in ("frontend", "shard") for p in pids[role].values()} | {node_pid}


def counts(pids: set[int]) -> tuple[int, float]:
    """(voluntary context switches of every thread, CPU seconds) of ``pids``."""
    switches, cpu = 0, 0.0
    for pid in pids:
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/status") as fh:
                    for line in fh:
                        if line.startswith("voluntary_ctxt_switches"):
                            switches += int(line.split()[1])
            with open(f"/proc/{pid}/stat") as fh:
                f = fh.read().rsplit(")", 1)[1].split()
            cpu += (int(f[11]) + int(f[12])) / TICK
        except (FileNotFoundError, ProcessLookupError):
            pass
    return switches, cpu


def wait_port(port: int, deadline: float) -> None:
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("node did not listen")


def one(setting: str) -> dict:
    env = dict(os.environ, PYTHONPATH=TREE)
    env.pop("SHARDMQ_COLOCATE", None)
    with tempfile.TemporaryDirectory(prefix="ab-colo-") as d:
        port = free_port()
        node = subprocess.Popen(
            [*TASKSET, PY, "-m", "broker.cli", "--data-dir", d, "--port", str(port), "--http-port", "0",
             "--prometheus-port", "0", "--mqtt-port", "0", "--colocate", setting, *NODE_ARGS],
            cwd=TREE, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_port(port, time.monotonic() + 30)
            time.sleep(0.5)
            pids = worker_pids(node.pid, os.path.join(d, "run"))
            load = os.getloadavg()
            s0, c0 = counts(pids)
            perf = subprocess.Popen(
                [PY, "-m", "loadtest.cli", "amqp", "throughput", "--uri", f"amqp://guest:guest@127.0.0.1:{port}/",
                 *PERF, "--json"], cwd=TREE, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            out = perf.stdout.read()
            _, status, usage = os.wait4(perf.pid, 0)
            s1, c1 = counts(pids)
            res = json.loads(out.decode().strip().splitlines()[-1])
        finally:
            node.terminate()
            node.wait(30)
    n = max(1, res["consumed"])
    return {"colocate": setting, "load": [round(x, 2) for x in load], "msgs": res["consumed"],
            "rate": res["consume_rate"], "p50": res["latency_us"]["p50"], "p99": res["latency_us"]["p99"],
            "worker_vcsw_per_msg": round((s1 - s0) / n, 3), "client_vcsw_per_msg": round(usage.ru_nvcsw / n, 3),
            "worker_cpu_us_per_msg": round((c1 - c0) * 1e6 / n, 2),
            "client_cpu_us_per_msg": round((usage.ru_utime + usage.ru_stime) * 1e6 / n, 2)}


def main() -> None:
    for _ in range(RUNS):
        for setting in SETTINGS:
            print(json.dumps(one(setting)), flush=True)


if __name__ == "__main__":
    main()
