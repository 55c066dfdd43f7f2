"""A leader shard's replication stream: the files of its queues and delay stores, straight from
this process to every follower (replication/sender.py), plus what the node must know of it.

Connections arrive from the node already authenticated (replication/handoff.py). The node is
told of every follower change at once and of lags every second (contract REPL_STATUS); it sends
the ISR back (REPL_ISR), which ``when_replicated`` waits for before the shard confirms.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

from replication.handoff import HandoffReceiver
from replication.sender import StreamSender
from shard.segment import open_write_segments

_REPORT_S = 1.0


def _logical_size(path: str) -> int | None:
    seg = open_write_segments.get(path)
    return None if seg is None else seg.used


class ShardReplication:
    def __init__(self, loop: asyncio.AbstractEventLoop, index: int, data_dir: str, run_dir: str,
                 ack_timeout: float, owned_paths: Callable[[], list[str]],
                 report: Callable[[dict], None], *, heartbeat: float = 0.0,
                 heartbeat_timeout: float = 0.0) -> None:
        self.loop = loop
        self.data_dir = os.path.abspath(data_dir)
        self._owned_paths = owned_paths
        self._report = report
        self.sender = StreamSender(loop, self.data_dir, f"shard-{index}", self._owned_dirs,
                                   ack_timeout=ack_timeout, heartbeat=heartbeat,
                                   heartbeat_timeout=heartbeat_timeout, on_change=self.report,
                                   logical_size=_logical_size)
        self.handoff = HandoffReceiver(loop, run_dir, index, self.sender.attach_socket)
        self._timer = loop.call_later(_REPORT_S, self._periodic)
        # No follower yet: said at once, so the node never goes on counting on what a killed
        # predecessor last reported (its followers' streams died with it).
        self.report()

    def _owned_dirs(self) -> list[str]:
        return [os.path.relpath(path, self.data_dir).replace(os.sep, "/") for path in self._owned_paths()]

    def report(self) -> None:
        self._report(self.sender.status())

    def _periodic(self) -> None:
        if self.sender.links:
            self.report()
        self._timer = self.loop.call_later(_REPORT_S, self._periodic)

    @property
    def gating(self) -> bool:
        return self.sender.gating

    def position(self) -> int:
        return self.sender.position()

    def isr_attached(self) -> bool:
        return self.sender.isr_attached()

    def when_replicated(self, target: int, callback: Callable[[bool], None]) -> None:
        self.sender.when_replicated(target, callback)

    def set_isr(self, names: set[str], min_isr: int) -> None:
        self.sender.set_isr(names, min_isr)

    def close(self) -> None:
        self._timer.cancel()
        self.handoff.close()
        self.sender.close()
