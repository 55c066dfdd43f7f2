"""The failover drill, on one machine: 3-member etcd, three nodes, haproxy, clients, N leader kills.

    python -m deploy.drill.failover --kills 5 --lease-ttl 1

For every kill (``kill -9`` of the leader's whole process group) it prints: detection (kill ->
the leader key is gone or replaced), promotion (new leader key -> its leader health check
answers 200), first confirm through haproxy after the kill, and for the messages confirmed
since the previous kill: confirmed, received, lost, duplicated. The killed node is started again
and must re-enter the ISR before the next kill. Everything runs in a temp dir on free loopback
ports and is stopped by PID at the end. docs/cluster.md has the results.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from deploy.drill.clients import Consumer, Publisher
from deploy.drill.haproxy import Backend, HAProxy
from loadtest.etcd import EtcdCluster, free_port
from loadtest.node_process import spawn_node
from replication.coordination import Coordinator

REPO_ROOT = Path(__file__).resolve().parents[2]
ACK_SETTLE_S = 1.0


def _http(port: int, path: str, timeout: float = 0.5, host: str = "127.0.0.1") -> int:
    try:
        with urllib.request.urlopen(f"http://{host}:{port}{path}", timeout=timeout) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, OSError):
        return 0


def _other_listeners_off() -> list[str]:
    """``--X-port 0`` for every other listener this build has: three nodes share one machine."""
    from broker.config import OPTIONS_BY_NAME

    names = ("mqtt_port", "mqtts_port", "amqps_port", "ws_port", "prometheus_port")
    return [arg for n in names if n in OPTIONS_BY_NAME for arg in (OPTIONS_BY_NAME[n].flag, "0")]


class DrillNode:
    """One node. ``host`` is the address it listens on and advertises; ``wrap`` prefixes its argv
    (the partition drill runs it in a network namespace: ``ip netns exec NS``)."""

    def __init__(self, name: str, workdir: Path, etcd: str, prefix: str, ttl: int, secret: Path,
                 host: str = "127.0.0.1", wrap: tuple[str, ...] = ()) -> None:
        self.name = name
        self.workdir = workdir
        self.host = host
        self.port, self.http_port, self.repl_port = free_port(), free_port(), free_port()
        bind = [] if host == "127.0.0.1" else [
            # Its own namespace: every listener on its address; clients come through haproxy from
            # the bridge, so guest may log in from there (a private test network).
            "--bind", host, "--http-bind", host, "--replication-bind", host, "--loopback-users", "none"]
        self.argv = [*wrap, sys.executable, "-m", "broker.cli", "--data-dir", str(workdir / "data"),
                     "--port", str(self.port), "--http-port", str(self.http_port),
                     "--replication-port", str(self.repl_port), "--frontends", "1", "--shards", "1",
                     "--cluster", "--etcd-endpoints", etcd, "--etcd-prefix", prefix, "--node-name", name,
                     "--advertised-host", host, "--lease-ttl", str(ttl),
                     "--cluster-secret-file", str(secret), *bind, *_other_listeners_off()]
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = spawn_node(self.argv, self.workdir, REPO_ROOT)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill9_group(self) -> None:
        """kill -9 of the node's whole process group (node, frontends, shards at once)."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.running():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                pass
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()

    def is_leader(self) -> bool:
        return self.running() and _http(self.http_port, "/api/health/checks/leader", host=self.host) == 200


@dataclass
class KillResult:
    victim: str
    new_leader: str = "?"
    detection_s: float | None = None
    promotion_s: float | None = None
    first_confirm_s: float | None = None
    rejoined_s: float | None = None
    window: tuple[float, float] = (0.0, 0.0)
    confirmed: int = 0
    received: int = 0
    lost: int = 0
    duplicated: int = 0


@dataclass
class DrillResult:
    kills: list[KillResult] = field(default_factory=list)
    confirmed: int = 0
    received: int = 0
    lost: int = 0
    duplicated: int = 0
    redelivered_after_ack: int = 0
    unconfirmed: int = 0
    publisher_reconnects: int = 0

    def table(self) -> str:
        rows = [("kill", "victim", "new leader", "detect s", "promote s", "1st confirm s", "rejoin s",
                 "confirmed", "received", "lost", "dup")]
        for i, k in enumerate(self.kills, 1):
            rows.append((str(i), k.victim, k.new_leader, _f(k.detection_s), _f(k.promotion_s),
                         _f(k.first_confirm_s), _f(k.rejoined_s), str(k.confirmed), str(k.received),
                         str(k.lost), str(k.duplicated)))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
        lines.append(f"total: confirmed {self.confirmed}, received {self.received}, lost {self.lost}, "
                     f"duplicated {self.duplicated} (acked >= {ACK_SETTLE_S:.0f} s before a kill and back: "
                     f"{self.redelivered_after_ack}), "
                     f"unconfirmed at a kill {self.unconfirmed}, publisher reconnects {self.publisher_reconnects}")
        return "\n".join(lines)


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


