"""The cost of replication, in one command: a standalone node vs a leader with two followers.

    python -m loadtest.repl_ratio --runs 3                      # from the repository root
    python -m loadtest.repl_ratio --runs 3 -- -x 1 -y 1 -s 1024 --persistent -c 1000 -q 1000 -z 10
    python -m loadtest.repl_ratio --tree /tmp/base      # nodes from another checkout (git worktree)

Alternates, ``--runs`` times: a standalone node, then a three-node cluster (a private one-member
etcd, three ``--cluster`` nodes on loopback, all in the ISR), each measured with the same
``shardmq-perf amqp throughput`` run against the (leader) node. Runs alternate because a shared
machine's speed drifts: the per-pair ratio is what compares like with like. Besides msg/s and the
p50 latency it prints the CPU seconds per message of each role (standalone node, leader,
followers, etcd, the load generator): that figure hardly moves with the machine's load, so it
shows where the replicated message costs. Everything runs in a temp dir on free ports and is
stopped by PID. docs/cluster.md has results.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from loadtest.etcd import EtcdCluster
from loadtest.node_process import spawn_node
from loadtest.ports import free_port

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PERF = ["-x", "1", "-y", "1", "-s", "1024", "--persistent", "-c", "1000", "-q", "1000", "-z", "10"]
_TICK = os.sysconf("SC_CLK_TCK")


def _other_listeners_off() -> list[str]:
    from broker.config import OPTIONS_BY_NAME

    names = ("mqtt_port", "mqtts_port", "amqps_port", "ws_port", "prometheus_port")
    return [arg for n in names if n in OPTIONS_BY_NAME for arg in (OPTIONS_BY_NAME[n].flag, "0")]


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def tree_cpu(root: int) -> dict[str, float]:
    """CPU seconds (user + system) of ``root`` and each descendant, summed by role: the process
    itself is ``node``, its children are named by the module they run (frontend, shard, ...; a
    paired process, --colocate, is ``pair``)."""
    parent: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            f = _stat(int(d))
            if f is not None:
                parent[int(d)] = int(f[1])
    out: dict[str, float] = {}
    todo = [(root, "node")]
    while todo:
        pid, role = todo.pop()
        f = _stat(pid)
        if f is None:
            continue
        out[role] = out.get(role, 0.0) + (int(f[11]) + int(f[12])) / _TICK
        for child, ppid in parent.items():
            if ppid == pid:
                todo.append((child, _role(child)))
    return out


def _role(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            argv = fh.read().split(b"\0")
    except OSError:
        return "other"
    if b"-m" in argv:
        mod = argv[argv.index(b"-m") + 1].decode()
        if mod == "shard.pair_main":
            return "pair"  # frontend K and shard K in one process (--colocate)
        return mod.split(".")[0]
    return "other"


def _http(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=0.5) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, OSError):
        return 0


def _wait(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"repl_ratio: timed out waiting for {what}")
        time.sleep(0.1)


class Node:
    def __init__(self, name: str, workdir: Path, extra: list[str]) -> None:
        self.name = name
        self.workdir = workdir
        self.port, self.http_port, self.repl_port = free_port(), free_port(), free_port()
        self.argv = [sys.executable, "-m", "broker.cli", "--data-dir", str(workdir / "data"),
                     "--port", str(self.port), "--http-port", str(self.http_port),
                     "--log-level", "warning", *_other_listeners_off(), *extra]
        self.proc: subprocess.Popen | None = None

    def start(self) -> Node:
        self.proc = spawn_node(self.argv, self.workdir, REPO_ROOT)
        return self

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def ready(self) -> bool:
        return _http(self.http_port, "/api/health/checks/ready") == 200

    def leader(self) -> bool:
        return _http(self.http_port, "/api/health/checks/leader") == 200


def _cluster_status(port: int) -> dict:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/cluster/status", timeout=1) as resp:
            return json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError):
        return {}


def start_synced_cluster(nodes: list[Node], workdir: Path, etcd_endpoints: str, prefix: str, secret: Path,
                         ttl: int | None, nodes_n: int, node_args: list[str] | tuple[str, ...] = ()) -> None:
    """Start n1 as leader, then the followers, and wait until every follower is in the ISR.

    Started nodes are appended to `nodes` as they are made, so the caller's cleanup stops them even
    when a wait here fails. ttl None leaves --lease-ttl at the node's default.
    """
    for i in range(nodes_n):
        name = f"n{i + 1}"
        node = Node(name, workdir / name, [
            "--cluster", "--etcd-endpoints", etcd_endpoints, "--etcd-prefix", prefix,
            "--node-name", name, "--advertised-host", "127.0.0.1",
            *(("--lease-ttl", str(ttl)) if ttl is not None else ()),
            "--cluster-secret-file", str(secret), *node_args])
        node.argv += ["--replication-port", str(node.repl_port)]
        nodes.append(node)
    nodes[0].start()
    _wait(nodes[0].leader, 60, "n1 to lead")
    for n in nodes[1:]:
        n.start()

    def all_in_sync() -> bool:
        st = _cluster_status(nodes[0].http_port)
        fol = st.get("followers") or {}
        return len(st.get("isr") or []) == nodes_n and len(fol) == nodes_n - 1 and all(
            f.get("in_sync") for f in fol.values())
    _wait(all_in_sync, 120, "every follower in the ISR")


def _perf(uri: str, perf_args: list[str]) -> tuple[dict, float]:
    """Run the load generator; return its JSON result and the CPU seconds it used."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run([sys.executable, "-m", "loadtest.cli", "amqp", "throughput", "--uri", uri, "--json",
                          *perf_args], cwd=REPO_ROOT, capture_output=True, text=True, check=False)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    try:
        return json.loads(out.stdout.strip().splitlines()[-1]), cpu
    except (IndexError, ValueError):
        raise RuntimeError(f"perf run failed: {out.stdout[-500:]} {out.stderr[-2000:]}") from None


