"""One copy of a fenced DEFS per paired process (``--colocate``; contract 27).

A paired process runs frontend K and shard K (shard/pair_main.py), two workers with a control-plane
connection each. The node used to send every DEFS to both; on the bind round trip (one synchronous
bind or unbind after another: docs/benchmarks.md "Bind round trip in a pair") the node packed and
wrote it twice and the pair read, unpacked and applied it twice. Now the DEFS of a fenced change
(bind, unbind, exchange declare/delete: broker/defs_fence.py) go to the pair once, to its frontend
part, marked ``partner`` (contract.DEFS): the frontend part applies them and hands them to the shard
part here, in-process, before it reads on. The node does so only while both parts are connected and
have applied their SNAPSHOT, outside a cluster (where a fenced leader stops a pair's frontend part
alone); otherwise the shard part gets its own copy, as before.

Order. The shard part now gets DEFS from two streams: its own (every other DEFS, SNAPSHOT, QUERY,
...) and the handed ones. The node applies every op once and every DEFS carries the version after
its ops, one per op, so a DEFS's ops start at ``version - len(ops)`` (its base), and every DEFS the
shard part gets starts where the one before it ended. ``HandedDefs`` applies them in that order:

* a handed DEFS whose base is the shard part's version is applied in a callback of its own, right
  after the frontend part's batch (its bind-ok leaves first), or sooner when something needs it;
  one further ahead waits (the shard part has not yet read the DEFS before it on its own stream);
* an own-stream DEFS whose base is ahead of the shard part's version waits for the handed ones
  before it (``before``): those are applied when they are handed, and when they have not been yet
  (the node's writes to the two sockets leave in the order their batches were started, not in
  version order), the frontend part's stream is read now, as the fence's catch-up reads one
  (``UnixDealer.read_until``; the node wrote them in the same loop turn). Given up after
  CATCH_UP_TIMEOUT_S, with a warning, as the fence's catch-up does;
* after an own-stream DEFS, the handed ones it was holding back are applied.

The fence's catch-up of the shard part (shard/worker.py catch_up_defs) first catches the frontend
part up (which hands over what it reads), then reads its own stream: either way it reaches the
word's version. The ops lists are shared by the two parts' definitions, as unpacking the same bytes
twice would give them equal lists: ``Definitions.apply`` keeps what it takes from an op and never
changes it.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import Any

from broker.defs_fence import CATCH_UP_TIMEOUT_S

log = logging.getLogger("shardmq.pair_defs")

_frontend: Any = None  # this process's frontend part (its .node stream), when it is a pair
_shard: HandedDefs | None = None  # this process's shard part's receiver


def register_frontend(worker: Any) -> None:
    """The paired frontend part (frontend/worker.py), whose control stream ``before`` may read."""
    global _frontend
    _frontend = worker


def register_shard(receiver: HandedDefs) -> None:
    global _shard
    _shard = receiver


def catch_up_frontend() -> None:
    """The shard part's fence catch-up: the frontend part's first (it hands over what it reads)."""
    if _frontend is not None and _frontend.defs_version >= 0:  # not before its SNAPSHOT: nothing handed yet
        _frontend.catch_up_defs()


def hand_over(version: int, ops: list) -> None:
    """The frontend part got a DEFS marked ``partner``: the shard part's copy."""
    if _shard is not None:
        _shard.add(version, ops)
    else:  # the node marks them only for a pair whose shard part has applied its snapshot
        log.error("definitions version %d for the paired shard part, which is not here", version)


class HandedDefs:
    """The shard part's side: handed DEFS applied in version order with those of its own stream.

    ``apply(version, ops)`` applies one DEFS (the version first, as for an own DEFS); ``version()``
    is the shard part's definitions version; ``schedule(fn)`` runs fn soon (``loop.call_soon``).

    A handed DEFS is applied in a callback of its own, not inside the frontend part's batch: the
    bind-ok that batch answers leaves first (``FrontendWorker._node_drained``), and the client can
    run while the shard part applies (as when it read its own copy after the frontend part's batch).
    Whatever needs it sooner gets it: the shard part's fence catch-up and its own-stream DEFS apply
    what is pending first (``apply_ready``)."""

    def __init__(self, apply: Callable[[int, list], None], version: Callable[[], int], who: str,
                 schedule: Callable[[Callable[[], None]], Any]) -> None:
        self._apply = apply
        self._version = version
        self._who = who
        self._schedule = schedule
        self._scheduled = False
        self.pending: deque[tuple[int, list]] = deque()

    def add(self, version: int, ops: list) -> None:
        self.pending.append((version, ops))
        if not self._scheduled:
            self._scheduled = True
            self._schedule(self._soon)

    def _soon(self) -> None:
        self._scheduled = False
        self.apply_ready()

    def apply_ready(self) -> None:
        """Apply the handed DEFS that start at (or before) the shard part's version."""
        pending = self.pending
        while pending and pending[0][0] - len(pending[0][1]) <= self._version():
            version, ops = pending.popleft()
            if version > self._version():
                try:
                    self._apply(version, ops)
                except Exception:  # the version is set: one bad op must not stall the fence
                    log.exception("%s: applying handed definitions version %d failed", self._who, version)
            else:  # only after a wait given up on (before): those ops came too late
                log.warning("%s: handed definitions version %d arrived after version %d was applied",
                            self._who, version, self._version())

    def before(self, base: int) -> None:
        """An own-stream DEFS starting at ``base`` is next: apply the handed ones before it first."""
        self.apply_ready()
        if self._version() >= base:
            return
        fe = _frontend
        # Not from inside the frontend part's own batch (nothing calls this there): its later frames
        # would be handled before the rest of that batch.
        if fe is not None and fe.node is not None and not fe._in_control:
            def done() -> bool:
                self.apply_ready()  # what the frontend part handed over while it read
                return self._version() >= base

            fe.node.read_until(done, CATCH_UP_TIMEOUT_S)
        if self._version() < base:
            log.warning("%s: definitions version %d not handed over within %.1f s (at %d); going on",
                        self._who, base, CATCH_UP_TIMEOUT_S, self._version())
