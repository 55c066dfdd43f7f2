"""Private, throw-away etcd servers (one member or a small cluster) for tests and the failover drill.

Each member lives in a temp dir and listens on free loopback ports; the timings are the tuned ones
of docs/cluster.md (``--heartbeat-interval 50 --election-timeout 500``) so a 1 s lease works.
Everything started here is stopped by PID.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from loadtest.ports import free_port  # re-exported: the drills take their ports here too

ETCD = "/usr/bin/etcd"


class EtcdError(RuntimeError):
    pass


class EtcdMember:
    def __init__(self, name: str, workdir: Path, host: str = "127.0.0.1") -> None:
        self.name = name
        self.workdir = workdir
        self.host = host
        self.client_port = free_port()
        self.peer_port = free_port()
        self.proc: subprocess.Popen | None = None
        self.paused = False

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"


class EtcdCluster:
    """``size`` etcd members on loopback (or on ``host``, e.g. the partition drill's bridge address).
    ``endpoints`` is the comma list for ``--etcd-endpoints``."""

    def __init__(self, size: int = 1, base_dir: str | Path | None = None,
                 heartbeat_ms: int = 50, election_ms: int = 500, host: str = "127.0.0.1") -> None:
        if not os.access(ETCD, os.X_OK):
            raise EtcdError(f"{ETCD} not found: install Debian's etcd-server (scripts/test.sh does)")
        self._own_dir = base_dir is None
        self.base_dir = Path(base_dir or tempfile.mkdtemp(prefix="shardmq-etcd-"))
        self.heartbeat_ms = heartbeat_ms
        self.election_ms = election_ms
        self.members = [EtcdMember(f"e{i}", self.base_dir / f"e{i}", host) for i in range(size)]

    @property
    def endpoints(self) -> str:
        return ",".join(m.endpoint for m in self.members)

    def _argv(self, m: EtcdMember, state: str) -> list[str]:
        initial = ",".join(f"{x.name}={x.peer_url}" for x in self.members)
        return [
            ETCD, "--name", m.name, "--data-dir", str(m.workdir / "data"),
            "--listen-client-urls", f"http://{m.endpoint}", "--advertise-client-urls", f"http://{m.endpoint}",
            "--listen-peer-urls", m.peer_url, "--initial-advertise-peer-urls", m.peer_url,
            "--initial-cluster", initial, "--initial-cluster-state", state,
            "--initial-cluster-token", f"shardmq-{os.getpid()}-{id(self)}",
            "--heartbeat-interval", str(self.heartbeat_ms), "--election-timeout", str(self.election_ms),
            "--log-level", "warn", "--logger", "zap",
        ]

    def start(self, timeout: float = 20.0) -> EtcdCluster:
        for m in self.members:
            self.start_member(m, wait=False)
        self.wait_healthy(timeout)
        return self

    def start_member(self, m: EtcdMember, wait: bool = True, timeout: float = 20.0) -> None:
        m.workdir.mkdir(parents=True, exist_ok=True)
        state = "existing" if (m.workdir / "data").exists() else "new"
        log = open(m.workdir / "etcd.log", "ab")
        m.proc = subprocess.Popen(self._argv(m, state), stdin=subprocess.DEVNULL, stdout=log,
                                  stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        m.paused = False
        if wait:
            self.wait_healthy(timeout, [m])

    def stop_member(self, m: EtcdMember, sig: int = signal.SIGTERM) -> None:
        if m.proc is None or m.proc.poll() is not None:
            return
        if m.paused:
            os.kill(m.proc.pid, signal.SIGCONT)
        m.proc.send_signal(sig)
        try:
            m.proc.wait(10)
        except subprocess.TimeoutExpired:
            m.proc.kill()
            m.proc.wait()

    def pause_member(self, m: EtcdMember) -> None:
        os.kill(m.proc.pid, signal.SIGSTOP)
        m.paused = True

    def resume_member(self, m: EtcdMember) -> None:
        os.kill(m.proc.pid, signal.SIGCONT)
        m.paused = False

    def wait_healthy(self, timeout: float = 20.0, members: list[EtcdMember] | None = None) -> None:
        """Wait until every member answers a linearizable read (the cluster has a raft leader)."""
        import urllib.error
        import urllib.request

        deadline = time.monotonic() + timeout
        for m in members or self.members:
            while True:
                if m.proc is None or m.proc.poll() is not None:
                    raise EtcdError(f"etcd {m.name} exited: {self.log_tail(m)}")
                try:
                    with urllib.request.urlopen(f"http://{m.endpoint}/health", timeout=1) as resp:
                        if b'"true"' in resp.read():
                            break
                except (urllib.error.URLError, OSError):
                    pass
                if time.monotonic() > deadline:
                    raise EtcdError(f"etcd {m.name} not healthy after {timeout:.0f}s: {self.log_tail(m)}")
                time.sleep(0.05)

    def log_tail(self, m: EtcdMember, lines: int = 20) -> str:
        try:
            return "\n".join((m.workdir / "etcd.log").read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        for m in self.members:
            self.stop_member(m)
        if self._own_dir:
            shutil.rmtree(self.base_dir, ignore_errors=True)

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
