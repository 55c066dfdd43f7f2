"""Ports handed to test and benchmark servers: outside the ephemeral range, never twice."""

from __future__ import annotations

import socket

from loadtest.ports import _ephemeral_range, free_port


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
