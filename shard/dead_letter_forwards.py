"""Dead letters sent to other shards, kept on disk until those shards confirm them.

A dead letter for a queue on another shard (or for a deduplicating exchange, whose owner shard
decides where it goes; or for a queue of this shard that refused it, full with reject-publish,
which gets it again through this shard's own ROUTER after RETRY_S, as another shard's would)
travels over the peer DEALER as a PUBLISH (or DEDUP_PUBLISH) item with confirm fields: conn_id
this shard's epoch (shard/forward_lives.py), channel contract.PEER_CHANNEL_DLX and a seq. The
target answers CONFIRM once it is stored (synced when persistent into a durable queue; a dedup
owner once every shard it forwarded to has).

Before it is sent, the dead letter is appended to this shard's *outbox*, a QueueStore under
``<data>/dead-letters/shard-N/`` whose record body is the packed list of [target shard, item]; the
record's msg id is the items' confirm seq (it names the record after a restart too; a CONFIRM meant
for an earlier incarnation of this shard is dropped all the same, as its conn_id is that life's
epoch: an emptied outbox numbers its records from 1 again, shard/forward_lives.py). The source queue's removal of the
message is written after the outbox record (same loop turn, later; the group sync fsyncs the outbox
first), so when this shard is killed the dead letter is in the outbox: a restarted shard reads every
record still there and sends it again once its targets are ready. A record is removed when every
target confirmed it. This is RabbitMQ quorum queues' at-least-once dead-lettering: duplicates are
possible (a target that stored a copy but whose CONFIRM never arrived), loss is not. Transient dead
letters are not kept across a restart, as transient messages are not.

While this shard runs, an item is also kept in memory and sent again when its target restarts
(a new epoch: batches to the old one are dropped) and is ready.

A clean stop sends no dead letter twice: every shard of the node stops at once, so a target may
have stored a dead letter whose CONFIRM (sent after its next group sync) has not reached us yet.
The stopping shard waits for it with its other forwards (shard/forward_settle.py, ``in_flight``
here), and a stopping shard confirms what its final sync covered (ShardWorker.stop); only then is
the outbox closed. A record still there after a clean stop was not stored by its target (or the
target did not stop in time). After a kill -9 of either side, a copy stored but not confirmed is
sent again: at least once, duplicates possible.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Protocol

from broker import contract
from broker.datadir import DEAD_LETTERS_DIR
from shard.forward_lives import stamped
from shard.store import QueueStore

log = logging.getLogger("shardmq.shard")

# Items kept in memory for a resend while this shard runs: a target that stays down must not make
# the source shard grow without bound. Beyond it the oldest stays in the outbox only (sent again
# after this shard's next restart).
MAX_PENDING = 100_000
# A dead letter a target refused (CONFIRM_NACK) is sent again after this long.
RETRY_S = 1.0


class ForwardsShard(Protocol):
    """What the outbox uses of the shard that holds it (shard/worker.py ShardWorker)."""

    index: int
    epoch: int
    epochs: dict[int, int]
    settings: dict
    loop: asyncio.AbstractEventLoop
    stopping: bool

    def send_to_peer(self, shard: int, item: list) -> bool: ...

    def sync_first(self, store: QueueStore) -> None: ...


class DeadLetterForwards:
    def __init__(self, worker: ForwardsShard) -> None:
        self.worker = worker
        self.store: QueueStore | None = None  # the outbox, opened by load()
        # outbox msg id (= confirm seq) -> {target shard: [epoch it was sent to, item]}
        self.pending: dict[int, dict[int, list]] = {}
        self._retry_armed = False
        self._unsynced = 0  # dead letters settled by a NACK naming no queue, since the last warning
        self._unsynced_logged = 0.0

    def path(self) -> str:
        w = self.worker
        return os.path.join(w.settings["data_dir"], DEAD_LETTERS_DIR, f"shard-{w.index}")

    def load(self) -> None:
        """Open the outbox; what it still holds is sent again as each target reports ready (peer_up)."""
        if self.store is not None:
            return
        store = self.store = QueueStore(self.path(), segment_size=int(self.worker.settings.get("segment_size",
                                                                                            8 << 20)))
        n = 0
        while (msg := store.shift()) is not None:
            msg_id, body = msg[0], msg[7]
            try:
                _version, targets = contract.unpack(body)
                # Stamped with this life's epoch: answers meant for the earlier life are dropped.
                items = {int(shard): [-1, stamped(item, msg_id, self.worker.epoch)] for shard, item in targets}
            except (ValueError, TypeError, KeyError, IndexError):
                log.warning("shard %d: unreadable dead letter %#x in the outbox dropped", self.worker.index, msg_id)
                store.ack(msg_id)
                continue
            self.pending[msg_id] = items  # epoch -1: sent on the target's next SHARD_UP as ready
            n += 1
        store.flush_acks()
        own = self.worker.index
        for items in self.pending.values():  # a deduplicating exchange we own: our own ROUTER is ready
            sent = items.get(own)
            if sent is not None:
                sent[0] = self.worker.epoch if self.worker.send_to_peer(own, sent[1]) else -1
        if n:
            log.info("shard %d: %d dead letters unconfirmed before the restart are sent again", self.worker.index, n)

    def send(self, items: dict[int, list], persistent: bool, later: int | None = None) -> None:
        """Keep `items` (target shard -> PUBLISH/DEDUP_PUBLISH with seq None) in the outbox, then send
        them; the one for shard `later` (this shard's own queues that just refused it) only after
        RETRY_S, as a refused one is sent again."""
        if not items:
            return
        w = self.worker
        msg_id = self._keep(items, persistent)
        if msg_id is None:  # not kept (a full disk): sent all the same, unconfirmed, as before the outbox
            for shard, item in items.items():
                if shard != later:  # (refused here a moment ago: dropped, as before the retry)
                    w.send_to_peer(shard, item)
            return
        if len(self.pending) >= MAX_PENDING:
            del self.pending[next(iter(self.pending))]
            log.warning("shard %d: %d dead letters unconfirmed by other shards; the oldest is resent only "
                        "after a restart", w.index, MAX_PENDING)
        epochs = w.epochs
        kept = self.pending[msg_id] = {}
        for shard, item in items.items():
            item = stamped(item, msg_id, w.epoch)
            if shard == later:
                kept[shard] = [-1, item]  # sent by _retry
                if not self._retry_armed:
                    self._retry_armed = True
                    w.loop.call_later(RETRY_S, self._retry)
                continue
            # Not sent (a clean stop told the peers we are done): epoch -1, sent after the restart.
            kept[shard] = [(w.epoch if shard == w.index else epochs.get(shard, 0))
                           if w.send_to_peer(shard, item) else -1, item]

    def _keep(self, items: dict[int, list], persistent: bool) -> int | None:
        """Append the outbox record; its msg id, or None when it could not be written."""
        store = self.store
        if store is None:
            return None
        body = contract.pack(contract.VERSION, [[shard, item] for shard, item in items.items()])
        try:
            msg_id = store.append(0, 1 if persistent else 0, "", "", b"", body)
        except OSError as exc:
            log.warning("shard %d: dead letter not kept in the outbox (%s)", self.worker.index, exc)
            return None
        store.shift()  # the cursor passes it at once: records are removed in confirm order
        if persistent:
            self.worker.sync_first(store)
        return msg_id

    def confirmed(self, shard: int, seqs: list[int], ok: bool = True, refused: list[str] | None = None) -> None:
        """CONFIRM from `shard`, or CONFIRM_NACK. A NACK of a PUBLISH that names the queues that refused
        it (``refused``, contract VERSION 26: full with x-overflow reject-publish, a full disk) is
        retried to those only, after RETRY_S, as RabbitMQ's at-least-once dead-letter worker retries
        what a target rejected: the others stored it (a retry of all of them put a copy in each, once
        a second). A NACK naming no queue says the target holds the copy: ``refused`` empty, it was
        stored or dead-lettered by a reject-publish-dlx queue (a retry dead-lettered it again, once a
        second); no ``refused`` at all, it was stored but not made durable as asked (the target's
        group sync failed, or fewer in-sync followers than --min-isr acked it), and a resend would
        only add a copy per second while the ISR stays short. Both count as confirmed (the second
        logged), as a due delayed message's NACK does (shard/delayed.py). A DEDUP_PUBLISH's NACK says
        the same of the queues its owner forwarded it to (shard/dedup.py ExchangeDedup._settle: the
        queues of a target that restarted or was never reached are named too, as maybe not stored), and
        a retry goes to the owner with the named queues only (contract VERSION 29; a bare NACK used to
        be retried whole, a copy more in every target queue each second of an ISR outage)."""
        pending = self.pending
        store = self.store
        if not ok:
            settle: list[int] = []
            unsynced = 0
            again = False
            for seq in seqs:
                sent = pending.get(seq, {}).get(shard)
                if sent is None:
                    if refused is not None and not refused:
                        settle.append(seq)  # dropped from memory (MAX_PENDING): its record goes
                    continue
                if refused:
                    item = sent[1] = list(sent[1])
                    if item[0] == contract.PUBLISH:
                        item[2] = [name for name in item[2] if name in refused]
                    else:  # DEDUP_PUBLISH: its groups [[shard, [queue, ...]], ...]
                        item[12] = [[s, kept] for s, names in item[12]
                                    if (kept := [name for name in names if name in refused])]
                else:
                    settle.append(seq)
                    unsynced += refused is None
                    continue
                sent[0] = -1  # not held by the target: sent again by _retry
                again = True
            if unsynced:
                self._log_unsynced(shard, unsynced)
            if again and not self._retry_armed:
                self._retry_armed = True
                self.worker.loop.call_later(RETRY_S, self._retry)
            seqs = settle
        for seq in seqs:
            items = pending.get(seq)
            if items is not None:
                items.pop(shard, None)
                if not items:
                    del pending[seq]
                    if store is not None:
                        store.ack(seq)
            elif store is not None and store.holds(seq):
                store.ack(seq)  # dropped from memory (MAX_PENDING) and confirmed after all
        if store is not None and seqs:
            store.flush_acks()

    def _log_unsynced(self, shard: int, n: int) -> None:
        """At most once a second (an ISR outage NACKs every dead letter), with the count since."""
        self._unsynced += n
        now = time.monotonic()
        if now - self._unsynced_logged >= 1.0:
            self._unsynced_logged = now
            log.warning("shard %d: %d dead letter(s) stored on shard %d but not made durable there (its sync "
                        "failed, or fewer in-sync followers than --min-isr); settled, not sent again",
                        self.worker.index, self._unsynced, shard)
            self._unsynced = 0

    def in_flight(self) -> int:
        """Dead letters sent to the running incarnation of a shard (or to ourselves) and not confirmed
        or refused by it yet (what went to an earlier one, now dead, will not be answered)."""
        w = self.worker
        epochs = w.epochs
        own, own_epoch = w.index, w.epoch
        return sum(sent[0] != -1 and sent[0] == (own_epoch if shard == own else epochs.get(shard, 0))
                   for items in self.pending.values() for shard, sent in items.items())

    def _retry(self) -> None:
        self._retry_armed = False
        w = self.worker
        if w.stopping:
            return
        for items in self.pending.values():
            for shard, sent in items.items():
                if sent[0] == -1 and (shard == w.index or shard in w.epochs) and w.send_to_peer(shard, sent[1]):
                    sent[0] = w.epoch if shard == w.index else w.epochs[shard]

    def peer_up(self, index: int, restarted: bool) -> None:
        """SHARD_UP: a new epoch means the peer died; the known epoch again means it is ready now,
        and gets what it has not confirmed."""
        if restarted or not self.pending:
            return
        worker = self.worker
        epoch = worker.epochs.get(index, 0)
        for items in self.pending.values():
            sent = items.get(index)
            # Only what went to an earlier incarnation (or nowhere yet: recovered from the outbox):
            # what was sent to this one (held until its snapshot) is handled and confirmed by it,
            # and a resend would double it.
            if sent is not None and sent[0] < epoch and worker.send_to_peer(index, sent[1]):
                sent[0] = epoch

    def all_stores(self) -> list[QueueStore]:
        return [] if self.store is None else [self.store]

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None


