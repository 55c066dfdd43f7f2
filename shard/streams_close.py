"""A cluster leader's stopping shards close their replication streams together, once each has its final state acked.

A follower runs one session of streams with the leader (the node's and one per shard); one of an
older version ends the whole session when any of them closes (a follower of this version reconnects
a shard stream alone); it then reconnects, and a stream of a shard still stopping is detached
meanwhile. Every shard of a node stops at once, but not in step: a shard that finished its
final sync first and closed its stream cut the followers off from the others, which then waited in
vain for the acks of their final syncs (the confirms that waited on them, and the removals of delay
and outbox records whose forwards were confirmed: without them the node taking over routes those
messages again). So, on a cluster leader, a stopping shard that has its final sync acked (or gave
up on it) tells every other shard ``[PEER_DONE, 2]`` (contract VERSION 21) and keeps its stream open
until each other shard said the same or its deadline passed; then all close within a loop turn of
each other.
"""

from __future__ import annotations

import asyncio
import contextlib

# PEER_DONE's phase field: 2 = "my final state reached the followers" (a plain PEER_DONE is phase 1).
SYNCED = 2


class StreamsClose:
    def __init__(self) -> None:
        self.said: set[int] = set()  # peers that sent [PEER_DONE, 2] (they may come before we wait)
        self._expected: set[int] = set()
        self._all: asyncio.Event | None = None

    def peer_synced(self, index: int) -> None:
        self.said.add(index)
        if self._all is not None and self._expected <= self.said:
            self._all.set()

    async def wait(self, peers: set[int], timeout: float) -> set[int]:
        """Until every shard in `peers` said it is synced (at most `timeout`); those that did not."""
        self._expected = set(peers)
        if not self._expected <= self.said:
            self._all = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, timeout)):
                    await self._all.wait()
            self._all = None
        return self._expected - self.said
