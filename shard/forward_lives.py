"""A shard's forwards to other shards carry the sender's life (its epoch); answers for an earlier life are dropped.

A shard forwards messages to queues of other shards and keeps its own copy until the target
confirms: a due delayed message (shard/delayed.py, seq from a counter), a dead letter
(shard/dead_letter_forwards.py, seq = its outbox record id), a deduplicating exchange's publish
(shard/dedup.py, seq = a token from a counter). The target answers CONFIRM / CONFIRM_NACK to the
sender's identity ``sh-N``, which a restarted shard N takes over (a later connection with the same
identity replaces the old one, broker/unixio.py). The counters start again with each life, and an
emptied outbox may number its records from 1 again: a target that stored a forward of the dead
shard and answers after N restarted would settle a *different* forward of the new life, with the
wrong answer (a stored forward's CONFIRM for one the target refuses, so the publisher of a
deduplicating exchange is acked for a message no queue holds; or the delay record removed before
the target has synced the copy).

The fix tags rather than renumbers: every forward carries the sender's epoch as its ``conn_id``
(the node gives each life of a shard a new, higher epoch; a node restart restarts every shard, so
no answer crosses it), the target echoes ``conn_id`` in every answer as it does for a frontend, and
the sender drops an answer whose ``conn_id`` is not its own epoch (ShardWorker.on_peer_answers).
Why not seed the counters from the epoch instead: the outbox's seq is its record id (which must stay
the id after a restart, to find the record), so one rule for all three parts is the tag, checked in
one place. A dropped answer costs nothing: what the earlier life forwarded is either still kept
(delay record, outbox record: sent again after the restart, at least once) or was lost with that
life's memory (a dedup publish: its publisher was nacked when the shard died).

The batch seqs of the peer DEALERs, answered with PROCESSED and used only for a dedup owner's
forward back-pressure (ShardWorker.forwards_behind), count from ``epoch << 32`` instead: an earlier
life's PROCESSED is below them and ignored (``_connect_peers``), where it made the new life count
batches as answered that it had not sent.
"""

from __future__ import annotations

from broker import contract

# Where a forwarded item keeps its conn_id and confirm seq (contract.PUBLISH / DEDUP_PUBLISH fields).
CONN_FIELD = {contract.PUBLISH: 8, contract.DEDUP_PUBLISH: 7}
SEQ_FIELD = {contract.PUBLISH: 10, contract.DEDUP_PUBLISH: 9}


def stamped(item: list, seq: int, epoch: int) -> list:
    """A copy of the forward `item` with confirm `seq`, sent by the life `epoch` of its shard."""
    item = list(item)
    kind = item[0]
    item[CONN_FIELD[kind]] = epoch
    item[SEQ_FIELD[kind]] = seq
    return item


def for_this_life(answer: list, epoch: int) -> bool:
    """Whether a peer's CONFIRM / CONFIRM_NACK answers a forward of the life `epoch` (its conn_id)."""
    return answer[1] == epoch
