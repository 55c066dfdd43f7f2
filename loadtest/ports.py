"""Free loopback ports for test and benchmark servers, chosen outside the ephemeral range."""

from __future__ import annotations

import atexit
import fcntl
import os
import socket
import tempfile
from pathlib import Path

_HANDED_OUT: set[int] = set()
# Ports handed out by every live process of this machine, one file each (its owner's pid and start
# time): test processes running side by side (pytest-xdist's workers, two checkouts' suites) never
# get the same port. Probing with bind() alone is not enough: a test that stops a node and starts it
# again on the same port leaves the port unbound in between, and another process could take it then.
RESERVED_DIR = Path(tempfile.gettempdir()) / "shardmq-ports"


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def _port_candidates() -> list[int]:
    """Ports below (or above) the kernel's ephemeral range, starting at a per-process offset.

    A port the kernel hands out for binding to 0 lies in the ephemeral range, where every outgoing
    connection of the test run also takes its source port: between free_port() and the node's
    bind, a client socket could take the port (the node's bind then fails), or a client
    connecting to a port nobody listens on yet could connect to itself (TCP self-connect on
    loopback) and read its own bytes back. Outside that range neither can happen.
    """
    low, high = _ephemeral_range()
    spans = [(p, q) for p, q in ((10000, low), (high + 1, 65536)) if q - p >= 1000]
    ports = [port for p, q in spans for port in range(p, q)]
    if not ports:  # an unusual range that covers nearly everything: fall back to the kernel's pick
        return []
    start = (os.getpid() * 7919) % len(ports)  # concurrent test processes start apart
    return ports[start:] + ports[:start]


_CANDIDATES: list[int] | None = None
_NEXT = 0


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/pid/stat field 22), None if gone.

    A pid plus its start time names one process: a reused pid has another start time. The test
    harness names its node groups' owners so too (tests/harness.py).
    """
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            stat = fh.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return None if fields[0] == "Z" else int(fields[19])


_ME = ""  # "pid start" of this process, once it reserved a port


def _reserve(port: int) -> bool:
    """Claim ``port`` for this process unless a live process holds it (the caller holds the lock)."""
    global _ME
    path = RESERVED_DIR / str(port)
    try:
        pid, start = path.read_text().split()
        if str(start_time(int(pid))) == start:
            return False  # a live process's (a pid reused since has another start time)
    except (OSError, ValueError):
        pass  # none, or unreadable: free to take
    if not _ME:
        _ME = f"{os.getpid()} {start_time(os.getpid())}"
        atexit.register(_release_all)
    tmp = RESERVED_DIR / f".{port}.{os.getpid()}"
    tmp.write_text(_ME)
    os.replace(tmp, path)
    return True


def _release_all() -> None:
    if not _ME.startswith(f"{os.getpid()} "):
        return  # a forked child's exit: the ports are its parent's
    for port in _HANDED_OUT:
        path = RESERVED_DIR / str(port)
        try:
            if path.read_text() == _ME:
                path.unlink()
        except OSError:
            pass


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False  # somebody else's listener (or a lingering socket)
    return True


def free_port() -> int:
    """A free loopback port outside the ephemeral range, never handed out before in this process
    nor held by another live process that took it here (RESERVED_DIR).

    Remembering the ports handed out rules out two listeners of one run getting the same port.
    """
    global _CANDIDATES, _NEXT
    if _CANDIDATES is None:
        _CANDIDATES = _port_candidates()
    RESERVED_DIR.mkdir(exist_ok=True)
    with open(RESERVED_DIR / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        while _NEXT < len(_CANDIDATES):
            port = _CANDIDATES[_NEXT]
            _NEXT += 1
            if port in _HANDED_OUT or not _bindable(port) or not _reserve(port):
                continue
            _HANDED_OUT.add(port)
            return port
    while True:  # candidates exhausted (or none): the kernel's pick, deduplicated
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def listening_sockets(port: int) -> int:
    """How many TCP sockets listen on ``port`` (any address), from /proc/net/tcp and tcp6: one per
    frontend once a node is up, since they share the port with SO_REUSEPORT."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                count += 1
    return count
