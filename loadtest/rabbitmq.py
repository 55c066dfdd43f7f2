"""A private, throw-away RabbitMQ node for side-by-side benchmarks.

The node lives entirely in a temp dir (mnesia, logs, config, pid file, Erlang cookie via $HOME),
listens on a free loopback port, and gets its own epmd on its own free port, so it never touches a
system RabbitMQ, the system epmd on 4369, or /var/lib/rabbitmq. Everything started here is stopped
by PID in ``stop()``.
"""

from __future__ import annotations

import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from loadtest.ports import free_port

RABBITMQ_SERVER = "/usr/lib/rabbitmq/bin/rabbitmq-server"
RABBITMQ_CONF = """\
loopback_users = none
listeners.tcp.default = 127.0.0.1:{port}
# the benchmark host may have little free disk in /tmp; the default 50MB limit is kept
log.console = false
log.file.level = warning
"""


class RabbitMQError(RuntimeError):
    pass




def _system_rabbit_pids() -> list[int]:
    """beam.smp processes owned by the ``rabbitmq`` system user (a service apt may have started)."""
    try:
        uid = pwd.getpwnam("rabbitmq").pw_uid
    except KeyError:
        return []
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            comm = Path(f"/proc/{entry}/comm").read_text().strip()
            if comm.startswith("beam") and os.stat(f"/proc/{entry}").st_uid == uid:
                pids.append(int(entry))
        except OSError:
            continue
    return pids


def ensure_installed() -> None:
    """Install Debian's rabbitmq-server when missing (root only); never leave the system service running."""
    if os.path.exists(RABBITMQ_SERVER):
        return
    if os.geteuid() != 0:
        raise RabbitMQError("rabbitmq-server is not installed; as root run: apt-get install -y rabbitmq-server")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "install", "-y", "rabbitmq-server"], check=True, env=env)
    # The package's postinst starts the system service; the benchmark wants only its private node.
    if _system_rabbit_pids():
        subprocess.run(["service", "rabbitmq-server", "stop"], check=False)
    for pid in _system_rabbit_pids():
        os.kill(pid, signal.SIGTERM)
    for cmd in (["systemctl", "disable", "rabbitmq-server"], ["update-rc.d", "rabbitmq-server", "disable"]):
        if shutil.which(cmd[0]):
            subprocess.run(cmd, check=False, capture_output=True)
    if not os.path.exists(RABBITMQ_SERVER):
        raise RabbitMQError(f"apt-get install finished but {RABBITMQ_SERVER} is missing")


def package_version() -> str | None:
    out = subprocess.run(["dpkg-query", "-W", "-f", "${Version}", "rabbitmq-server"],
                         capture_output=True, text=True, check=False)
    return out.stdout.strip() or None