class Drill:
    def __init__(self, workdir: Path, kills: int, ttl: int, interval: float, nodes: int = 3,
                 etcd_members: int = 3, rejoin_timeout: float = 60.0, log=print) -> None:
        self.workdir = Path(workdir)
        self.kills = kills
        self.ttl = ttl
        self.interval = interval
        self.n = nodes
        self.etcd_members = etcd_members
        self.rejoin_timeout = rejoin_timeout
        self.log = log
        self.etcd: EtcdCluster | None = None
        self.nodes: list[DrillNode] = []
        self.haproxy: HAProxy | None = None
        self.coord: Coordinator | None = None
        self.prefix = "drill"
        self.event = "kill"  # what happens to the leader, in the log lines

    # ----------------------------------------------------------- etcd reads
    def _etcd(self, coro_fn):
        return asyncio.run(coro_fn())

    def leader_name(self) -> str | None:
        try:
            info = self._etcd(self.coord.leader)
        except Exception:
            return "?"
        return info.name if info else None

    def isr(self) -> list[str]:
        try:
            return self._etcd(self.coord.isr) or []
        except Exception:
            return []

    def wait(self, predicate, timeout: float, what: str, interval: float = 0.02):
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"drill: timed out after {timeout:.0f}s waiting for {what}")
            time.sleep(interval)

    # ------------------------------------------------------------- phases
    def make_etcd(self) -> EtcdCluster:
        return EtcdCluster(self.etcd_members, self.workdir / "etcd")

    def make_node(self, i: int, secret: Path) -> DrillNode:
        return DrillNode(f"n{i + 1}", self.workdir / f"n{i + 1}", self.etcd.endpoints, self.prefix,
                         self.ttl, secret)

    def setup(self) -> None:
        self.etcd = self.make_etcd().start()
        self.coord = Coordinator(self.etcd.endpoints.split(","), self.prefix, "drill", 10)
        secret = self.workdir / "secret"
        secret.write_text(os.urandom(16).hex())
        self.nodes = [self.make_node(i, secret) for i in range(self.n)]
        for node in self.nodes:
            node.start()
        self.wait(lambda: sum(n.is_leader() for n in self.nodes) == 1, 60, "a leader")
        self.wait(lambda: len(self.isr()) == self.n, 120, f"all {self.n} nodes in the ISR")
        self.haproxy = HAProxy(self.workdir / "haproxy", free_port(),
                               [Backend(n.name, n.host, n.port, n.http_port) for n in self.nodes]).start()
        self.log(f"cluster up: leader {self.leader_name()}, ISR {self.isr()}, haproxy on "
                 f"127.0.0.1:{self.haproxy.listen_port}, etcd {self.etcd.endpoints}")

    def run(self) -> DrillResult:
        result = DrillResult()
        pub = Publisher("127.0.0.1", self.haproxy.listen_port)
        con = Consumer("127.0.0.1", self.haproxy.listen_port)
        pub.start()
        con.start()
        self.wait(lambda: len(pub.confirmed) > 0, 30, "the first confirm through haproxy")
        window_start = time.monotonic()
        unconfirmed_at_kills: set[int] = set()
        for _ in range(self.kills):
            time.sleep(self.interval)
            k, t_kill = self._kill_leader(pub, unconfirmed_at_kills)
            k.window = (window_start, t_kill)
            window_start = t_kill
            result.kills.append(k)
            self.log(f"{self.event} {len(result.kills)}: {k.victim} -> {k.new_leader}: detection {_f(k.detection_s)} s, "
                     f"promotion {_f(k.promotion_s)} s, first confirm {_f(k.first_confirm_s)} s, "
                     f"rejoined {_f(k.rejoined_s)} s")
        time.sleep(0.5)
        pub.stop_event.set()
        pub.join(10)
        confirmed = dict(pub.confirmed)
        # Drain: every confirmed message must arrive.
        try:
            self.wait(lambda: all(s in con.received for s in confirmed), 60, "the consumer to drain", 0.2)
        except TimeoutError:
            pass
        self.wait(lambda: time.monotonic() - con.last_receive > 1.0, 30, "the consumer to go idle", 0.2)
        con.stop_event.set()
        con.join(10)
        received = dict(con.received)
        result.confirmed = len(confirmed)
        result.received = len(received)
        result.lost = sum(1 for s in confirmed if s not in received)
        result.duplicated = sum(1 for c in received.values() if c > 1)
        # An ack is fire-and-forget in AMQP: one sent just before a kill may not have reached the
        # followers. Acks sent a second or more before a kill must have.
        kills = [k.window[1] for k in result.kills]
        result.redelivered_after_ack = sum(
            1 for _seq, acked, again in con.redelivered_after_ack
            if any(acked < t - ACK_SETTLE_S and again > t for t in kills))
        result.unconfirmed = len(unconfirmed_at_kills)
        result.publisher_reconnects = pub.reconnects
        for k in result.kills:
            seqs = [s for s, t in confirmed.items() if k.window[0] <= t < k.window[1]]
            k.confirmed = len(seqs)
            k.received = sum(1 for s in seqs if s in received)
            k.lost = k.confirmed - k.received
            k.duplicated = sum(1 for s in seqs if received.get(s, 0) > 1)
        return result

    def _kill_leader(self, pub: Publisher, unconfirmed: set[int]) -> tuple[KillResult, float]:
        leader = self.wait(lambda: next((n for n in self.nodes if n.is_leader()), None), 30, "a leader")
        k = KillResult(victim=leader.name)
        t_kill = time.monotonic()
        leader.kill9_group()
        unconfirmed |= set(pub.unconfirmed) | {pub.next_seq - 1, pub.next_seq}
        self.wait(lambda: self.leader_name() != leader.name, 60, "the dead leader's key to go")
        t_detect = time.monotonic()
        new = self.wait(lambda: (name := self.leader_name()) not in (None, "?", leader.name) and name,
                        60, "a new leader")
        t_elected = time.monotonic()
        k.new_leader = new
        node = next(n for n in self.nodes if n.name == new)
        self.wait(node.is_leader, 60, f"{new} to serve")
        k.detection_s = t_detect - t_kill
        k.promotion_s = time.monotonic() - t_elected
        first = self.wait(lambda: pub.first_confirm_after(t_kill), 60, "a confirm on a new connection")
        k.first_confirm_s = first - t_kill
        leader.start()
        self.wait(lambda: leader.name in self.isr(), self.rejoin_timeout, f"{leader.name} back in the ISR")
        k.rejoined_s = time.monotonic() - t_kill
        return k, t_kill

    def teardown(self) -> None:
        if self.haproxy is not None:
            self.haproxy.stop()
        for node in self.nodes:
            node.stop()
        if self.coord is not None:
            try:
                asyncio.run(self.coord.stop())
            except Exception:
                pass
        if self.etcd is not None:
            self.etcd.stop()


