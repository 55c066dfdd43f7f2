"""Network namespaces for the partition drill: one namespace per node on a private bridge.

    bridge smqb<id> (root namespace, 10.213.X.1/24: etcd, haproxy and the drill live here)
      +- veth smq<id>h<i> <-> eth0 in namespace shardmq-<id>-n<i> (10.213.X.(10+i))

``cut(i)`` sets the root-side end of node i's veth down: that node reaches nothing (etcd, the other
nodes, haproxy) and nothing reaches it; ``heal(i)`` sets it up again. Only iproute2 (``ip``) is
needed, run as root.

Every name carries the run's id and is recorded in ``/run/shardmq-netns/<id>.json`` (with the
pid of the run) before it is created. ``cleanup_stale()``, called at the start of every run,
removes what a run that is no longer alive left behind (a killed test run), by those recorded
names only; ``Topology.close()`` removes this run's at its end.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

IP = shutil.which("ip") or "/usr/sbin/ip"
REGISTRY = Path("/run/shardmq-netns")


class NetnsError(RuntimeError):
    pass


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run([IP, *args], capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {out.stderr.strip() or out.stdout.strip()}")
    return out


def available() -> str | None:
    """None when namespaces can be made here, else why not."""
    if not os.access(IP, os.X_OK):
        return f"{IP} not found: install Debian's iproute2 (scripts/test.sh does)"
    if os.geteuid() != 0:
        return "network namespaces need root"
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove(record: dict) -> None:
    """Remove a run's recorded namespaces (ending the processes still inside them) and links."""
    for ns in record.get("netns", []):
        pids = _ip("netns", "pids", ns, check=False).stdout.split()
        for pid in pids:  # processes that run started in its own namespace (a node it left behind)
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        _ip("netns", "del", ns, check=False)  # deletes the veth pair with it
    for link in record.get("links", []):
        _ip("link", "del", link, check=False)


def cleanup_stale() -> int:
    """Remove what earlier runs that are no longer alive left behind; how many runs."""
    if not REGISTRY.is_dir():
        return 0
    removed = 0
    for path in REGISTRY.glob("*.json"):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if _alive(int(record.get("pid", 0))) and record.get("pid") != os.getpid():
            continue
        _remove(record)
        path.unlink(missing_ok=True)
        removed += 1
    return removed


def _free_subnet() -> int:
    """X of a 10.213.X.0/24 that no interface of the host uses."""
    used = set(int(m) for m in re.findall(r"inet 10\.213\.(\d+)\.", _ip("-o", "-4", "addr", "show").stdout))
    for x in range(1, 255):
        if x not in used:
            return x
    raise NetnsError("no free 10.213.X.0/24 subnet")


@dataclass
class Topology:
    nodes: int
    run_id: str = field(default_factory=lambda: f"{os.getpid() % 100000}")
    subnet: int = 0
    record: dict = field(default_factory=dict)

    @property
    def bridge(self) -> str:
        return f"smqb{self.run_id}"

    @property
    def host_ip(self) -> str:
        """The root namespace's address on the bridge (etcd, haproxy)."""
        return f"10.213.{self.subnet}.1"

    def netns(self, i: int) -> str:
        return f"shardmq-{self.run_id}-n{i}"

    def veth(self, i: int) -> str:
        return f"smq{self.run_id}h{i}"

    def ip_of(self, i: int) -> str:
        return f"10.213.{self.subnet}.{10 + i}"

    def wrap(self, i: int) -> list[str]:
        """Prefix of an argv that runs in node i's namespace (``ip netns exec`` execs: same pid)."""
        return [IP, "netns", "exec", self.netns(i)]

    @property
    def _record_path(self) -> Path:
        return REGISTRY / f"{self.run_id}.json"

    def _save(self) -> None:
        REGISTRY.mkdir(parents=True, exist_ok=True)
        self._record_path.write_text(json.dumps(self.record))

    def create(self) -> Topology:
        reason = available()
        if reason:
            raise NetnsError(reason)
        cleanup_stale()
        self.subnet = _free_subnet()
        # Recorded before creation: a run killed half-way is still cleaned up by the next one.
        self.record = {"pid": os.getpid(), "links": [self.bridge],
                       "netns": [self.netns(i) for i in range(self.nodes)]}
        self._save()
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.host_ip}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i in range(self.nodes):
            ns = self.netns(i)
            _ip("netns", "add", ns)
            _ip("link", "add", self.veth(i), "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", self.veth(i), "master", self.bridge, "up")
            _ip("-n", ns, "addr", "add", f"{self.ip_of(i)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        return self

    def cut(self, i: int) -> None:
        """Partition node i from everything: its veth's root-side end goes down."""
        _ip("link", "set", self.veth(i), "down")

    def heal(self, i: int) -> None:
        _ip("link", "set", self.veth(i), "up")

    def close(self) -> None:
        if self.record:
            _remove(self.record)
            self._record_path.unlink(missing_ok=True)
            self.record = {}
