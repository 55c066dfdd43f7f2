#!/usr/bin/env python3
"""CPU (or instructions) per pipelined queue.delete in the node and in the pair, trees alternating.

    scripts/delete-cpu.py TREE [TREE ...] [--count 5000] [--runs 2] [--callgrind node|pair]

Per run and tree: a fresh node from the tree (its code first on the path, this machine's default
process counts: one pair), COUNT transient queues declared (pipelined, 500 in flight), then, after
the declares' bulk has settled, deleted as `loadtest.cli amqp delete-stall` does (pipelined
queue.delete, 500 in flight; no probe). The CPU of the node and of every worker (utime + stime
from /proc/PID/stat) is read before the deletes and once the node has been idle after them
(its resource ticks have pruned the deleted queues' leftovers, the reaper's trash is gone); the
idle CPU rate measured over IDLE_S before the deletes, times the window, is taken off. What is
printed is CPU per delete in µs per process: load-independent enough to A/B (the run queue's
wait is not CPU), where the probe's round trips are not.

--callgrind node|pair: that process runs under valgrind's callgrind (`--instr-atstart=no`,
counting only over the deletes' window, `callgrind_control -i on/off`) and the instructions per
delete are printed (Ir; idle Ir over an equal idle window before taken off). Under valgrind the
process is ~50x slower: the adaptive delete pacer slows the deletes down, which changes nothing
counted per delete but the timer wake-ups (the idle part). Needs valgrind.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ab_node import callgrind_dump, free_port, process_name, stop_node, wait_listening  # noqa: E402  (scripts/ on the path)

from loadtest.amqp_client import AMQPClient  # noqa: E402
from loadtest.scenarios_amqp import _declare_many, delete_many  # noqa: E402

PY = sys.executable
TICK = os.sysconf("SC_CLK_TCK")
IDLE_S = 2.0


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        f = fh.read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / TICK


def syscalls(pid: int) -> tuple[int, int]:
    """(read, write) syscalls of the whole process so far (/proc/PID/io: syscr, syscw)."""
    with open(f"/proc/{pid}/io") as fh:
        f = dict(line.split(": ") for line in fh.read().splitlines())
    return int(f["syscr"]), int(f["syscw"])


def children(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as fh:
                out += [int(p) for p in fh.read().split()]
        except OSError:
            pass
    return out


def workers(node_pid: int) -> dict[str, int]:
    """node and its python workers by name (valgrind's and rm's children skipped)."""
    procs = {"node": node_pid}
    for p in children(node_pid):
        try:
            name = process_name(p)
        except (OSError, ValueError, IndexError):
            try:  # a worker started as `python -c CODE --index N ...` (DELCPU_CPROFILE)
                argv = open(f"/proc/{p}/cmdline").read().split("\0")
                code = argv[argv.index("-c") + 1]
                name = code.split("run_module('", 1)[1].split(".")[0][:2] + argv[argv.index("--index") + 1]
            except (OSError, ValueError, IndexError):
                continue
        if name != "node":
            procs[name] = p
    return procs


def wrapper(workdir: str, target: str) -> str:
    """A `python` that starts the target ("node" or "pair") under callgrind, anything else as itself."""
    path = os.path.join(workdir, "python")
    test = '[ "$2" = "broker.cli" ]' if target == "node" else '[ "$2" = "shard.pair_main" ]'
    with open(path, "w") as fh:
        fh.write(f"""#!/bin/sh
if {test}; then
    exec valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file={workdir}/cg.%p \\
        {PY} "$@" 2>>{workdir}/valgrind.log
fi
exec {PY} "$@"
""")
    os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR)
    return path


def callgrind_total(workdir: str, pid: int) -> int:
    """Ir counted since the last zeroing; zeroes it again."""
    total = callgrind_dump(workdir, pid)
    subprocess.run(["callgrind_control", "-z", str(pid)], capture_output=True, check=True)
    return total


def settle(procs: dict[str, int], quiet: float = 0.02, window: float = 0.5, limit: float = 120) -> None:
    """Wait until every process used under quiet × window CPU over one window (declares' bulk GC,
    leftovers pruned, trash removed)."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        a = {k: cpu_s(p) for k, p in procs.items()}
        time.sleep(window)
        if all(cpu_s(p) - a[k] <= quiet * window + 1.0 / TICK for k, p in procs.items()):
            return


def _profiled(module: str, out: str) -> str:
    """Code that runs ``module`` as __main__ with its loop thread under cProfile, timed by the thread's
    CPU clock (thread_time, not wall: a send that wakes the other process is preempted), enabled by
    the first SIGRTMIN+1 and written to ``out`` at the second (DELCPU_NODE_ARGS: more arguments for broker.cli (e.g. `--delete-rate 100` with
SHARDMQ_TEST_DELETE_PACE_FIXED=1: under callgrind a fixed pace, one delete per pacer wake-up, in
both trees). DELCPU_CPROFILE=node:PATH or pair:PATH)."""
    return ("import cProfile, runpy, signal, sys, time\n"
            "pr = cProfile.Profile(time.thread_time); on = [False]\n"
            "def toggle(*_):\n"
            "    if on[0]:\n"
            f"        pr.disable(); pr.dump_stats({out!r})\n"
            "    else:\n"
            "        pr.enable()\n"
            "    on[0] = not on[0]\n"
            "signal.signal(signal.SIGRTMIN + 1, toggle)\n"
            f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)\n")


def one_run(tree: str, count: int, target: str | None, spy: str | None = None) -> dict:
    data = tempfile.mkdtemp(prefix="delcpu-")
    workdir = tempfile.mkdtemp(prefix="delcpu-cg-")
    port = free_port()
    argv = ["-m", "broker.cli", "--data-dir", data, "--bind", "127.0.0.1", "--port", str(port),
            "--http-port", "0", "--prometheus-port", "0", "--mqtt-port", "0", "--ws-port", "0", "--log-level", "warning",
            *shlex.split(os.environ.get("DELCPU_NODE_ARGS", ""))]
    prof = os.environ.get("DELCPU_CPROFILE")  # "node:PATH" or "pair:PATH"
    prof_role, _, prof_out = (prof or "").partition(":")
    if target is None and prof_role == "node":
        cmd = [PY, "-c", _profiled("broker.cli", prof_out), *argv[2:]]
    elif target is None and prof_role == "pair":
        python = os.path.join(workdir, "python")
        with open(python, "w") as fh:
            fh.write(f"""#!/bin/sh
if [ "$2" = "shard.pair_main" ]; then
    shift 2
    exec {PY} -c {shlex.quote(_profiled("shard.pair_main", prof_out))} "$@"
fi
exec {PY} "$@"
""")
        os.chmod(python, os.stat(python).st_mode | stat.S_IXUSR)
        code = (f"import sys, runpy; sys.executable = {python!r}; "
                "runpy.run_module('broker.cli', run_name='__main__', alter_sys=True)")
        cmd = [PY, "-c", code, *argv[2:]]
    elif target is None:
        cmd = [PY, *argv]
    else:
        python = wrapper(workdir, target)
        code = (f"import sys, runpy; sys.executable = {python!r}; "
                "runpy.run_module('broker.cli', run_name='__main__', alter_sys=True)")
        # The node itself under valgrind: through the wrapper (its $2 is broker.cli).
        cmd = [python, *argv] if target == "node" else [PY, "-c", code, *argv[2:]]
    node = subprocess.Popen(cmd, cwd=tree, env=dict(os.environ, PYTHONPATH=tree, PYTHONHASHSEED="0"),
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            process_group=0)
    uri = f"amqp://guest:guest@127.0.0.1:{port}/%2F"
    load = os.getloadavg()[0]
    try:
        wait_listening(node, uri, 300 if target else 60, tree)
        procs = workers(node.pid)
        cg_pid = None
        if target is not None:
            names = [int(p.rsplit(".", 1)[1]) for p in glob.glob(f"{workdir}/cg.*") if p.rsplit(".", 1)[1].isdigit()]
            cg_pid = node.pid if target == "node" else (names[0] if names else procs.get("sh0"))
        names = [f"delcpu-{i}" for i in range(count)]
        with AMQPClient(uri).connect() as c:
            _declare_many(c, names, False)
            settle(procs, limit=300 if target else 120)
            procs = workers(node.pid)
            # Idle rate, then the deletes.
            t = time.monotonic()
            a = {k: cpu_s(p) for k, p in procs.items()}
            if cg_pid:
                subprocess.run(["callgrind_control", "-z", str(cg_pid)], capture_output=True, check=True)
                subprocess.run(["callgrind_control", "-i", "on", str(cg_pid)], capture_output=True, check=True)
            time.sleep(IDLE_S)
            idle_wall = time.monotonic() - t
            idle = {k: cpu_s(p) - a[k] for k, p in procs.items()}
            idle_ir = callgrind_total(workdir, cg_pid) if cg_pid else 0
            t0 = time.monotonic()
            b = {k: cpu_s(p) for k, p in procs.items()}
            bio = {k: syscalls(p) for k, p in procs.items()}
            spies = [subprocess.Popen([os.path.join(os.path.dirname(PY), "py-spy"), "record", "--nonblocking", "-r", "250",
                                       "-f", "raw", "-o", f"{spy}/{k}.txt", "-p", str(pid)],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                     for k, pid in procs.items()] if spy else []
            if os.environ.get("DELCPU_PERF"):  # perf record (cpu-clock) of each process too, into the --py-spy DIR
                spies += [subprocess.Popen(["perf", "record", "-e", "cpu-clock", "-F", "999", "-g", "-o", f"{spy}/{k}.perf",
                                            "-p", str(pid)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                          for k, pid in procs.items()]
            prof_pid = (node.pid if prof_role == "node" else procs.get("sh0")) if prof and target is None else None
            if prof_pid:
                os.kill(prof_pid, signal.SIGRTMIN + 1)
            delete_many(c, names)
            t1 = time.monotonic()
        settle(procs, limit=300 if target else 120)
        t2 = time.monotonic()
        if prof_pid:
            os.kill(prof_pid, signal.SIGRTMIN + 1)
            time.sleep(1.0)  # written at once
        for s in spies:
            s.send_signal(signal.SIGINT)
            s.wait(60)
        e = {k: cpu_s(p) for k, p in procs.items()}
        eio = {k: syscalls(p) for k, p in procs.items()}
        ir = callgrind_total(workdir, cg_pid) if cg_pid else 0
        wall = t2 - t0
    finally:
        stop_node(node, data, timeout=120, group=True)
        shutil.rmtree(workdir, ignore_errors=True)
    out = {"tree": tree, "load": round(load, 2), "deletes_per_s": round(count / (t1 - t0)),
           "window_s": round(wall, 2),
           "cpu_us_per_delete": {k: round((e[k] - b[k] - idle[k] / idle_wall * wall) / count * 1e6, 1) for k in procs},
           "syscalls_per_delete": {k: [round((eio[k][i] - bio[k][i]) / count, 2) for i in (0, 1)] for k in procs},
           "idle_cpu_share": {k: round(idle[k] / idle_wall, 3) for k in procs}}
    if cg_pid:
        out["ir_per_delete"] = round((ir - idle_ir / idle_wall * wall) / count)
        # Raw: nothing taken off. The idle window can catch the end of the declares' work under valgrind
        # (its rate then 1-5 M/s instead of ~0.4): with a fixed pace both trees' windows are alike, and
        # the raw counts compare fairly.
        out["ir_raw_per_delete"] = round(ir / count)
        out["ir_idle_per_s"] = round(idle_ir / idle_wall)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trees", nargs="+")
    p.add_argument("--count", type=int, default=5000)
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--callgrind", choices=("node", "pair"), default=None)
    p.add_argument("--py-spy", metavar="DIR", help="py-spy record (--nonblocking, 250 Hz, raw) each process over the deletes")
    a = p.parse_args()
    results: dict[str, list] = {t: [] for t in a.trees}
    for _ in range(a.runs):
        for tree in a.trees:
            r = one_run(os.path.abspath(tree), a.count, a.callgrind, a.py_spy)
            results[tree].append(r)
            print(json.dumps(r), flush=True)
    for tree, rs in results.items():
        keys = sorted({k for r in rs for k in r["cpu_us_per_delete"]})
        line = "  ".join(f"{k} " + ", ".join(str(r["cpu_us_per_delete"].get(k)) for r in rs) for k in keys)
        ir = ", ".join(f'{r["ir_raw_per_delete"]} raw ({r["ir_per_delete"]} less idle)' for r in rs if "ir_per_delete" in r)
        print(f"{tree}: µs CPU per delete: {line}" + (f"  Ir per delete ({a.callgrind}): {ir}" if ir else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
