"""Measure ShardMQ at each frontends x shards combination, to choose the default process counts.

    python -m loadtest.process_counts [--counts 1x1,1x2,2x1,2x2] [--cores all,1] [--rounds 3]
        [--duration 6] [--out DIR]

For every round, every (cores, frontends x shards) configuration in turn (the order rotates by
round, so configurations alternate A, B, C, ..., A, B, C and slow drift of a shared machine hits
them alike): start a node with ``--frontends F --shards S``, run each scenario once with the perf
tool (``python -m loadtest.cli amqp throughput ... --json``), stop the node. Each run records the
perf tool's rates and latency, the CPU seconds the node's whole process tree used during the run
(so CPU per message: CPU seconds / mean of published and consumed; steadier than msg/s on a
loaded machine) and the 1-minute load average.

``--cores 1`` simulates a 1-core host on a bigger one: the node (and so every worker it forks) runs
under ``taskset -c 0`` and the perf tool under ``taskset -c 1``, so the load generator does not
take the node's core. ``all`` pins nothing: node and perf tool share every core.
Writes DIR/runs.jsonl (one line per run) and DIR/summary.md (medians per configuration);
``--summarize A/runs.jsonl B/runs.jsonl`` prints the summary of several passes together.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from loadtest.node_process import spawn_node
from loadtest.ports import free_port, listening_sockets

ROOT = Path(__file__).resolve().parent.parent

# name -> perf tool `amqp` arguments, subcommand first (``--time`` is appended). The default count must
# weigh the control plane (every worker applies every definition change, so a bind round trip costs
# more with more processes) and connection churn as well as the message paths.
SCENARIOS: dict[str, tuple[str, ...]] = {
    "1p1c-16b-transient": ("throughput", "-x", "1", "-y", "1", "-s", "16"),
    "4p4c-16b-4queues": ("throughput", "-x", "4", "-y", "4", "-s", "16", "--queues", "4"),
    "fanout-4queues": ("throughput", "-x", "1", "-y", "4", "-s", "16", "--queues", "4", "--exchange", "pc-fanout",
                       "--exchange-type", "fanout"),
    "1p1c-1kib-persistent-confirm": ("throughput", "-x", "1", "-y", "1", "-s", "1024", "--persistent", "-c", "1000",
                                     "-a", "1", "-q", "1000"),
    "latency-1k": ("throughput", "-x", "1", "-y", "1", "-s", "16", "--rate", "1000"),
    "latency-10k": ("throughput", "-x", "1", "-y", "1", "-s", "16", "--rate", "10000"),
    "bind-churn": ("bind-churn",),
    "connection-churn": ("connection-churn", "--concurrency", "20"),
}
# Scenarios that count operations, not messages: the run.json ``extra`` key holding the count, and
# what one operation is (for the summary's header).
OPERATIONS: dict[str, tuple[str, str]] = {
    "bind-churn": ("bind_unbind_pairs", "bind+unbind"),
    "connection-churn": ("connections", "connection"),
}


@dataclass(frozen=True)
class Config:
    cores: str  # "all" or "1"
    frontends: int
    shards: int

    @property
    def label(self) -> str:
        return f"{self.cores} cores, {self.frontends}F x {self.shards}S" if self.cores == "all" \
            else f"1 core, {self.frontends}F x {self.shards}S"

    def node_prefix(self) -> list[str]:
        return ["taskset", "-c", "0"] if self.cores == "1" else []

    def perf_prefix(self) -> list[str]:
        return ["taskset", "-c", "1"] if self.cores == "1" else []


def tree_cpu_seconds(root_pid: int) -> float:
    """utime + stime of ``root_pid`` and every descendant alive now."""
    parents: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as fh:
                f = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(d)] = int(f[1])
        ticks[int(d)] = int(f[11]) + int(f[12])
    tree, frontier = {root_pid}, [root_pid]
    while frontier:
        p = frontier.pop()
        for child, parent in parents.items():
            if parent == p and child not in tree:
                tree.add(child)
                frontier.append(child)
    return sum(ticks.get(p, 0) for p in tree) / os.sysconf("SC_CLK_TCK")


def tree_affinity(root_pid: int) -> list[int]:
    """The CPUs any process of the node's tree may run on (what the pinning really gave it)."""
    cpus: set[int] = set()
    pids = [root_pid] + [int(p) for p in os.listdir("/proc") if p.isdigit() and _parent(int(p)) == root_pid]
    for pid in pids:
        try:
            cpus |= os.sched_getaffinity(pid)
        except OSError:
            continue
    return sorted(cpus)


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def start_node(cfg: Config, workdir: Path) -> tuple[subprocess.Popen, int]:
    port = free_port()
    extra = [a for flag in ("--mqtt-port", "--ws-port", "--http-port", "--prometheus-port") for a in (flag, "0")]
    argv = [*cfg.node_prefix(), sys.executable, "-m", "broker.cli", "--data-dir", str(workdir / "data"),
            "--bind", "127.0.0.1", "--port", str(port), "--frontends", str(cfg.frontends),
            "--shards", str(cfg.shards), "--log-level", "warning", *extra]
    proc = spawn_node(argv, workdir, ROOT)
    deadline = time.monotonic() + 60
    try:
        while listening_sockets(port) < cfg.frontends:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"node {cfg.label} did not start: {(workdir / 'node.log').read_text()[-2000:]}")
            time.sleep(0.2)
        time.sleep(1.0)  # shards say HELLO after the frontends listen; let the node settle
    except BaseException:  # an interrupt (SIGTERM, ^C) while starting must not leave the node running
        stop_node(proc)
        raise
    return proc, port


