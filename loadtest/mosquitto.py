"""A private, throw-away mosquitto (Debian's ``mosquitto``) for side-by-side MQTT benchmarks.

Its config, and nothing else, lives in a temp dir; it listens on a free loopback port with
persistence off and the given in-flight limit (so both brokers are measured with the same one),
and is stopped by PID in ``stop()``. It never touches a system mosquitto or port 1883.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from loadtest.ports import free_port

MOSQUITTO = "mosquitto"


class MosquittoError(RuntimeError):
    pass


def package_version() -> str | None:
    try:
        out = subprocess.run(["dpkg-query", "-W", "-f=${Version}", "mosquitto"], capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


class PrivateMosquitto:
    def __init__(self, max_inflight: int = 100, start_timeout: float = 10.0) -> None:
        self.max_inflight = max_inflight
        self.start_timeout = start_timeout
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="shardmq-mosquitto-"))
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"mqtt://guest:guest@127.0.0.1:{self.port}"

    def start(self) -> PrivateMosquitto:
        binary = shutil.which(MOSQUITTO) or "/usr/sbin/mosquitto"
        conf = self.dir / "mosquitto.conf"
        conf.write_text(f"listener {self.port} 127.0.0.1\nallow_anonymous true\npersistence false\n"
                        f"max_inflight_messages {self.max_inflight}\nmax_queued_messages 1000000\n"
                        "log_type error\n")
        self.proc = subprocess.Popen([binary, "-c", str(conf)], stdout=subprocess.DEVNULL,
                                     stderr=open(self.dir / "mosquitto.log", "wb"))
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise MosquittoError(f"mosquitto exited: {(self.dir / 'mosquitto.log').read_text()}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise MosquittoError(f"mosquitto not listening on {self.port} after {self.start_timeout}s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> PrivateMosquitto:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
