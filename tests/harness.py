"""Start and stop REAL ShardMQ nodes for integration tests.

A Node runs ``python -m broker.cli`` as a subprocess in its own session, so its
process group id (captured at start, ours) lets teardown kill anything the node
left behind as a last resort. Normal stops go through the node pid: SIGTERM,
wait, SIGKILL. Everything the node prints goes to ``node.log`` next to its data
dir; the fixtures attach the tail of it to a failing test's report.

Every started node is recorded in ``REGISTRY`` (one JSON file per process group:
the group, its leader's start time, and the test process that owns it). A test run
that is killed cannot clean up; the next run (``sweep_stale_nodes`` at session
start) kills the groups whose owner is gone, by recorded PID and start time, never
by name, and never a group of a test run that is still alive (several runs may
share a machine).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pika

from loadtest.ports import free_port, listening_sockets, start_time  # noqa: F401  (tests import free_port from here)

REPO_ROOT = Path(__file__).resolve().parent.parent
STARTUP_TIMEOUT = 30.0  # generous: only a node that never comes up pays it
STOP_TIMEOUT = 15.0
# Workers die with the node (PR_SET_PDEATHSIG); give them this long before the harness kills them.
ORPHAN_GRACE = 5.0


class NodeError(AssertionError):
    """The node did not do what the harness waited for; the message carries the log tail."""


DEFAULT_COMMAND = [sys.executable, "-m", "broker.cli"]


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            stat = fh.read()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes in process group ``pgid``."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as fh:
                stat = fh.read()
        except OSError:
            continue
        # Fields after "(comm)": state ppid pgrp ...; comm may contain spaces and parens.
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry))
    return members


REGISTRY = Path(os.environ.get("SHARDMQ_TEST_REGISTRY") or Path(tempfile.gettempdir()) / "shardmq-test-nodes")


def record_group(pgid: int, workdir: Path, registry: Path = REGISTRY) -> None:
    """Note a node's process group as ours, so a later run can sweep it if we die first."""
    registry.mkdir(parents=True, exist_ok=True)
    me = os.getpid()
    record = {"pgid": pgid, "leader_start": start_time(pgid), "owner": me, "owner_start": start_time(me),
              "workdir": str(workdir)}
    tmp = registry / f".{pgid}.{me}.tmp"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, registry / f"{pgid}.json")


def forget_group(pgid: int, registry: Path = REGISTRY) -> None:
    try:
        (registry / f"{pgid}.json").unlink()
    except FileNotFoundError:
        pass


