"""One queue inside a shard: its store, its consumers, its unacked messages.

Memory per queue is independent of its length: the store keeps a read cursor
over segment files, and the only per-message state here is the unacked map,
which prefetch and credit bound, as they bound the transient messages held unstored for
manual-ack consumers (``held``, see ``deliver_unstored``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from broker import contract
from shard import consumer_order
from shard.consumers import ChannelRef, Consumer
from shard.store import QueueStore

Send = Callable[[bytes, list], None]

_DELIVER = contract.DELIVER
_CREDIT_SHIFT = contract.CREDIT_BYTES_SHIFT
# The unacked map of a queue that never delivered with manual ack (or basic.get): shared, never
# written (insertions replace it first: see unacked_map), so an idle queue holds no dict of its own.
NO_UNACKED: dict = {}
# Ids of messages delivered to a manual-ack consumer without being stored (deliver_unstored) start
# here: far above any store id (segment number << 32 | position), so one compare tells them apart.
VIRTUAL = 1 << 62
# The held / aliases maps of a queue that has none: shared, never written (as NO_UNACKED).
NO_HELD: dict = {}
# Bytes of held bodies (plus HELD_OVERHEAD each) this shard process keeps in memory at most. Prefetch
# bounds them per consumer, but a consumer without prefetch that never acks gets its credit back as
# its frontend writes, so without this budget held bodies would grow in the heap where the stored
# path keeps them in segment files (memory flat however many messages are unacked). Beyond it, a
# message is stored as before.
HELD_BUDGET = 16 << 20
HELD_OVERHEAD = 256
held_total = [0]  # this shard's held bytes (one shard per process)


class Queue:
    __slots__ = (
        "qid", "vhost", "name", "durable", "auto_delete", "arguments", "store", "consumers", "unacked",
        "_rr", "had_consumers", "held", "aliases", "_next_vid", "exclusive_consumer", "deleted", "groups", "sac",
        "n_published", "n_delivered", "n_acked", "n_deliver_no_ack", "n_get", "n_get_no_ack",
    )

    def __init__(self, qid: int, vhost: str, name: str, defn: Any, store: QueueStore) -> None:
        self.qid = qid
        # Totals since this shard started, for the management API's message_stats (shard/stats.py).
        self.n_published = self.n_delivered = self.n_acked = 0
        # Parts of n_delivered (the rest is deliver with manual ack), counted per delivery turn.
        self.n_deliver_no_ack = self.n_get = self.n_get_no_ack = 0
        self.vhost = vhost
        self.name = name
        self.durable = bool(defn.durable)
        self.auto_delete = bool(defn.auto_delete)
        # The definitions' own copy (broker/definitions: a dict per declare, never changed in place).
        self.arguments = defn.arguments if defn.arguments is not None else {}
        self.store = store
        # A list from the first consumer on (shard/consumer_order.py add); () costs nothing per queue.
        self.consumers: list[Consumer] | tuple[()] = ()
        # msg_id -> owner (Consumer, or ChannelRef for basic.get); bounded by prefetch/credit.
        self.unacked: dict[int, Consumer | ChannelRef] = NO_UNACKED
        # Transient messages delivered to manual-ack consumers without being stored, until settled:
        # virtual id -> (ts, exchange, routing_key, props_raw, body). Their ids are in `unacked` like
        # any other; prefetch and credit bound them as they bound `unacked`. See deliver_unstored.
        self.held: dict[int, tuple] = NO_HELD
        # Virtual id -> store id of held messages stored since (materialize), until settled.
        self.aliases: dict[int, int] = NO_HELD
        self._next_vid = VIRTUAL
        self._rr = 0
        self.had_consumers = False
        self.exclusive_consumer = False
        self.deleted = False
        # Per-priority consumer groups, or only the single active consumer; None: plain round-robin
        # over all consumers (see shard/consumer_order.py).
        self.groups: list[list] | None = None
        self.sac = self.arguments.get("x-single-active-consumer") is True

    # ----------------------------------------------------------------- consumers
    def add_consumer(self, consumer: Consumer) -> None:
        consumer_order.add(self, consumer)
        self.had_consumers = True
        if consumer.exclusive:
            self.exclusive_consumer = True

    def remove_consumer(self, consumer: Consumer) -> None:
        if not consumer_order.remove(self, consumer):
            return
        if consumer.exclusive:
            self.exclusive_consumer = False

    def unacked_map(self) -> dict[int, Consumer | ChannelRef]:
        """The unacked map to insert into: a dict of this queue's own from the first one on."""
        unacked = self.unacked
        if unacked is NO_UNACKED:
            unacked = self.unacked = {}
        return unacked

    # ------------------------------------------------------------------ delivery
    def deliver(self, send: Send) -> None:
        """Hand ready messages to consumers that can take them, round-robin."""
        consumers = self.consumers
        if not consumers or not self.store.ready:
            return
        if self.groups is None:
            self._rr = self.deliver_to(consumers, self._rr, send, 0)
        else:
            consumer_order.deliver_ranked(self, send, 0)

    def deliver_unstored(self, send: Send, exchange: str, routing_key: str, props_raw: bytes, body: bytes,
                         ts: int = 0) -> bool:
        """A transient message to this empty plain queue, straight to the next consumer without being stored.

        Only when the consumer the round-robin would pick next can take it. A no-ack one: the message
        is delivered and settled in one step, as the append, shift and ack of the delivery pass would
        have done (nothing outlives the delivery, so nothing had to reach the segment). A manual-ack
        one: the message is held in memory under a virtual id (``held``) until its ack drops it; a
        requeue, or a later message appended to this queue, first stores the held ones in their
        order as delivered messages (``materialize``), so requeue positions and redelivery are those
        of the store. Transient messages are dropped when a store is reopened, so a held message
        loses nothing at a restart the stored one would have kept. False: store it as usual.
        """
        consumers = self.consumers
        n = len(consumers)
        i = self._rr
        for _ in range(n):
            if i >= n:
                i = 0
            c = consumers[i]
            i += 1
            if c.can_take():
                if not c.no_ack and held_total[0] + len(body) + HELD_OVERHEAD > HELD_BUDGET:
                    return False  # over this shard's budget for held bodies: stored as before
                self._rr = i
                c.credit -= 1 + (len(body) >> _CREDIT_SHIFT)
                if c.no_ack:
                    send(c.fe, [_DELIVER, c.conn_id, c.channel, c.tag, self.qid, 0, False,
                                exchange, routing_key, props_raw, body])
                    self.n_deliver_no_ack += 1
                else:
                    held_total[0] += len(body) + HELD_OVERHEAD
                    vid = self._next_vid
                    self._next_vid = vid + 1
                    held = self.held
                    if held is NO_HELD:
                        held = self.held = {}
                    held[vid] = (ts, exchange, routing_key, props_raw, body)
                    self.unacked_map()[vid] = c
                    c.unacked += 1
                    c.chan.unacked += 1
                    send(c.fe, [_DELIVER, c.conn_id, c.channel, c.tag, self.qid, vid, False,
                                exchange, routing_key, props_raw, body])
                self.n_delivered += 1
                return True
        return False

    def deliver_unstored_run(self, put_many: Callable[[bytes, list], None], exchange: str, routing_key: str,
                             props_raw: bytes, bodies: list) -> int:
        """deliver_unstored for each of a PUBLISH_RUN's bodies in order while it succeeds: how many went.

        The DELIVER items are built in one loop and handed to the batcher at once per frontend, the
        consumer's credit and the queue's counters updated once. It stops where the round-robin's next
        consumer cannot take a body (credit used up, inactive: deliver_unstored would return False) or
        acks manually (deliver_unstored holds those, body by body); the caller hands the rest to
        deliver_unstored or the store, in order, so they follow these."""
        consumers = self.consumers
        qid = self.qid
        if len(consumers) == 1:
            c = consumers[0]
            credit = c.credit
            if not c.no_ack or not c.active or credit <= 0:
                return 0
            conn_id, channel, tag = c.conn_id, c.channel, c.tag
            items: list = []
            append = items.append
            for body in bodies:
                append([_DELIVER, conn_id, channel, tag, qid, 0, False, exchange, routing_key, props_raw, body])
                credit -= 1 + (len(body) >> _CREDIT_SHIFT)
                if credit <= 0:
                    break
            c.credit = credit
            self._rr = 1
            put_many(c.fe, items)
            took = len(items)
        else:
            took = 0
            n = len(consumers)
            i = self._rr
            by_fe: dict[bytes, list] = {}
            for body in bodies:
                for _ in range(n):
                    if i >= n:
                        i = 0
                    c = consumers[i]
                    i += 1
                    if c.can_take():
                        break
                else:
                    break
                if not c.no_ack:
                    break
                self._rr = i
                c.credit -= 1 + (len(body) >> _CREDIT_SHIFT)
                item = [_DELIVER, c.conn_id, c.channel, c.tag, qid, 0, False, exchange, routing_key, props_raw, body]
                items = by_fe.get(c.fe)
                if items is None:
                    by_fe[c.fe] = [item]
                else:
                    items.append(item)
                took += 1
            for fe, items in by_fe.items():
                put_many(fe, items)
        self.n_delivered += took
        self.n_deliver_no_ack += took
        return took

    def materialize(self) -> None:
        """Store the held messages, in the order they were delivered, as delivered and unacked ones.

        Called before anything else is appended to this queue and before a held message is
        requeued: each then sits in the store where the stored path would have put it (behind what
        came before, ahead of what comes after), and a requeue takes the store's position rules.
        Their virtual ids stay the keys of ``unacked`` (the frontend acks with them); ``aliases``
        maps them to their store ids."""
        held = self.held
        if not held:
            return
        self.held = NO_HELD
        held_total[0] -= sum(len(rec[4]) + HELD_OVERHEAD for rec in held.values())
        aliases = self.aliases
        if aliases is NO_HELD:
            aliases = self.aliases = {}
        append_taken = self.store.append_taken
        items = list(held.items())
        for k, (vid, (ts, exchange, routing_key, props_raw, body)) in enumerate(items):
            try:
                aliases[vid] = append_taken(ts, 0, exchange, routing_key, props_raw, body)
            except BaseException:
                self.held = dict(items[k:])  # not stored: still held (a full disk; retried later)
                held_total[0] += sum(len(rec[4]) + HELD_OVERHEAD for _, rec in items[k:])
                raise

    def drop_held(self) -> None:
        """Forget the held messages (the queue is deleted: as its store's records are)."""
        held_total[0] -= sum(len(rec[4]) + HELD_OVERHEAD for rec in self.held.values())
        self.held = NO_HELD

    def read(self, msg_id: int) -> tuple:
        """(ts_ms, flags, exchange, routing_key, props_raw, body) of an outstanding or stored message."""
        if msg_id >= VIRTUAL:
            rec = self.held.get(msg_id)
            if rec is not None:
                return (rec[0], 0, *rec[1:])
            msg_id = self.aliases[msg_id]  # KeyError: gone, as from the store
        return self.store.read(msg_id)

    def _settle_virtual(self, vid: int, requeue: bool) -> None:
        """The store's ack or requeue of a message delivered under a virtual id."""
        held = self.held
        if vid in held:
            if not requeue:
                held_total[0] -= len(held.pop(vid)[4]) + HELD_OVERHEAD  # acked or dropped: never stored
                if not held:
                    self.held = NO_HELD
                return
            self.materialize()
        msg_id = self.aliases.pop(vid, None)
        if msg_id is None:
            return
        if requeue:
            self.store.requeue(msg_id)
        else:
            self.store.ack(msg_id)

    def deliver_to(self, consumers: list[Consumer], i: int, send: Send, _now: int) -> int:
        """Round-robin over `consumers` from index i while one can take; the next index."""
        store = self.store
        n = len(consumers)
        unacked = self.unacked_map()
        qid = self.qid
        idle = 0
        while idle < n and store.ready:
            if i >= n:
                i = 0
            c = consumers[i]
            i += 1
            if not c.can_take():
                idle += 1
                continue
            msg = store.shift()
            if msg is None:
                break
            idle = 0
            msg_id, redelivered, _ts, _flags, exchange, routing_key, props_raw, body = msg
            c.credit -= 1 + (len(body) >> _CREDIT_SHIFT)
            if c.no_ack:
                store.ack(msg_id)
            else:
                c.unacked += 1
                c.chan.unacked += 1
                unacked[msg_id] = c
            send(c.fe, [_DELIVER, c.conn_id, c.channel, c.tag, qid, msg_id, redelivered,
                        exchange, routing_key, props_raw, body])
        return i

    def get(self, chan: ChannelRef, no_ack: bool) -> list | None:
        msg = self.store.shift()
        if msg is None:
            return None
        msg_id, redelivered, _ts, _flags, exchange, routing_key, props_raw, body = msg
        if no_ack:
            self.store.ack(msg_id)
        else:
            chan.unacked += 1
            self.unacked_map()[msg_id] = chan
        return [self.qid, msg_id, redelivered, exchange, routing_key, props_raw, body, self.store.ready]

    # ---------------------------------------------------------------- settlement
    def ack(self, msg_id: int, fe: bytes, conn_id: int, channel: int) -> bool:
        owner = self.unacked.get(msg_id)
        if owner is None or owner.conn_id != conn_id or owner.channel != channel or owner.fe != fe:
            return False
        del self.unacked[msg_id]
        owner.settle()
        if msg_id >= VIRTUAL:
            self._settle_virtual(msg_id, False)
        else:
            self.store.ack(msg_id)
        return True

    def nack(self, msg_id: int, fe: bytes, conn_id: int, channel: int, requeue: bool) -> bool:
        owner = self.unacked.get(msg_id)
        if owner is None or owner.conn_id != conn_id or owner.channel != channel or owner.fe != fe:
            return False
        del self.unacked[msg_id]
        owner.settle()
        if msg_id >= VIRTUAL:
            self._settle_virtual(msg_id, requeue)
        elif requeue:
            self.store.requeue(msg_id)
        else:
            self.store.ack(msg_id)
        return True

    def requeue_owned(self, match: Callable[[Consumer | ChannelRef], bool]) -> int:
        """Requeue every unacked message whose owner matches (channel/connection gone, recover)."""
        gone = [mid for mid, owner in self.unacked.items() if match(owner)]
        if self.held:
            self.materialize()  # held ones go to the requeue heap by store id, in delivery order
        for mid in sorted(gone):
            owner = self.unacked.pop(mid)
            owner.settle()
            if mid >= VIRTUAL:
                self._settle_virtual(mid, True)
            else:
                self.store.requeue(mid)
        return len(gone)

    def purge(self) -> int:
        return self.store.purge()

    def info(self) -> dict:
        store = self.store
        # Storage damage found since the shard opened the queue (docs/storage.md "Recovery"): for
        # the management API and metrics; 0 for stores that do not check (streams).
        return {"messages": store.ready, "consumers": len(self.consumers),
                "damaged_records": getattr(store, "damaged_records", 0),
                "damaged_acks": getattr(store, "damaged_acks", 0)}