def _measure(label: str, uri: str, trees: dict[str, int], perf_args: list[str]) -> dict:
    time.sleep(1.0)  # let start-up work (full syncs, hashing) settle
    before = {name: tree_cpu(pid) for name, pid in trees.items()}
    result, gen_cpu = _perf(uri, perf_args)
    after = {name: tree_cpu(pid) for name, pid in trees.items()}
    msgs = max(1, int(result.get("consumed") or result.get("published") or 1))
    cpu: dict[str, float] = {}
    for name in trees:
        for role, t in after[name].items():
            cpu[f"{name}.{role}"] = t - before[name].get(role, 0.0)
    cpu["loadgen"] = gen_cpu
    return {
        "setup": label, "publish_rate": result.get("publish_rate"), "consume_rate": result.get("consume_rate"),
        "p50_ms": (result.get("latency_us") or {}).get("p50", 0) / 1000 if result.get("latency_us", {}).get("p50")
        else None,
        "p99_ms": (result.get("latency_us") or {}).get("p99", 0) / 1000 if result.get("latency_us", {}).get("p99")
        else None,
        "published": result.get("published"), "confirmed": result.get("confirmed"), "consumed": result.get("consumed"),
        "cpu_us_per_msg": {k: round(v / msgs * 1e6, 2) for k, v in sorted(cpu.items())},
        "cpu_us_per_msg_total": round(sum(cpu.values()) / msgs * 1e6, 2),
        "loadavg": os.getloadavg()[0],
    }


def run_standalone(workdir: Path, node_args: list[str], perf_args: list[str]) -> dict:
    node = Node("solo", workdir / "solo", node_args).start()
    try:
        _wait(node.ready, 60, "the standalone node")
        return _measure("standalone", f"amqp://guest:guest@127.0.0.1:{node.port}/", {"solo": node.proc.pid},
                        perf_args)
    finally:
        node.stop()
        shutil.rmtree(node.workdir, ignore_errors=True)


def run_cluster(workdir: Path, node_args: list[str], perf_args: list[str], followers: int) -> dict:
    etcd = EtcdCluster(1, workdir / "etcd").start()
    secret = workdir / "secret"
    secret.write_text(os.urandom(16).hex())
    prefix = f"ratio{os.getpid()}"
    nodes: list[Node] = []
    try:
        # The first node leads (the others start once it does), so the roles are the same every run.
        start_synced_cluster(nodes, workdir, etcd.endpoints, prefix, secret, None, followers + 1, node_args)
        trees = {"leader": nodes[0].proc.pid}
        for i, n in enumerate(nodes[1:]):
            trees[f"follower{i + 1}"] = n.proc.pid
        trees["etcd"] = etcd.members[0].proc.pid
        return _measure(f"leader+{followers}", f"amqp://guest:guest@127.0.0.1:{nodes[0].port}/", trees, perf_args)
    finally:
        for n in reversed(nodes):
            n.stop()
        etcd.stop()
        shutil.rmtree(workdir / "etcd", ignore_errors=True)
        for n in nodes:
            shutil.rmtree(n.workdir, ignore_errors=True)


def _fmt(r: dict) -> str:
    roles = ", ".join(f"{k} {v}" for k, v in r["cpu_us_per_msg"].items() if v >= 0.5)
    p50 = f"{r['p50_ms']:.1f} ms" if r["p50_ms"] is not None else "-"
    return (f"{r['setup']:<11} {r['publish_rate']:>9,.0f} msg/s  p50 {p50:>8}  "
            f"CPU {r['cpu_us_per_msg_total']:.0f} us/msg ({roles})  load {r['loadavg']:.1f}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    perf_args = DEFAULT_PERF
    if "--" in argv:
        i = argv.index("--")
        argv, perf_args = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(prog="python -m loadtest.repl_ratio", description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="standalone/cluster pairs (default 3)")
    ap.add_argument("--followers", type=int, default=2, help="followers of the leader (default 2)")
    ap.add_argument("--frontends", type=int, default=0, help="--frontends of every node (default: the node's)")
    ap.add_argument("--shards", type=int, default=0, help="--shards of every node (default: the node's)")
    ap.add_argument("--tree", help="run the nodes from this checkout (A/B a revision; default: this one)")
    ap.add_argument("--json", action="store_true", help="print one JSON object per run")
    args = ap.parse_args(argv)
    if args.tree:
        global REPO_ROOT
        REPO_ROOT = Path(args.tree).resolve()
    node_args: list[str] = []
    if args.frontends:
        node_args += ["--frontends", str(args.frontends)]
    if args.shards:
        node_args += ["--shards", str(args.shards)]
    workdir = Path(tempfile.mkdtemp(prefix="shardmq-ratio-"))
    ratios = []
    try:
        print(f"perf args: {' '.join(perf_args)}; node args: {' '.join(node_args) or '(defaults)'}", flush=True)
        for r in range(args.runs):
            solo = run_standalone(workdir, node_args, perf_args)
            clus = run_cluster(workdir, node_args, perf_args, args.followers)
            ratio = clus["publish_rate"] / solo["publish_rate"] if solo["publish_rate"] else 0.0
            ratios.append(ratio)
            for res in (solo, clus):
                print(json.dumps(res) if args.json else f"run {r + 1}  {_fmt(res)}", flush=True)
            print(f"run {r + 1}  ratio {ratio:.2f}x", flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if ratios:
        print(f"ratios {' / '.join(f'{x:.2f}' for x in ratios)}; median {statistics.median(ratios):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
