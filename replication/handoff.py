"""Passing an authenticated follower connection from the node to the shard that owns the stream.

The node accepts every replication connection on the one replication port, runs the handshake,
and sends the socket itself (``SCM_RIGHTS``, ``socket.send_fds``) over a unix datagram socket
(``contract.repl_handoff_path``) to the shard, which then serves that follower directly: message
bodies never pass through the node. The datagram's payload is described in broker/contract.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable

from broker import contract

log = logging.getLogger("shardmq.replication")


def send_socket(run_dir: str, index: int, sock: socket.socket, follower: str, heartbeat: float = 0.0) -> None:
    """Hand ``sock`` to shard ``index``. OSError (ECONNREFUSED, ENOENT) while that shard has not
    bound its handoff socket: a (re)starting shard binds it once it has loaded its queues.
    ``heartbeat``: the interval the follower announced in its HELLO (0: it has no heartbeats)."""
    out = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
    try:
        out.setblocking(True)
        out.connect(contract.repl_handoff_path(run_dir, index))
        socket.send_fds(out, [contract.pack_handoff(follower, heartbeat)], [sock.fileno()])
    finally:
        out.close()


class HandoffReceiver:
    """Bound by a shard: calls ``on_socket(sock, follower, heartbeat)`` for every connection the node
    hands over."""

    def __init__(self, loop: asyncio.AbstractEventLoop, run_dir: str, index: int,
                 on_socket: Callable[[socket.socket, str, float], None]) -> None:
        self.loop = loop
        self.path = contract.repl_handoff_path(run_dir, index)
        self.on_socket = on_socket
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self.sock.bind(self.path)
        self.sock.setblocking(False)
        loop.add_reader(self.sock.fileno(), self._readable)

    def _readable(self) -> None:
        while True:
            try:
                msg, fds, _flags, _addr = socket.recv_fds(self.sock, 4096, 4)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.warning("replication: handoff socket: %s", exc)
                return
            socks = [socket.socket(fileno=fd) for fd in fds]
            try:
                follower, heartbeat = contract.unpack_handoff(msg)
            except ValueError:
                for s in socks:
                    s.close()
                continue
            for s in socks:
                self.on_socket(s, follower, heartbeat)

    def close(self) -> None:
        self.loop.remove_reader(self.sock.fileno())
        self.sock.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass
