#!/usr/bin/env python3
"""Instructions a paired worker process spends per message at a low fixed rate, two trees alternating.

    scripts/ab-instructions.py BASE_TREE HEAD_TREE [MESSAGES] [RUNS]

This VM has no hardware counters (`perf stat -e instructions` says <not supported>), so the pair
runs under valgrind (callgrind, `--instr-atstart=no`) and counts only while told to
(`callgrind_control -i on/off`): that count does not depend on the machine's load, where CPU per
message at 1,000 msg/s swings by +-30 % between runs of one tree. Per run: a fresh node from the tree
(`--colocate on --frontends 1 --shards 1`, the pair's `python` replaced by a wrapper that starts it
under valgrind), a warm-up perf run (declares the queue, warms the code), then two counted perf runs
on the same node, of SMALL (50) and of MESSAGES (default 550) messages; the instructions per message
are (Ir(MESSAGES) - Ir(SMALL)) / (MESSAGES - SMALL), so connection setup and teardown cancel out.
The perf tool is `loadtest.cli amqp throughput -x 1 -y 1 -s 16 --rate R` (AB_PERF_ARGS replaces
`-x 1 -y 1 -s 16`, AB_RATE the rate, default 50/s: under valgrind the pair is ~50x slower, and at
50/s a message still finds it idle, as at 1,000/s without valgrind; at 100/s on a loaded machine some
reads carried two and the count fell by 6 %). Needs valgrind.
"""

from __future__ import annotations

import glob
import json
import os
import shlex
import stat
import subprocess
import sys
import tempfile
import time

from ab_node import callgrind_dump, free_port

PY = sys.executable
TREES = {"base": os.path.abspath(sys.argv[1]), "head": os.path.abspath(sys.argv[2])}
N = int(sys.argv[3]) if len(sys.argv) > 3 else 550
RUNS = int(sys.argv[4]) if len(sys.argv) > 4 else 2
SMALL = 50
PERF_ARGS = shlex.split(os.environ.get("AB_PERF_ARGS", "-x 1 -y 1 -s 16"))
RATE = os.environ.get("AB_RATE", "50")


def wrapper(workdir: str) -> str:
    """A `python` that starts the paired worker under callgrind and anything else as itself."""
    path = os.path.join(workdir, "python")
    with open(path, "w") as fh:
        fh.write(f"""#!/bin/sh
if [ "$2" = "shard.pair_main" ]; then
    exec valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file={workdir}/cg.%p \\
        {PY} "$@" 2>>{workdir}/valgrind.log
fi
exec {PY} "$@"
""")
    os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR)
    return path


def perf(tree: str, port: int, n: int) -> dict:
    out = subprocess.run([PY, "-m", "loadtest.cli", "amqp", "throughput", "--uri", f"amqp://guest:guest@127.0.0.1:{port}/",
                          "--json", *PERF_ARGS, "--rate", RATE, "--pmessages", str(n), "--cmessages", str(n), "--keep"],
                         cwd=tree, env=dict(os.environ, PYTHONPATH=tree), capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def counted(workdir: str, pid: int, tree: str, port: int, n: int) -> tuple[int, dict]:
    """Ir of the pair over one perf run of n messages."""
    subprocess.run(["callgrind_control", "-z", str(pid)], capture_output=True, check=True)
    subprocess.run(["callgrind_control", "-i", "on", str(pid)], capture_output=True, check=True)
    result = perf(tree, port, n)
    subprocess.run(["callgrind_control", "-i", "off", str(pid)], capture_output=True, check=True)
    total = callgrind_dump(workdir, pid)
    return total, result


def run(tree: str) -> tuple[float, dict]:
    workdir = tempfile.mkdtemp(prefix="ab-instr-")
    data = tempfile.mkdtemp(prefix="ab-instr-data-")
    port = free_port()
    python = wrapper(workdir)
    code = (f"import sys, runpy; sys.executable = {python!r}; "
            "runpy.run_module('broker.cli', run_name='__main__', alter_sys=True)")
    node = subprocess.Popen([PY, "-c", code, "--data-dir", data, "--port", str(port), "--http-port", "0",
                             "--prometheus-port", "0", "--mqtt-port", "0", "--ws-port", "0", "--log-level", "warning",
                             "--frontends", "1", "--shards", "1", "--colocate", "on"],
                            cwd=tree, env=dict(os.environ, PYTHONPATH=tree, PYTHONHASHSEED="0"))
    try:
        import socket
        deadline = time.monotonic() + 120  # the pair boots under valgrind
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit(f"node from {tree} did not listen; see {workdir}/valgrind.log") from None
                time.sleep(0.2)
        pid = None
        for _ in range(100):
            pids = [int(p.split(".")[-1]) for p in glob.glob(f"{workdir}/cg.*")]
            if pids:
                pid = pids[0]
                break
            time.sleep(0.1)
        if pid is None:
            raise SystemExit("no callgrind output file: is valgrind installed?")
        perf(tree, port, 300)  # warm-up: queue declared, code paths run
        small, _ = counted(workdir, pid, tree, port, SMALL)
        big, result = counted(workdir, pid, tree, port, N)
        return (big - small) / (N - SMALL), result
    finally:
        node.terminate()
        node.wait()
        subprocess.run(["rm", "-rf", workdir, data], check=False)


for r in range(RUNS):
    for name, tree in TREES.items():
        per_msg, result = run(tree)
        load = open("/proc/loadavg").read().split()[0]
        print(f"{name} run{r + 1}: {per_msg:,.0f} instructions per message in the pair "
              f"(p50 under valgrind {result['latency_us']['p50']} us, consumed {result['consumed']}; load {load})",
              flush=True)