class PrivateRabbitMQ:
    """``with PrivateRabbitMQ() as rmq:`` -> a running node at ``rmq.url``; ``rmq.pid`` is the beam pid."""

    def __init__(self, base_dir: str | None = None, start_timeout: float = 90.0) -> None:
        self._own_dir = base_dir is None
        self.dir = Path(base_dir or tempfile.mkdtemp(prefix="bench-rabbitmq-"))
        self.start_timeout = start_timeout
        self.port = free_port()
        self.dist_port = free_port()
        self.epmd_port = free_port()
        self.nodename = f"bench-{secrets.token_hex(4)}@localhost"
        self.pid: int | None = None  # beam.smp
        self.server_version: str | None = None
        self._server: subprocess.Popen[bytes] | None = None
        self._epmd: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}/%2F"

    def _env(self) -> dict[str, str]:
        d = self.dir
        for sub in ("mnesia", "log", "home"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        (d / "rabbitmq.conf").write_text(RABBITMQ_CONF.format(port=self.port))
        (d / "enabled_plugins").write_text("[].\n")
        (d / "rabbitmq-env.conf").write_text("")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RABBITMQ_", "ERL_"))}
        env.update({
            "HOME": str(d / "home"),  # the Erlang cookie is created here, not in root's home
            "RABBITMQ_NODENAME": self.nodename,
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "ERL_EPMD_PORT": str(self.epmd_port),
            "ERL_EPMD_ADDRESS": "127.0.0.1",
            "RABBITMQ_MNESIA_BASE": str(d / "mnesia"),
            "RABBITMQ_LOG_BASE": str(d / "log"),
            "RABBITMQ_CONFIG_FILE": str(d / "rabbitmq.conf"),
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(d / "advanced.config"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(d / "enabled_plugins"),
            "RABBITMQ_CONF_ENV_FILE": str(d / "rabbitmq-env.conf"),
            "RABBITMQ_PID_FILE": str(d / "rabbit.pid"),
            "RABBITMQ_ALLOW_INPUT": "",
        })
        return env

    def start(self) -> PrivateRabbitMQ:
        ensure_installed()
        env = self._env()
        epmd = shutil.which("epmd") or "epmd"
        # Our own epmd in the foreground: we hold its pid, and the system epmd (4369) is left alone.
        self._epmd = subprocess.Popen([epmd, "-port", str(self.epmd_port), "-address", "127.0.0.1"], env=env,
                                      stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL)
        self._wait_port(self.epmd_port, 10.0)
        out = open(self.dir / "log" / "server.out", "wb")
        # Its own process group (stopped as one), not its own session: a session is one autogroup
        # for the kernel's scheduler, see loadtest/bench.py BROKER_SPAWN.
        self._server = subprocess.Popen([RABBITMQ_SERVER], env=env, cwd=self.dir, stdin=subprocess.DEVNULL,
                                        stdout=out, stderr=subprocess.STDOUT, process_group=0)
        out.close()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_port(self, port: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.1)
        raise RabbitMQError(f"nothing listening on 127.0.0.1:{port} after {timeout:.0f}s")

    def _wait_ready(self) -> None:
        import pika

        assert self._server is not None
        deadline = time.monotonic() + self.start_timeout
        params = pika.URLParameters(self.url)
        params.connection_attempts = 1
        params.socket_timeout = 2
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self._server.poll() is not None:
                raise RabbitMQError(f"rabbitmq-server exited with {self._server.returncode}: {self.log_tail()}")
            try:
                conn = pika.BlockingConnection(params)
            except Exception as e:  # not listening yet, or still booting
                last = e
                time.sleep(0.3)
                continue
            version = conn._impl.server_properties.get("version", b"")
            self.server_version = version.decode() if isinstance(version, bytes) else str(version)
            conn.close()
            self.pid = self._beam_pid()
            return
        raise RabbitMQError(f"RabbitMQ not ready after {self.start_timeout:.0f}s ({last}): {self.log_tail()}")

    def _beam_pid(self) -> int:
        """The Erlang VM's pid: from the pid file, else the server process itself (the scripts exec into beam)."""
        assert self._server is not None
        pid_file = self.dir / "rabbit.pid"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                return int(pid_file.read_text().strip())
            except (OSError, ValueError):
                time.sleep(0.1)
        return self._server.pid

    def log_tail(self, n: int = 2000) -> str:
        texts = []
        for p in [self.dir / "log" / "server.out", *sorted((self.dir / "log").glob("*.log"))]:
            try:
                texts.append(p.read_text(errors="replace")[-n:])
            except OSError:
                pass
        return "\n".join(texts)[-n:]

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the VM (RabbitMQ shuts down cleanly on it), SIGKILL after ``timeout``; then our epmd."""
        pids = [p for p in (self.pid, self._server.pid if self._server else None) if p]
        for pid in dict.fromkeys(pids):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        if self._server is not None:
            try:
                self._server.wait(timeout)
            except subprocess.TimeoutExpired:
                for pid in dict.fromkeys(pids):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                self._server.wait(10)
        if self.pid and self.pid != (self._server.pid if self._server else None):
            _wait_gone(self.pid, timeout)
        if self._server is not None:
            # the VM's helpers (erl_child_setup, inet_gethost) share the server's process group: none may
            # outlive it into the next benchmark run (the group id is the server's pid)
            try:
                os.killpg(self._server.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self._epmd is not None:
            self._epmd.terminate()
            try:
                self._epmd.wait(5)
            except subprocess.TimeoutExpired:
                self._epmd.kill()
                self._epmd.wait(5)
        self._server = self._epmd = None
        self.pid = None
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> PrivateRabbitMQ:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _wait_gone(pid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