def sweep_stale_nodes(registry: Path = REGISTRY) -> list[int]:
    """SIGKILL the recorded node groups whose owning test process is gone; returns their pgids.

    A group's members can only be ours while the pgid is held (Linux reuses no pid that is still
    a process group id), so with the leader gone the members are killed; a leader pid that lives
    with another start time was reused and is left alone.
    """
    swept: list[int] = []
    if not registry.is_dir():
        return swept
    for path in registry.glob("*.json"):
        try:
            record = json.loads(path.read_text())
            pgid, owner = int(record["pgid"]), int(record["owner"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if record.get("owner_start") is not None and start_time(owner) == record["owner_start"]:
            continue  # its test run is alive (maybe another one on this machine): not ours to touch
        leader = start_time(pgid)
        reused = leader is not None and leader != record.get("leader_start")
        if not reused and group_members(pgid):
            try:
                os.killpg(pgid, signal.SIGKILL)
                swept.append(pgid)
            except ProcessLookupError:
                pass
            _wait_until(lambda pgid=pgid: not group_members(pgid), ORPHAN_GRACE)
        try:
            path.unlink()
        except FileNotFoundError:
            pass
    return swept


def sweep_own_nodes(registry: Path = REGISTRY) -> list[int]:
    """At exit: SIGKILL the groups this process recorded and never cleaned up (a teardown that failed)."""
    swept: list[int] = []
    if not registry.is_dir():
        return swept
    me = os.getpid()
    for path in registry.glob("*.json"):
        try:
            record = json.loads(path.read_text())
            pgid = int(record["pgid"])
            if int(record["owner"]) != me:
                continue
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if start_time(pgid) in (None, record.get("leader_start")) and group_members(pgid):
            try:
                os.killpg(pgid, signal.SIGKILL)
                swept.append(pgid)
            except ProcessLookupError:
                pass
        path.unlink(missing_ok=True)
    return swept


def _wait_until(predicate, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.02, *,
               pause: Callable[[float], Any] = time.sleep, context: Callable[[], str] | None = None) -> Any:
    """Poll ``predicate`` until it returns something truthy (returned); AssertionError naming ``what``
    after ``timeout`` seconds. What a test waits for instead of sleeping and hoping.
    ``pause(interval)`` runs between polls (``pumping(conn)``: a pika connection's I/O loop, so its
    callbacks run); ``context()`` is added to the failure (a node's log tail, what was seen)."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:.1f}s waiting for {what}"
                                 + (f"\n{context()}" if context is not None else ""))
        pause(interval)
    return value


def pumping(conn: pika.BlockingConnection) -> Callable[[float], None]:
    """``wait_until``'s pause for a test whose predicate reads what pika callbacks gather."""
    return lambda seconds: conn.process_data_events(time_limit=seconds)


async def async_wait_until(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.005) -> Any:
    """``wait_until`` inside an event loop: the loop runs (other tasks, callbacks) while it waits."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out after {timeout:.1f}s waiting for {what}"
        await asyncio.sleep(interval)
    return value


class Node:
    """One ShardMQ node process and its workers, on 127.0.0.1:port with data in ``data_dir``."""

    def __init__(
        self,
        workdir: Path | str,
        *,
        frontends: int = 2,
        shards: int = 2,
        port: int | None = None,
        mqtt_port: int = 0,
        ws_port: int = 0,
        extra_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        log_level: str = "debug",
        command: Sequence[str] | None = None,
        startup_timeout: float = STARTUP_TIMEOUT,
        orphan_grace: float = ORPHAN_GRACE,
        registry: Path = REGISTRY,
    ) -> None:
        self.workdir = Path(workdir)
        self.data_dir = self.workdir / "data"
        self.log_path = self.workdir / "node.log"
        self.frontends = frontends
        self.shards = shards
        self.port = port or free_port()
        self.mqtt_port = mqtt_port  # 0: off (the broker's default 1883 would be shared by every test node)
        self.ws_port = ws_port  # 0: off, as mqtt_port
        self.http_port = free_port()
        self.prometheus_port = free_port()
        self.replication_port = free_port()
        self.extra_args = list(extra_args)
        self.env = env or {}
        self.log_level = log_level
        # Tests of the harness itself swap the broker for a stand-in; node tests never pass this.
        self.command = list(command) if command else DEFAULT_COMMAND
        self.startup_timeout = startup_timeout
        self.orphan_grace = orphan_grace
        self.registry = registry
        self.proc: subprocess.Popen | None = None
        self.pgids: list[int] = []  # every group this Node started; cleanup() sweeps them all
        self.orphans_killed: list[int] = []  # workers that outlived their node past ORPHAN_GRACE
        self.starts = 0

    # ------------------------------------------------------------------ lifecycle
    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}/"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def argv(self) -> list[str]:
        return [
            *self.command,
            "--data-dir", str(self.data_dir),
            "--port", str(self.port),
            "--frontends", str(self.frontends),
            "--shards", str(self.shards),
            "--log-level", self.log_level,
            "--http-port", str(self.http_port),
            "--prometheus-port", str(self.prometheus_port),
            "--mqtt-port", str(self.mqtt_port),
            "--ws-port", str(self.ws_port),
            "--wss-port", "0", "--https-port", "0", "--prometheus-tls-port", "0",  # a test that wants them over TLS passes its own after these
            "--replication-port", str(self.replication_port),
            *self.extra_args,
        ]

    def start(self, wait: bool = True) -> Node:
        if self.running():
            raise NodeError(f"node pid {self.pid} is already running")
        self.workdir.mkdir(parents=True, exist_ok=True)
        # SHARDMQ_COLOCATE passes through, so the suite (or a module) can be run with paired workers
        # or without (docs/architecture.md "Paired processes"), cluster members included.
        passed = ("SHARDMQ_COLOCATE",)
        env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDMQ_") or k in passed}
        # Every shard checks each STATS report against a read of all its queues and logs
        # shard.stats.STATS_CHECK_FAILED when a change went unreported (tests/conftest.py fails the test).
        # Likewise shard/walk_check.py: a channel close and the periodic sync check their indexes
        # against a walk of every queue. And broker/local_link.py: what a pair's link hands over as is
        # must equal its packing and unpacking, and nothing may change it after.
        env.update(PYTHONUNBUFFERED="1", SHARDMQ_TEST_STATS_CHECK="1", SHARDMQ_TEST_WALK_CHECK="1",
                   SHARDMQ_TEST_LINK_CHECK="1", **self.env)
        self.starts += 1
        self._note(f"start #{self.starts}: {' '.join(self.argv())}")
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.argv(), cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        self.pgids.append(self.proc.pid)  # session leader: pgid == pid
        record_group(self.proc.pid, self.workdir, self.registry)
        if wait:
            self.wait_ready()
        return self

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, timeout: float | None = None) -> None:
        """Wait until the port accepts TCP and a full AMQP handshake (connection.open-ok) succeeds."""
        deadline = time.monotonic() + (timeout or self.startup_timeout)
        last_error: Exception | None = None
        while (left := deadline - time.monotonic()) > 0:
            if not self.running():
                code = self.proc.returncode if self.proc else None
                raise NodeError(f"node exited with status {code} during startup\n{self.log_tail()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=min(1.0, left)) as sock:
                    if self.proxied:  # pika cannot send a PROXY header: connection.start must come back
                        sock.sendall(b"PROXY TCP4 127.0.0.1 127.0.0.1 1 2\r\nAMQP\x00\x00\x09\x01")
                        if sock.recv(1)[:1] != b"\x01":
                            raise NodeError("no connection.start")
                if not self.proxied:
                    conn = self.connect(socket_timeout=min(2.0, left), stack_timeout=min(3.0, left))
                    conn.close()
                for port in self.listener_ports():  # MQTT, TLS, WebSocket listeners bind after AMQP's
                    socket.create_connection(("127.0.0.1", port), timeout=min(1.0, left)).close()
                if self.command == DEFAULT_COMMAND and listening_sockets(self.port) < self.frontends:
                    # Each frontend binds its own SO_REUSEPORT socket: one answering does not mean
                    # all do, and tests that need connections on two frontends would see only one.
                    raise NodeError(f"{listening_sockets(self.port)} of {self.frontends} frontends listen")
                return
            except Exception as exc:  # any failure means "not ready yet"; the deadline bounds it
                last_error = exc
                time.sleep(0.1)
        raise NodeError(
            f"node on port {self.port} not ready after {timeout or self.startup_timeout:.0f}s "
            f"(last error: {last_error!r})\n{self.log_tail()}"
        )

    def listener_ports(self) -> list[int]:
        """The node's other client listeners that are on (besides AMQP on self.port)."""
        ports = [p for p in (self.mqtt_port, self.ws_port) if p]
        args = self.extra_args
        for flag in ("--amqps-port", "--mqtts-port", "--wss-port", "--https-port", "--prometheus-tls-port"):
            if flag in args and int(args[args.index(flag) + 1]) and "--tls-cert" in args:
                ports.append(int(args[args.index(flag) + 1]))
        return ports

    @property
    def proxied(self) -> bool:
        """Started with --proxy-protocol 1: clients must send a PROXY header first."""
        args = self.extra_args
        return "--proxy-protocol" in args and args[args.index("--proxy-protocol") + 1] == "1"

    def connect(self, **params) -> pika.BlockingConnection:
        """A pika connection as guest; keyword arguments become pika.ConnectionParameters."""
        params.setdefault("connection_attempts", 1)
        return pika.BlockingConnection(pika.ConnectionParameters(
            host="127.0.0.1", port=self.port, credentials=pika.PlainCredentials("guest", "guest"), **params,
        ))

    def stop(self, timeout: float = STOP_TIMEOUT) -> int | None:
        """SIGTERM the node, wait, SIGKILL if needed; then make sure its workers are gone. Returns its status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self._note(f"SIGTERM node pid {self.proc.pid}")
            self._signal(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._note(f"node pid {self.proc.pid} ignored SIGTERM for {timeout}s: SIGKILL")
                self._signal(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._reap_group(self.pgids[-1])
        return self.proc.returncode

    def kill9(self) -> None:
        """SIGKILL the node process only (its workers are left to notice), and reap it."""
        if not self.running():
            raise NodeError("kill9: node is not running")
        self._note(f"SIGKILL node pid {self.proc.pid}")
        self._signal(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def restart(self, wait: bool = True) -> Node:
        """Stop (gracefully) if running, let the old workers go, start again on the same data dir and port."""
        if self.running():
            self.stop()
        elif self.pgids:
            self._reap_group(self.pgids[-1])
        return self.start(wait=wait)

    def cleanup(self) -> None:
        """Last resort for teardown: stop the node, then SIGKILL whatever is left in every group we started."""
        try:
            if self.running():
                self.stop()
        finally:
            for pgid in self.pgids:
                if group_members(pgid):
                    self._note(f"cleanup: SIGKILL process group {pgid}")
                    try:
                        os.killpg(pgid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    _wait_until(lambda pgid=pgid: not group_members(pgid), ORPHAN_GRACE)
                if not group_members(pgid):
                    forget_group(pgid, self.registry)

    def _reap_group(self, pgid: int) -> None:
        # The node's workers die with it; anything still there after the grace period is killed
        # (as systemd would on restart) and recorded so a test can assert there were none.
        if _wait_until(lambda: not group_members(pgid), self.orphan_grace):
            forget_group(pgid, self.registry)
            return
        leftover = group_members(pgid)
        self.orphans_killed.extend(leftover)
        self._note(f"workers outlived the node by {self.orphan_grace}s, SIGKILL: {leftover}")
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if _wait_until(lambda: not group_members(pgid), ORPHAN_GRACE):
            forget_group(pgid, self.registry)

    # ------------------------------------------------------------------ workers
    def pids(self) -> dict:
        """``<data_dir>/run/pids.json``: {"node": pid, "frontend": {"0": pid}, "shard": {"0": pid}}."""
        path = self.data_dir / "run" / "pids.json"
        last_error: Exception | None = None
        for _ in range(50):  # the node rewrites it on every spawn; retry a torn read briefly
            try:
                return json.loads(path.read_text())
            except (FileNotFoundError, json.JSONDecodeError) as exc:
                last_error = exc
                time.sleep(0.02)
        raise NodeError(f"cannot read {path}: {last_error!r}\n{self.log_tail()}")

    def worker_pid(self, role: str, index: int) -> int:
        try:
            return int(self.pids()[role][str(index)])
        except KeyError:
            raise NodeError(f"no {role} {index} in pids.json: {self.pids()}") from None

    def kill_worker(self, role: str, index: int) -> int:
        """SIGKILL one worker ("frontend" or "shard"); returns the pid that was killed."""
        pid = self.worker_pid(role, index)
        try:
            pgid = os.getpgid(pid)
        except ProcessLookupError:
            raise NodeError(f"{role} {index} pid {pid} from pids.json is not running") from None
        # Never signal a pid we do not own (a stale pids.json after pid reuse).
        if self.pgids and pgid != self.pgids[-1]:
            raise NodeError(f"{role} {index} pid {pid} is not in our node's process group")
        self._note(f"SIGKILL {role} {index} pid {pid}")
        self._signal(pid, signal.SIGKILL)
        return pid

    def wait_worker_restarted(self, role: str, index: int, old_pid: int, timeout: float = STARTUP_TIMEOUT) -> int:
        """Wait until pids.json names a new, live pid for that worker; returns it."""
        new_pid: list[int] = []

        def replaced() -> bool:
            pid = int(self.pids().get(role, {}).get(str(index), old_pid))
            if pid != old_pid and pid_alive(pid):
                new_pid.append(pid)
                return True
            return False

        if not _wait_until(replaced, timeout, interval=0.1):
            raise NodeError(f"{role} {index} (was pid {old_pid}) not restarted after {timeout}s\n{self.log_tail()}")
        return new_pid[0]

    # ------------------------------------------------------------------ logs
    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 80) -> str:
        tail = self.log_text().splitlines()[-lines:]
        return f"--- last {len(tail)} lines of {self.log_path} ---\n" + "\n".join(tail)

    def _note(self, text: str) -> None:
        # Harness actions go into the same log, so a failure's log tail reads as one story.
        with open(self.log_path, "a") as log:
            log.write(f"{time.strftime('%H:%M:%S')} === harness: {text}\n")

    @staticmethod
    def _signal(pid: int, sig: int) -> None:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass

    def __repr__(self) -> str:
        return f"<Node pid={self.pid} port={self.port} data_dir={self.data_dir}>"


class NodeFactory:
    """Makes Nodes for one test (or module) and cleans all of them up."""

    def __init__(self, base_dir: Path, node_args: Sequence[str] = ()) -> None:
        self.base_dir = Path(base_dir)
        self.nodes: list[Node] = []
        self.node_args = list(node_args)  # before each node's own extra_args (conftest: module_node_args)

    def __call__(self, *, start: bool = True, name: str | None = None, **kwargs) -> Node:
        if self.node_args:
            kwargs["extra_args"] = [*self.node_args, *kwargs.get("extra_args", ())]
        node = Node(self.base_dir / (name or f"node{len(self.nodes)}"), **kwargs)
        self.nodes.append(node)
        if start:
            node.start()
        return node

    def cleanup(self) -> None:
        for node in self.nodes:
            node.cleanup()
