"""Ports handed to test and benchmark servers: outside the ephemeral range, never twice."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

from loadtest import ports
from loadtest.ports import _ephemeral_range, free_port

ROOT = Path(__file__).resolve().parent.parent


def test_free_ports_are_unique_bindable_and_outside_the_ephemeral_range():
    low, high = _ephemeral_range()
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(not low <= p <= high for p in ports)
    with socket.socket() as sock:  # a handed-out port is really free
        sock.bind(("127.0.0.1", ports[-1]))


def test_a_port_in_use_is_skipped():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        first = free_port()
        assert first != taken.getsockname()[1]
        with socket.socket() as listener:  # occupy the next candidate: free_port must step past it
            listener.bind(("127.0.0.1", first + 1))
            listener.listen()
            assert free_port() != first + 1


def _child_holding(candidates: list[int]) -> subprocess.Popen:
    """Another process that took the first 20 ports of ``candidates`` (and binds none of them)."""
    code = ("import sys\nfrom loadtest import ports\n"
            f"ports._CANDIDATES = {candidates!r}\n"
            "print(' '.join(str(ports.free_port()) for _ in range(20)), flush=True)\nsys.stdin.read()\n")
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def test_a_port_another_live_process_took_is_never_handed_out_until_it_exits(monkeypatch):
    """pytest-xdist's workers (scripts/test.sh) and suites side by side share the machine's ports: a
    port one took stays its own while it lives, bound or not (a node restarted on it binds it again)."""
    candidates = ports._port_candidates()[-200:-100]
    child = _child_holding(candidates)
    try:
        theirs = {int(p) for p in child.stdout.readline().split()}
        assert len(theirs) == 20
        monkeypatch.setattr(ports, "_CANDIDATES", list(candidates))
        monkeypatch.setattr(ports, "_NEXT", 0)
        mine = {free_port() for _ in range(20)}
        assert not mine & theirs
    finally:
        child.stdin.close()
        child.wait(10)
    # Gone (its reservations released at exit): the ports are free to take again.
    monkeypatch.setattr(ports, "_NEXT", 0)
    monkeypatch.setattr(ports, "_HANDED_OUT", set())
    assert {free_port() for _ in range(20)} & theirs


def test_the_ports_of_a_killed_process_are_taken_again(monkeypatch):
    candidates = ports._port_candidates()[-300:-200]
    child = _child_holding(candidates)
    theirs = {int(p) for p in child.stdout.readline().split()}
    child.kill()  # no exit handler runs: its reservation files stay, naming a dead process
    child.wait(10)
    assert all((ports.RESERVED_DIR / str(p)).exists() for p in theirs)
    monkeypatch.setattr(ports, "_CANDIDATES", list(candidates))
    monkeypatch.setattr(ports, "_NEXT", 0)
    assert {free_port() for _ in range(20)} == theirs
