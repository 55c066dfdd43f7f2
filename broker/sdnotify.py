"""systemd's service notification protocol (sd_notify(3)), spoken directly on ``$NOTIFY_SOCKET``.

With ``Type=notify`` (deploy/systemd/shardmq.service) systemd counts the node as started only when
it sends ``READY=1``: here that is once ``node.ready`` is true, the same condition the
``/api/health/checks/ready`` route reports (this node serves clients, or follows and proxies them in
a cluster). ``STOPPING=1`` goes out when a stop begins, and ``WATCHDOG=1`` every half of
``$WATCHDOG_USEC`` when the unit sets ``WatchdogSec=``: the pings come from the node's event loop, so
a loop that stalls stops pinging and systemd restarts the node.

The protocol is one datagram of ``KEY=VALUE`` lines on an AF_UNIX socket; it needs no library (the
PyPI ones either wrap libsystemd, a C build, or add nothing over these few lines). Outside systemd
(no ``$NOTIFY_SOCKET``) every call is a no-op.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable

log = logging.getLogger("shardmq.sdnotify")

# How often the READY watcher looks at the readiness condition, and then at the status line.
_READY_POLL_S = 0.1
_STATUS_POLL_S = 1.0


class Notifier:
    """Sends notifications to the service manager named by ``$NOTIFY_SOCKET`` (nothing when unset)."""

    def __init__(self, address: str | None, watchdog_usec: int = 0) -> None:
        self.address = address
        self.watchdog_usec = watchdog_usec
        self._sock: socket.socket | None = None
        self._tasks: list[asyncio.Task] = []
        self.ready_sent = False

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> Notifier:
        """Read ``$NOTIFY_SOCKET`` and the watchdog variables, and remove them from ``environ``.

        They are removed (like sd_notify's ``unset_environment``) so the worker processes the node
        spawns do not inherit them: only the main process speaks to systemd (``NotifyAccess=main``).
        """
        env = os.environ if environ is None else environ
        address = env.pop("NOTIFY_SOCKET", None) or None
        watchdog_pid = env.pop("WATCHDOG_PID", None)
        raw_usec = env.pop("WATCHDOG_USEC", None)
        usec = 0
        # WATCHDOG_PID names the process the watchdog is meant for; a forked child must not ping.
        if raw_usec and (not watchdog_pid or watchdog_pid == str(os.getpid())):
            try:
                usec = max(0, int(raw_usec))
            except ValueError:
                log.warning("ignoring WATCHDOG_USEC=%r: not an integer", raw_usec)
        return cls(address, usec)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, state: str) -> bool:
        """Send one notification (``"READY=1"``, ``"STATUS=..."``); False when it could not be sent."""
        if self.address is None:
            return False
        # "@name" is a socket in the abstract namespace (a leading NUL byte on the wire).
        target = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self._sock.setblocking(False)
            self._sock.sendto(state.encode(), target)
            return True
        except OSError as exc:
            # The manager went away or its queue is full: the node keeps serving either way.
            log.debug("sd_notify %r to %s failed: %s", state, self.address, exc)
            return False

    def start(self, ready: Callable[[], bool], status: Callable[[], str] | None = None) -> None:
        """Send READY=1 once ``ready()`` is true, and run the watchdog pings when they are asked for."""
        if self.address is None:
            return
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._ready_when(ready, status)))
        if self.watchdog_usec:
            self._tasks.append(loop.create_task(self._watchdog(self.watchdog_usec / 2e6)))

    def stopping(self, status: str = "stopping") -> None:
        """Tell systemd a stop has begun (so it does not mistake the shutdown for a crash)."""
        for task in self._tasks[:1]:  # the READY watcher: a stopping node never becomes ready
            task.cancel()
        self.notify(f"STOPPING=1\nSTATUS={status}")

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._tasks.clear()
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    async def _ready_when(self, ready: Callable[[], bool], status: Callable[[], str] | None) -> None:
        while not ready():
            await asyncio.sleep(_READY_POLL_S)
        self.ready_sent = True
        if status is None:
            self.notify("READY=1")
            return
        shown = status()
        self.notify(f"READY=1\nSTATUS={shown}")
        # `systemctl status` shows the latest STATUS: keep it true when the role changes (a
        # follower promoted to leader, a leader that stepped down).
        while True:
            await asyncio.sleep(_STATUS_POLL_S)
            if (now := status()) != shown:
                shown = now
                self.notify(f"STATUS={shown}")

    async def _watchdog(self, interval: float) -> None:
        while True:
            self.notify("WATCHDOG=1")
            await asyncio.sleep(interval)