def run_drill(workdir: Path, kills: int, ttl: int = 1, interval: float = 3.0, log=print) -> DrillResult:
    drill = Drill(workdir, kills, ttl, interval, log=log)
    try:
        drill.setup()
        return drill.run()
    finally:
        drill.teardown()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deploy.drill.failover", description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=3, help="leader kills (default 3)")
    p.add_argument("--lease-ttl", type=int, default=1, help="--lease-ttl of the nodes (default 1)")
    p.add_argument("--interval", type=float, default=5.0, help="seconds of load between kills (default 5)")
    p.add_argument("--workdir", help="keep data dirs and logs here (default: a temp dir, removed)")
    p.add_argument("--json", action="store_true", help="print the result as JSON too")
    args = p.parse_args(argv)
    if args.kills < 1 or args.lease_ttl < 1:
        p.error("--kills and --lease-ttl must be >= 1")
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="shardmq-drill-"))
    try:
        result = run_drill(workdir, args.kills, args.lease_ttl, args.interval)
    except TimeoutError as exc:
        print(f"{exc}; logs in {workdir}", file=sys.stderr)
        return 1
    print(result.table())
    if args.json:
        print(json.dumps([k.__dict__ for k in result.kills] + [{"lost": result.lost}], default=str))
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if result.lost == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
