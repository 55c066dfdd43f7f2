"""At a clean stop, a shard waits for its peers' confirms of what it forwarded to them.

A shard forwards messages to queues of other shards (and, for a deduplicating exchange it owns, to
its own ROUTER) and keeps its own copy until the target confirms: a dead letter in its outbox
(shard/dead_letter_forwards.py), a due delayed message in its delay store (shard/delayed.py); a
deduplicating exchange's owner answers the dead letter's source (or the publisher) only once its
targets confirmed (shard/dedup.py). A target confirms a persistent message after its next group
sync, and every shard of a node stops at once: a shard that closed before the confirms came would
keep the copy and send (or route) it again after the restart, twice in the target queue.

``ForwardSettle.settle`` keeps the stopping shard's loop serving its peers' answers, with group
syncs and confirms going on, until no forward is in flight or ``STOP_WAIT_S`` passed. Then the shard
tells every peer that nothing more comes from it (``PEER_DONE``, contract.py) and keeps serving until
each peer said the same (``PeersDone``, waited for by the same ``settle``): a peer that got its STOP
later may still route due messages or send dead letters to it, and those must meet a shard that
stores and confirms them, not a closed socket (the sender would keep its copy, and the other
queues that copy went to would get it twice after the restart). A stopping target confirms what its
final sync covered (ShardWorker.stop). Standalone only: in a cluster a
confirm promises the in-sync followers have the record, and the final sync is local, so a target
does not confirm there; its sender keeps the copy (at least once). What is still in flight after
the wait stays where it is kept and goes again after the restart (duplicates possible, loss not),
as after a kill -9.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

log = logging.getLogger("shardmq.shard")

# At a clean stop, how long a shard waits for its peers' confirms (they confirm after their next
# group sync; the node gives a stopping shard 15 s in all).
STOP_WAIT_S = 5.0
# How much longer than that a stopping shard waits for its peers' PEER_DONE: a peer got its STOP a
# little later, or spent all of STOP_WAIT_S on its own forwards.
PEERS_DONE_SLACK_S = 1.0


class Forwarder(Protocol):
    """A part of the shard that forwards to peers and keeps a copy until they confirm."""

    def in_flight(self) -> int:
        """Forwards sent to the running incarnation of a shard and not answered by it yet."""
        ...


class PeersDone:
    """The other shards that said PEER_DONE. Once we said ours (``expect``), each that has not yet
    counts as in flight: what it may still send must find us serving."""

    def __init__(self) -> None:
        self.expected: set[int] = set()
        self.done: set[int] = set()

    def expect(self, peers: set[int]) -> None:
        self.expected = peers

    def in_flight(self) -> int:
        return len(self.expected - self.done)


class ForwardSettle:
    """The forwarding parts of one shard (name for the log -> part), waited for together."""

    def __init__(self, index: int, parts: dict[str, Forwarder]) -> None:
        self.index = index
        self.parts = parts
        self._settled: asyncio.Event | None = None  # set while settle() waits

    def in_flight(self) -> dict[str, int]:
        return {name: n for name, part in self.parts.items() if (n := part.in_flight())}

    def answered(self) -> None:
        """A peer answered (or restarted): called by the shard after such a batch. Free unless stopping."""
        if self._settled is not None and not self.in_flight():
            self._settled.set()

    async def settle(self, timeout: float = STOP_WAIT_S) -> dict[str, int]:
        """Wait until no forward is in flight (at most `timeout`); what is still in flight, by part."""
        waiting = self.in_flight()
        if not waiting:
            return waiting
        log.info("shard %d stops once its peers answer: %s (at most %.1f s)", self.index, _say(waiting), timeout)
        self._settled = asyncio.Event()
        try:
            async with asyncio.timeout(timeout):  # not wait_for: it can swallow a cancellation on 3.11
                await self._settled.wait()
        except TimeoutError:
            pass
        finally:
            self._settled = None
        left = self.in_flight()
        if left:
            log.warning("shard %d: stopping with %s not confirmed by other shards (a forward kept is sent "
                        "again after the restart)",
                        self.index, _say(left))
        return left


def _say(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {name}" for name, n in counts.items())
