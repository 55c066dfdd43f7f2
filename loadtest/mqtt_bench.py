"""ShardMQ against mosquitto with ``shardmq-perf mqtt throughput``: QoS 0 and 1, 1/1 and 4/4 publishers/subscribers.

    python -m loadtest.mqtt_bench [--repeats 3] [--duration 8] [--inflight 1000] [--frontends 1 --shards 1]

A ShardMQ node (``python -m broker.cli`` from this checkout, fresh temp data dir) and a private
mosquitto (loadtest/mosquitto.py, persistence off), on free loopback ports with the same in-flight
limit; every scenario runs ``--repeats`` times per broker, alternating, each run against a broker
started for it and stopped after it, so only the measured broker runs (as in loadtest/bench.py). Prints one
line per run and a table of medians with the ShardMQ/mosquitto ratio (consumed msgs/s: every
subscriber gets every message, so 4/4 counts 4 deliveries per publish) and the CPU time the broker's
processes (ShardMQ: the node and its workers) used per consumed message, which moves much less than
msg/s on a shared machine. Each broker is stopped by pid after its run.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from loadtest.mosquitto import PrivateMosquitto, package_version
from loadtest.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = (("qos0-1p1c", 0, 1, 1), ("qos1-1p1c", 1, 1, 1), ("qos0-4p4c", 0, 4, 4), ("qos1-4p4c", 1, 4, 4))


class ShardMQ:
    def __init__(self, inflight: int, frontends: int, shards: int) -> None:
        self.dir = tempfile.mkdtemp(prefix="shardmq-mqtt-bench-")
        self.port, self.mqtt_port = free_port(), free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "broker.cli", "--data-dir", self.dir, "--port", str(self.port), "--mqtt-port",
             str(self.mqtt_port), "--mqtt-max-inflight", str(inflight), "--frontends", str(frontends),
             "--shards", str(shards), "--log-level", "warning", "--ws-port", "0",
             # Only the MQTT port is measured; the default HTTP/metrics ports may be taken on a shared host.
             "--http-port", "0", "--prometheus-port", "0"],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=open(os.path.join(self.dir, "node.log"), "wb"))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.mqtt_port), timeout=0.2).close()
                return
            except OSError:
                if self.proc.poll() is not None:
                    break
                time.sleep(0.1)
        self.stop()
        raise RuntimeError("ShardMQ did not start")

    @property
    def url(self) -> str:
        return f"mqtt://guest:guest@127.0.0.1:{self.mqtt_port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)
        subprocess.run(["rm", "-rf", self.dir], check=False)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of pid and of its children (for the node: its workers), from /proc."""
    total = 0.0
    for p in [pid, *_children(pid)]:
        try:
            with open(f"/proc/{p}/stat") as fh:
                f = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    return total


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fh:
            return [int(c) for c in fh.read().split()]
    except OSError:
        return []


def run(url: str, qos: int, pubs: int, subs: int, duration: float) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "loadtest.cli", "mqtt", "throughput", "--uri", url, "--qos", str(qos),
                          "-x", str(pubs), "-y", str(subs), "-s", "16", "-z", str(duration), "--json"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=duration + 120)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return {"publish_rate": 0.0, "consume_rate": 0.0, "error": out.stderr[-300:]}
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.mqtt_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--duration", type=float, default=8.0)
    p.add_argument("--inflight", type=int, default=1000, help="in-flight limit of both brokers (default 1000)")
    p.add_argument("--frontends", type=int, default=1)
    p.add_argument("--shards", type=int, default=1)
    p.add_argument("--scenarios", default=",".join(s[0] for s in SCENARIOS))
    args = p.parse_args(argv)
    wanted = [s for s in SCENARIOS if s[0] in args.scenarios.split(",")]
    rates: dict[tuple[str, str], list[float]] = {}
    cpu: dict[tuple[str, str], list[float]] = {}
    print(f"mosquitto {package_version()}, load average {os.getloadavg()[0]:.1f}, cores {os.cpu_count()}")
    for name, qos, pubs, subs in wanted:
        for r in range(args.repeats):
            for broker in ("shardmq", "mosquitto"):
                server = (ShardMQ(args.inflight, args.frontends, args.shards) if broker == "shardmq"
                          else PrivateMosquitto(max_inflight=args.inflight).start())
                try:
                    cpu0 = cpu_seconds(server.proc.pid)
                    result = run(server.url, qos, pubs, subs, args.duration)
                    used = cpu_seconds(server.proc.pid) - cpu0
                finally:
                    server.stop()
                per_msg = used / result["consumed"] * 1e6 if result.get("consumed") else 0.0
                rates.setdefault((name, broker), []).append(result["consume_rate"])
                cpu.setdefault((name, broker), []).append(per_msg)
                print(f"{name} run{r + 1} {broker}: publish {result['publish_rate']:.0f} consume "
                      f"{result['consume_rate']:.0f} msgs/s, broker CPU {per_msg:.2f} us/msg, load average "
                      f"{os.getloadavg()[0]:.1f}{' ' + result['error'] if 'error' in result else ''}", flush=True)
    print("\n| scenario | ShardMQ consumed msgs/s (median) | mosquitto | ratio | CPU us/msg ShardMQ | mosquitto |"
          "\n|---|---|---|---|---|---|")
    for name, *_ in wanted:
        ours, theirs = statistics.median(rates[(name, "shardmq")]), statistics.median(rates[(name, "mosquitto")])
        print(f"| {name} | {ours:.0f} | {theirs:.0f} | {ours / theirs if theirs else 0:.2f} | "
              f"{statistics.median(cpu[(name, 'shardmq')]):.2f} | {statistics.median(cpu[(name, 'mosquitto')]):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
