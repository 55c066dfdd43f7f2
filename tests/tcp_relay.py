"""A TCP relay for tests that stand between a follower and its leader (tests/test_replication.py,
tests/test_replication_heartbeat.py): subclasses decide what passes."""

from __future__ import annotations

import socket
import threading


class Relay:
    """Accepts on ``port`` and pumps each connection to ``target_port`` both ways, one thread per
    direction. Hooks: ``refuse()`` turns a new connection away, ``forward()`` rewrites (or, with
    None, swallows) a chunk, ``passes_close()`` says whether a pump's end shuts both sockets."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.port = self.lsock.getsockname()[1]
        self.socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def refuse(self) -> bool:
        return False

    def connection_tag(self) -> int:
        """Stamped on a connection's two pumps when it is made (see PathRelay's generations)."""
        return 0

    def forward(self, data: bytes, from_leader: bool, tag: int) -> bytes | None:
        return data

    def passes_close(self, tag: int) -> bool:
        return True

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.lsock.accept()
            except OSError:
                return
            if self.refuse():
                client.close()  # unreachable: the follower retries
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                client.close()
                continue
            self.socks += [client, upstream]
            tag = self.connection_tag()
            threading.Thread(target=self._pump, args=(client, upstream, False, tag), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True, tag), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, from_leader: bool, tag: int) -> None:
        try:
            while data := src.recv(1 << 16):
                out = self.forward(data, from_leader, tag)
                if out is not None:
                    dst.sendall(out)
        except OSError:
            pass
        if self.passes_close(tag):
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.lsock.close()
        for s in self.socks:
            s.close()
