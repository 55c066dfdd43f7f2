"""One `delete-stall` run against a fresh node from a source tree, with the turn probe on, and the
probe's long turns during the delete (a debug aid for issue #15; see docs/benchmarks.md).

    scripts/delete-turns.py TREE OUT_DIR [--count 30000] [--wrap SPEC,...] [--node-arg=--delete-rate=700 ...]

Starts `python -m broker.cli` from TREE (its code first on the path) with SHARDMQ_TEST_TURN_PROBE=OUT_DIR
and the default wrap list below, declares --count transient queues, runs the confirming probe 1 s,
deletes the queues (pipelined queue.delete, 500 in flight, as `loadtest.cli amqp delete-stall`), then
keeps only the probe lines from 0.5 s before the delete to 0.5 s after it. Prints, per process
(node, pair-N), the longest turns (loop CPU between two 1 ms ticks), turns over 5 / 2 ms, GCs over
1 ms and the wrapped calls by CPU (and the node's delete pacer's rates), plus the probe's p99 and worst
round trip during the deletes and its p99 in the second before them. One JSON line at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ab_node import free_port, stop_node, wait_listening  # noqa: E402  (scripts/ on the path: run as scripts/delete-turns.py)

from loadtest.amqp_client import AMQPClient  # noqa: E402
from loadtest.scenarios_amqp import _ConfirmProbe, _declare_many, delete_many  # noqa: E402

WRAP = ",".join([
    "shard.worker:ShardWorker._on_control", "shard.worker:ShardWorker._on_data",
    "shard.worker:ShardWorker._deliver", "shard.worker:ShardWorker._periodic_sync",
    "shard.worker:ShardWorker._send_stats_part", "shard.worker:ShardWorker._delete_queue",
    "frontend.worker:FrontendWorker._on_node", "frontend.worker:FrontendWorker._on_shard",
    "frontend.worker:FrontendWorker._end_of_turn", "frontend.worker:FrontendWorker._send_stats",
    "broker.node:Node._on_control", "shard.worker:ShardWorker._handle",
    # The deleting connection's reads and deferred dispatch (where the pair's 3-4 ms turns were).
    "frontend.amqp.connection:AMQPConnection.data_received",
    "frontend.amqp.connection:AMQPConnection._dispatch_deferred",
])


def _trash_left(data: str) -> int:
    n = 0
    for root, dirs, _files in os.walk(data):
        n += sum(1 for d in dirs if d.startswith("deleted-"))
        if root != data:
            dirs[:] = []
    return n


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("tree")
    p.add_argument("out", type=Path)
    p.add_argument("--count", type=int, default=30000)
    p.add_argument("--wrap", default=WRAP)
    p.add_argument("--top", type=int, default=6)
    p.add_argument("--gaps", type=int, default=8, help="the probe's longest round trips shown with the lines around them")
    p.add_argument("--node-lines", action="store_true", help="the node's lines too, around the gaps")
    p.add_argument("--node-arg", action="append", default=[], help="one more argument for broker.cli (repeat it)")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    tree = os.path.abspath(a.tree)
    data = tempfile.mkdtemp(prefix="delturns-")
    port = free_port()
    env = dict(os.environ, PYTHONPATH=tree, SHARDMQ_TEST_TURN_PROBE=str(a.out),
               SHARDMQ_TEST_TURN_PROBE_WRAP=a.wrap)
    node = subprocess.Popen(
        [sys.executable, "-m", "broker.cli", "--data-dir", data, "--bind", "127.0.0.1", "--port", str(port),
         "--http-port", str(free_port()), "--prometheus-port", "0", "--mqtt-port", "0", "--ws-port", "0",
         *a.node_arg],
        cwd=tree, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        process_group=0)
    uri = f"amqp://guest:guest@127.0.0.1:{port}/%2F"
    load = os.getloadavg()[0]
    try:
        wait_listening(node, uri, 60, tree)
        names = [f"perf-del-{i}" for i in range(a.count)]
        with AMQPClient(uri).connect() as c:
            _declare_many(c, names, False)
            probe = _ConfirmProbe(uri, "perf-del-probe")
            probe.start()
            probe.ready.wait(30)
            time.sleep(1.0)
            t0 = time.monotonic()
            delete_many(c, names)
            t1 = time.monotonic()
        time.sleep(0.5)
        probe.stop.set()
        probe.join(30)
        if probe.error is not None:
            raise probe.error
        deadline = time.monotonic() + 120
        while _trash_left(data) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        stop_node(node, data, timeout=60, group=True)
    during = sorted(rtt for ts, rtt in probe.samples if ts + rtt >= t0)
    before = sorted(rtt for ts, rtt in probe.samples if t0 - 1.0 <= ts and ts + rtt < t0) or [0.0]
    lo, hi = int((t0 - 0.5) * 1e9), int((t1 + 0.5) * 1e9)
    summary: dict = {"tree": tree, "load": round(load, 2), "window_ns": [lo, hi], "delete_s": round(t1 - t0, 3),
                     "deletes_per_s": round(a.count / (t1 - t0)),
                     "probe_p99_ms": round(during[int(0.99 * len(during))] * 1000, 3),
                     "probe_worst_ms": round(during[-1] * 1000, 2),
                     "probe_p99_before_ms": round(before[int(0.99 * len(before))] * 1000, 3),
                     "load_after": round(os.getloadavg()[0], 2), "procs": {}}
    for f in sorted(a.out.glob("*.turns")):
        ticks, gcs, calls, paces = [], defaultdict(list), defaultdict(list), []
        for line in f.read_text().splitlines():
            x = line.split()
            try:
                if x[0] == "tick" and len(x) == 4 and lo <= int(x[1]) <= hi:
                    ticks.append(int(x[3]))
                elif x[0] == "gc" and len(x) == 6 and lo <= int(x[1]) <= hi:
                    gcs[x[4]].append(int(x[3]))
                elif x[0] == "pace" and len(x) == 4 and lo <= int(x[1]) <= hi:
                    paces.append((int(x[2]), int(x[3])))
                elif x[0] == "call" and len(x) == 5 and lo <= int(x[2]) <= hi:
                    calls[x[1]].append(int(x[4]))
            except (ValueError, IndexError):
                continue
        ticks.sort(reverse=True)
        summary["procs"][f.stem] = {
            "top_ticks_ms": [round(t / 1000, 1) for t in ticks[: a.top]],
            "ticks_over_5ms": sum(t > 5000 for t in ticks), "ticks_over_2ms": sum(t > 2000 for t in ticks),
            "gc_over_1ms": {g: [len([c for c in v if c > 1000]), round(max(v) / 1000, 1)] for g, v in sorted(gcs.items())},
            "pace_windows": len(paces), "pace_min": min((r for r, _ in paces), default=None),
            "pace_mean": round(sum(r for r, _ in paces) / len(paces)) if paces else None,
            "late_us_median": sorted(u for _, u in paces)[len(paces) // 2] if paces else None,
            "calls": {k: [len(v), round(max(v) / 1000, 1), round(sum(v) / 1000, 1)]
                      for k, v in sorted(calls.items(), key=lambda kv: -max(kv[1]))[: a.top]},
        }
    for name, d in summary["procs"].items():
        print(name, "longest", d["top_ticks_ms"], ">5ms", d["ticks_over_5ms"], ">2ms", d["ticks_over_2ms"],
              "gc>1ms", d["gc_over_1ms"], *(["pace min", d["pace_min"], "mean", d["pace_mean"], "late us median", d["late_us_median"]]
                                            if d["pace_windows"] else []))
        for k, v in d["calls"].items():
            print("   ", k, "n>200us", v[0], "max", v[1], "total", v[2])
    print(f"load {summary['load']} delete {summary['delete_s']} s ({summary['deletes_per_s']}/s) "
          f"probe p99 {summary['probe_p99_ms']} ms worst {summary['probe_worst_ms']} ms "
          f"(p99 in the second before {summary['probe_p99_before_ms']} ms; load after {summary['load_after']})")
    gaps = sorted(((rtt, ts) for ts, rtt in probe.samples if ts + rtt >= t0 and ts <= t1 + 0.5), reverse=True)
    lines = []
    for f in sorted(a.out.glob("*.turns")):
        for line in f.read_text().splitlines():
            x = line.split()
            try:
                start = int(x[1]) if x[0] != "call" else int(x[2])
                end = start if x[0] != "tick" else start - int(x[2]) * 1000
                if x[0] == "tick":
                    start, end = end, start
                else:
                    end = start + int(x[2 if x[0] == "gc" else 3]) * 1000
            except (ValueError, IndexError):
                continue
            lines.append((start, end, f.stem.split("-")[0], line))
    for rtt, ts in gaps[: a.gaps]:
        g0, g1 = int(ts * 1e9), int((ts + rtt) * 1e9)
        print(f"gap {rtt * 1000:.2f} ms at +{ts - t0:.3f} s")
        for start, end, role, line in lines:
            if end >= g0 and start <= g1 and (role != "node" or a.node_lines):
                print(f"    {role} +{(start - g0) / 1e6:.2f} ms: {line}")
    (a.out / "summary.json").write_text(json.dumps(summary))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
