"""The partition drill: the leader cut off from etcd, the followers and the load balancer.

    python -m deploy.drill.partition --partitions 3 --lease-ttl 1     # as root (network namespaces)

A 3-member etcd and haproxy run in the root network namespace on a private bridge; each node runs
in its own namespace behind a veth (deploy/drill/netns.py). A confirming publisher and a verifying
consumer go through haproxy, as in the failover drill; a second confirming publisher runs *inside*
the leader's namespace, connected straight to it (a client on the leader's side of the partition,
which can still reach it: the split-brain case). Per partition: the leader's veth goes down; the
leader must stop confirming (fence) before its lease can expire (TTL/2 after the last renewal), a
follower is elected once the lease expires and clients confirm again through haproxy; then the link
comes back, the old leader rejoins as a follower and re-enters the ISR. It prints per partition:
fence (cut -> the direct client's connection closed), the old leader's last confirm (relative to
the cut), detection (cut -> leader key gone), promotion, first confirm through haproxy, rejoin, and
whether the old leader confirmed anything after the new one's first confirm (it must not). At the
end every confirmed message (both publishers) must be received: lost must be 0.

Namespaces and links carry the run's id, are recorded in /run/shardmq-netns/ and removed at exit
and, if a run was killed, at the start of the next one.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pika
import pika.exceptions

from deploy.drill.failover import REPO_ROOT, Drill, DrillNode, DrillResult, KillResult, _f
from deploy.drill.netns import Topology
from loadtest.etcd import EtcdCluster

DIRECT_QUEUE = "drill-direct"


@dataclass
class PartitionResult(KillResult):
    fenced_s: float | None = None  # cut -> the direct client's connection to the old leader closed
    old_last_confirm_s: float | None = None  # the old leader's last confirm, relative to the cut
    overlap: bool = False  # the old leader confirmed after the new leader's first confirm
    direct_confirmed: int = 0


class DirectPublisher:
    """deploy/drill/direct_publisher.py in a node's namespace; collects its confirms."""

    def __init__(self, wrap: list[str], host: str, port: int, tag: str, log_path: Path) -> None:
        self.tag = tag  # bodies are "<tag>-<seq>": one tag per publisher, so no two collide
        self.confirmed: dict[int, float] = {}
        self.closed_at: float | None = None
        self.reason = ""
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(
            [*wrap, sys.executable, "-m", "deploy.drill.direct_publisher", host, str(port), DIRECT_QUEUE, tag],
            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=self._log, stdin=subprocess.DEVNULL, text=True,
            start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            parts = line.split(maxsplit=2)
            if parts and parts[0] == "C":
                self.confirmed[int(parts[1])] = float(parts[2])
            elif parts and parts[0] == "X":
                self.reason = parts[2].strip() if len(parts) > 2 else ""
                self.closed_at = float(parts[1])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._reader.join(5)
        self._log.close()


class PartitionDrill(Drill):
    def __init__(self, workdir: Path, partitions: int, ttl: int, interval: float, log=print) -> None:
        super().__init__(workdir, partitions, ttl, interval, log=log)
        self.topo = Topology(self.n)
        self.event = "partition"
        self.direct: list[DirectPublisher] = []

    def make_etcd(self) -> EtcdCluster:
        return EtcdCluster(self.etcd_members, self.workdir / "etcd", host=self.topo.host_ip)

    def make_node(self, i: int, secret: Path) -> DrillNode:
        return DrillNode(f"n{i + 1}", self.workdir / f"n{i + 1}", self.etcd.endpoints, self.prefix, self.ttl,
                         secret, host=self.topo.ip_of(i), wrap=tuple(self.topo.wrap(i)))

    def setup(self) -> None:
        self.topo.create()
        self.log(f"network namespaces {', '.join(self.topo.netns(i) for i in range(self.n))} on bridge "
                 f"{self.topo.bridge} ({self.topo.host_ip}/24)")
        super().setup()

    def role_of(self, node: DrillNode) -> str | None:
        import urllib.request
        try:
            url = f"http://{node.host}:{node.http_port}/api/cluster/status"
            with urllib.request.urlopen(url, timeout=1) as resp:
                return json.loads(resp.read()).get("role")
        except (OSError, ValueError):
            return None

    def _kill_leader(self, pub, unconfirmed: set[int]) -> tuple[KillResult, float]:
        """One partition of the leader (the failover drill's kill, replaced)."""
        leader = self.wait(lambda: next((n for n in self.nodes if n.is_leader()), None), 30, "a leader")
        i = self.nodes.index(leader)
        k = PartitionResult(victim=leader.name)
        direct = DirectPublisher(self.topo.wrap(i), leader.host, leader.port, f"d{len(self.direct)}",
                                 self.workdir / f"direct-{len(self.direct)}.log")
        self.direct.append(direct)
        self.wait(lambda: len(direct.confirmed) >= 20 or direct.proc.poll() is not None, 30,
                  "confirms of the direct publisher")
        if not direct.confirmed:
            raise TimeoutError(f"the direct publisher got no confirm: {direct.reason}")
        t_cut = time.monotonic()
        self.topo.cut(i)
        unconfirmed |= set(pub.unconfirmed) | {pub.next_seq - 1, pub.next_seq}
        # The old leader fences itself: its direct client's connection is closed.
        self.wait(lambda: direct.closed_at is not None, 30, "the old leader to close its client connections")
        k.fenced_s = direct.closed_at - t_cut
        k.old_last_confirm_s = max(direct.confirmed.values()) - t_cut
        k.direct_confirmed = len(direct.confirmed)
        direct.stop()
        self.wait(lambda: self.leader_name() not in (leader.name, "?"), 60, "the old leader's key to go")
        t_detect = time.monotonic()
        new = self.wait(lambda: (name := self.leader_name()) not in (None, "?", leader.name) and name,
                        60, "a new leader")
        t_elected = time.monotonic()
        k.new_leader = new
        node = next(n for n in self.nodes if n.name == new)
        self.wait(node.is_leader, 60, f"{new} to serve")
        k.detection_s = t_detect - t_cut
        k.promotion_s = time.monotonic() - t_elected
        first = self.wait(lambda: pub.first_confirm_after(t_cut), 60, "a confirm on a new connection")
        k.first_confirm_s = first - t_cut
        k.overlap = max(direct.confirmed.values()) >= first
        # Heal: the old leader comes back as a follower, resyncs and re-enters the ISR.
        self.topo.heal(i)
        self.wait(lambda: self.role_of(leader) == "follower", self.rejoin_timeout, f"{leader.name} to follow")
        self.wait(lambda: leader.name in self.isr(), self.rejoin_timeout, f"{leader.name} back in the ISR")
        k.rejoined_s = time.monotonic() - t_cut
        return k, t_cut

    def drain_direct(self) -> tuple[int, int]:
        """(confirmed, lost) of the direct publishers: every confirm must be on the new leader."""
        confirmed = {f"{d.tag}-{seq}" for d in self.direct for seq in d.confirmed}
        got: set[str] = set()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not confirmed <= got:
            try:
                conn = pika.BlockingConnection(pika.ConnectionParameters(
                    "127.0.0.1", self.haproxy.listen_port, credentials=pika.PlainCredentials("guest", "guest"),
                    connection_attempts=1, socket_timeout=2))
                try:
                    ch = conn.channel()
                    for method, _props, body in ch.consume(DIRECT_QUEUE, inactivity_timeout=1.0):
                        if method is None:
                            break
                        got.add(body.decode())
                        ch.basic_ack(method.delivery_tag)
                finally:
                    conn.close()
            except (pika.exceptions.AMQPError, OSError):
                time.sleep(0.2)
        return len(confirmed), len(confirmed - got)

    def teardown(self) -> None:
        for d in self.direct:
            d.stop()
        try:
            super().teardown()
        finally:
            self.topo.close()


@dataclass
class PartitionDrillResult:
    drill: DrillResult
    direct_confirmed: int = 0
    direct_lost: int = 0

    @property
    def lost(self) -> int:
        return self.drill.lost + self.direct_lost

    @property
    def partitions(self) -> list[PartitionResult]:
        return self.drill.kills  # type: ignore[return-value]

    def table(self) -> str:
        rows = [("cut", "leader", "new leader", "fence s", "last old confirm s", "detect s", "promote s",
                 "1st confirm s", "rejoin s", "overlap", "confirmed", "direct", "lost", "dup")]
        for i, k in enumerate(self.partitions, 1):
            rows.append((str(i), k.victim, k.new_leader, _f(k.fenced_s), _f(k.old_last_confirm_s),
                         _f(k.detection_s), _f(k.promotion_s), _f(k.first_confirm_s), _f(k.rejoined_s),
                         "YES" if k.overlap else "no", str(k.confirmed), str(k.direct_confirmed), str(k.lost),
                         str(k.duplicated)))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
        d = self.drill
        lines.append(f"total: through haproxy confirmed {d.confirmed}, received {d.received}, lost {d.lost}, "
                     f"duplicated {d.duplicated}; direct to the old leaders confirmed {self.direct_confirmed}, "
                     f"lost {self.direct_lost}; publisher reconnects {d.publisher_reconnects}")
        return "\n".join(lines)


def run_partition_drill(workdir: Path, partitions: int, ttl: int = 1, interval: float = 3.0,
                        log=print) -> PartitionDrillResult:
    drill = PartitionDrill(workdir, partitions, ttl, interval, log=log)
    try:
        drill.setup()
        result = drill.run()
        confirmed, lost = drill.drain_direct()
        return PartitionDrillResult(result, confirmed, lost)
    finally:
        drill.teardown()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deploy.drill.partition", description=__doc__.split("\n\n")[0])
    p.add_argument("--partitions", type=int, default=3, help="leader partitions (default 3)")
    p.add_argument("--lease-ttl", type=int, default=1, help="--lease-ttl of the nodes (default 1)")
    p.add_argument("--interval", type=float, default=5.0, help="seconds of load between partitions (default 5)")
    p.add_argument("--workdir", help="keep data dirs and logs here (default: a temp dir, removed)")
    p.add_argument("--json", action="store_true", help="print the result as JSON too")
    args = p.parse_args(argv)
    if args.partitions < 1 or args.lease_ttl < 1:
        p.error("--partitions and --lease-ttl must be >= 1")
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="shardmq-partition-"))
    # SIGTERM unwinds like Ctrl-C, so the nodes stop and the namespaces go (the next run would
    # remove them anyway).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        result = run_partition_drill(workdir, args.partitions, args.lease_ttl, args.interval)
    except (TimeoutError, RuntimeError) as exc:
        print(f"{exc}; logs in {workdir}", file=sys.stderr)
        return 1
    print(result.table())
    if args.json:
        print(json.dumps([k.__dict__ for k in result.partitions] + [{"lost": result.lost}], default=str))
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    overlap = any(k.overlap for k in result.partitions)
    return 0 if result.lost == 0 and not overlap else 1


if __name__ == "__main__":
    sys.exit(main())
