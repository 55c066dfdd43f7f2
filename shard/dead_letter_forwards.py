"""Dead letters sent to queues on other shards, kept until those shards confirm them.

A dead letter for a queue on another shard travels as a PUBLISH over the peer DEALER with
confirm fields (conn_id 0, channel contract.PEER_CHANNEL_DLX, seq); the target answers CONFIRM
once it is stored (synced when persistent into a durable queue). Until then the item is kept
here, and sent again when a restarted target is ready if it went to the previous incarnation
(whose batches the new one drops by epoch): a target shard restarting at that moment no longer
loses it. At least once: a copy the old incarnation stored but had not confirmed comes twice. The source
queue has already let the message go, so a crash of this shard still loses what is unconfirmed.
"""

from __future__ import annotations

import itertools
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shard.worker import ShardWorker

log = logging.getLogger("shardmq.shard")

# A target that stays down must not make the source shard grow without bound.
MAX_PENDING = 100_000


class DeadLetterForwards:
    def __init__(self, worker: ShardWorker) -> None:
        self.worker = worker
        self._seq = itertools.count(1)
        # seq -> {target shard: [epoch it was sent to, PUBLISH item]}
        self.pending: dict[int, dict[int, list]] = {}

    def next_seq(self) -> int:
        return next(self._seq)

    def sent(self, seq: int, items: dict[int, list]) -> None:
        if not items:
            return
        if len(self.pending) >= MAX_PENDING:
            oldest = next(iter(self.pending))
            del self.pending[oldest]
            log.warning("shard %d: %d dead letters unconfirmed by other shards; the oldest is no longer "
                        "kept for a resend", self.worker.index, MAX_PENDING)
        epochs = self.worker.epochs
        self.pending[seq] = {shard: [epochs.get(shard, 0), item] for shard, item in items.items()}

    def confirmed(self, shard: int, seqs: list[int]) -> None:
        """CONFIRM (or CONFIRM_NACK: the target could not take it, nothing to resend) from `shard`."""
        pending = self.pending
        for seq in seqs:
            items = pending.get(seq)
            if items is not None:
                items.pop(shard, None)
                if not items:
                    del pending[seq]

    def peer_up(self, index: int, restarted: bool) -> None:
        """SHARD_UP: a new epoch means the peer died; the known epoch again means it is ready now,
        and gets what it has not confirmed."""
        if restarted or not self.pending:
            return
        worker = self.worker
        epoch = worker.epochs.get(index, 0)
        for items in self.pending.values():
            sent = items.get(index)
            # Only what went to an earlier incarnation: what was sent to this one (held until its
            # snapshot) is handled and confirmed by it, and a resend would double it.
            if sent is not None and sent[0] < epoch:
                sent[0] = epoch
                worker.forward(index, sent[1])