def stop_node(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def run_scenario(cfg: Config, proc: subprocess.Popen, port: int, scenario: str, duration: float) -> dict:
    cmd = [*cfg.perf_prefix(), sys.executable, "-m", "loadtest.cli", "amqp", *SCENARIOS[scenario],
           "--uri", f"amqp://guest:guest@127.0.0.1:{port}/%2F", "--json", "--time", f"{duration:g}"]
    load = os.getloadavg()[0]
    before = tree_cpu_seconds(proc.pid)
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=duration + 120, check=False)
    cpu = tree_cpu_seconds(proc.pid) - before
    row: dict = {"cores": cfg.cores, "frontends": cfg.frontends, "shards": cfg.shards, "scenario": scenario,
                 "load1": round(load, 2), "node_cpu_s": round(cpu, 3), "rc": out.returncode,
                 "node_cpus": tree_affinity(proc.pid)}
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        row["error"] = (out.stderr or out.stdout)[-500:]
        return row
    return row | result_fields(scenario, json.loads(lines[-1]), cpu)


def result_fields(scenario: str, r: dict, cpu: float) -> dict:
    """What a run records from the perf tool's JSON ``r`` and the node's CPU seconds ``cpu``.

    Message scenarios: rates, latency and CPU per message. Operation scenarios (``OPERATIONS``):
    ``ops`` done, ``ops_per_s`` and CPU per operation.
    """
    if scenario in OPERATIONS:
        ops = (r.get("extra") or {}).get(OPERATIONS[scenario][0], 0)
        took = r["duration_s"] or 1
        return {"ops": ops, "ops_per_s": round(ops / took, 1),
                "cpu_us_per_op": round(cpu / max(ops, 1) * 1e6, 2)}
    # A message costs CPU going in and going out; a publisher that outruns its consumer leaves
    # some only half done, so count the mean of the two.
    msgs = max((r["published"] + r["consumed"]) / 2, 1)
    return {"publish_rate": r["publish_rate"], "consume_rate": r["consume_rate"], "published": r["published"],
            "consumed": r["consumed"], "p50_us": r["latency_us"]["p50"], "p99_us": r["latency_us"]["p99"],
            "cpu_us_per_msg": round(cpu / msgs * 1e6, 2)}


def _stat(rs: list[dict], key: str, fmt: str = "{:,.0f}", spread: bool = True) -> str:
    vals = [r[key] for r in rs if r.get(key) is not None]
    if not vals:
        return "—"
    text = fmt.format(statistics.median(vals))
    return text + (f" ({fmt.format(min(vals))}–{fmt.format(max(vals))})" if spread and len(vals) > 1 else "")


def summarize(rows: list[dict]) -> str:
    """Markdown: medians (min–max) over the runs of each configuration.

    Saturating scenarios: msgs/s as the mean of the publish and consume rates (a publisher that
    outruns its consumer still did work) and node CPU per message; their latency is queueing time
    and left out. ``latency-*``: p50 / p99 (medians of the runs' own percentiles), the lowest
    consume rate reached (the target = sustained) and CPU per message. Operation scenarios
    (``OPERATIONS``): operations/s and node CPU per operation.
    """
    for r in rows:
        if "error" not in r and "publish_rate" in r:
            r["work_rate"] = (r["publish_rate"] + r["consume_rate"]) / 2
    groups: dict[tuple[str, str, str], list[dict]] = {}
    for r in rows:
        if "error" not in r:
            groups.setdefault((r["scenario"], r["cores"], f"{r['frontends']}F x {r['shards']}S"), []).append(r)
    configs = sorted({(c, fs) for _, c, fs in groups}, key=lambda k: (k[0] != "1", k[1]))
    present = [s for s in SCENARIOS if any(k[0] == s for k in groups)]
    saturating = [s for s in present if not s.startswith("latency") and s not in OPERATIONS]
    latency = [s for s in present if s.startswith("latency")]
    operations = [s for s in present if s in OPERATIONS]

    def loads(rs: list[dict]) -> str:
        ls = [r["load1"] for r in rs]
        return f"{min(ls):.1f}–{max(ls):.1f}" if ls else "—"

    def table(names: list[str], header: str, cells) -> list[str]:  # noqa: ANN001
        out = ["| cores | frontends x shards | runs | " + " | ".join(header.format(s=s) for s in names)
               + " | load average |", "|---|---|---|" + "---|" * (header.count("|") + 1) * len(names) + "---|"]
        for cores, fs in configs:
            rss = [groups.get((s, cores, fs), []) for s in names]
            if any(rss):
                out.append(f"| {cores} | {fs} | {max(len(rs) for rs in rss)} | "
                           + " | ".join(c for rs in rss for c in cells(rs)) + f" | {loads([r for rs in rss for r in rs])} |")
        return out

    lines: list[str] = []
    if saturating:
        lines += table(saturating, "{s}: msgs/s | {s}: CPU µs/msg",
                       lambda rs: [_stat(rs, "work_rate"), _stat(rs, "cpu_us_per_msg", "{:.1f}")])
    for s in latency:
        lines += ["", *table([s], "{s} p50 µs | p99 µs | lowest consume msgs/s | CPU µs/msg",
                             lambda rs: [_stat(rs, "p50_us", spread=False), _stat(rs, "p99_us", spread=False),
                                         f"{min(r['consume_rate'] for r in rs):,.0f}" if rs else "—",
                                         _stat(rs, "cpu_us_per_msg", "{:.1f}")])]
    if operations:
        lines += ["", *table(operations, "{s}: /s | {s}: CPU µs/op",
                             lambda rs: [_stat(rs, "ops_per_s"), _stat(rs, "cpu_us_per_op", "{:.0f}")])]
        lines += ["", "Operations: " + "; ".join(f"{s} = one {OPERATIONS[s][1]}" for s in operations) + "."]
    failed = [r for r in rows if "error" in r]
    if failed:
        lines += ["", f"{len(failed)} runs failed: "
                  + "; ".join(f"{r['scenario']} {r['cores']} {r['frontends']}x{r['shards']}" for r in failed)]
    return "\n".join(ln for ln in lines).lstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.process_counts", description=__doc__.split("\n\n")[0])
    p.add_argument("--counts", default="1x1,1x2,2x1,2x2", help="FxS pairs (frontends x shards)")
    p.add_argument("--cores", default="all,1", help="'all' (no pinning) and/or '1' (taskset)")
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--duration", type=float, default=6.0)
    p.add_argument("--out", default=None, help="results directory (default: a new temp dir)")
    p.add_argument("--summarize", nargs="+", metavar="RUNS_JSONL", default=None,
                   help="run nothing: print the summary of these runs.jsonl files together")
    args = p.parse_args(argv)
    if args.summarize:
        print(summarize([json.loads(ln) for f in args.summarize for ln in Path(f).read_text().splitlines() if ln]),
              end="")
        return 0
    if shutil.which("taskset") is None and "1" in args.cores.split(","):
        print("process_counts: --cores 1 needs taskset (util-linux)", file=sys.stderr)
        return 2
    configs = [Config(c, int(fs.split("x")[0]), int(fs.split("x")[1]))
               for c in args.cores.split(",") for fs in args.counts.split(",")]
    scenarios = [s for s in args.scenarios.split(",") if s]
    out = Path(args.out or tempfile.mkdtemp(prefix="process-counts-"))
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        for rnd in range(args.rounds):
            k = rnd % len(configs)
            for cfg in configs[k:] + configs[:k]:
                workdir = Path(tempfile.mkdtemp(prefix="pc-node-"))
                proc, port = start_node(cfg, workdir)
                try:
                    for scenario in scenarios:
                        row = run_scenario(cfg, proc, port, scenario, args.duration)
                        row["round"] = rnd + 1
                        rows.append(row)
                        with open(out / "runs.jsonl", "a") as fh:
                            fh.write(json.dumps(row) + "\n")
                        print(json.dumps(row), flush=True)
                finally:
                    stop_node(proc)
                    shutil.rmtree(workdir, ignore_errors=True)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
    summary = summarize(rows)
    (out / "summary.md").write_text(summary)
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
