"""A queue with RabbitMQ's optional behaviours: TTL, dead-lettering, length limits,
delivery limit, consumer timeout and queue expiry.

Chosen when a queue is opened (``needs_features``) or, for a plain queue that
receives a message carrying a per-message ``expiration``, swapped in for it
(``upgrade``): a queue without any of these keeps running ``Queue``'s code
untouched.

Semantics follow RabbitMQ's classic queues:

* TTL: a message expires ``min(x-message-ttl, expiration)`` ms after it was
  enqueued (the record timestamp, so also across restarts). Expiry happens at
  the head of the queue (a per-message TTL behind a longer-lived message waits
  until it reaches the head), on the shard's timer heap at the head's
  deadline, with or without consumers. TTL 0: delivered if a consumer can take
  it in the turn it arrives, else expired.
* Limits count ready messages (not unacked ones). ``drop-head`` dead-letters
  the oldest (reason ``maxlen``); ``reject-publish`` refuses the new message
  (confirm nack); ``reject-publish-dlx`` also dead-letters it.
* ``x-delivery-limit`` (and ``x-queue-type: quorum``): each return of a
  delivered message (nack/reject with requeue, channel closed) counts; the
  redelivery carries ``x-delivery-count``; a message returned more than the
  limit is dead-lettered (``delivery_limit``). Counts survive a restart
  (shard/delivery_counts.py).
* ``x-consumer-timeout``: an unacked delivery older than that closes its
  channel with 406 (the frontend then requeues it through CHANNEL_CLOSED).
* ``x-expires``: with no consumers and no basic.get for that long, the shard
  asks the node to delete the queue.
* ``x-message-deduplication``: a message whose key is in the queue's cache is
  not enqueued (shard/dedup.py); the publisher's confirm is an ack.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from broker import contract
from broker.amqp.properties import decode_properties, encode_properties
from broker.dedup import dedup_settings
from shard import delivery_counts
from shard.ack_timeouts import timeout_text
from shard.consumer_order import deliver_ranked
from shard.consumers import ChannelRef, Consumer
from shard.deadletter import DELIVERY_LIMIT, EXPIRED, MAXLEN, REJECTED, expiration_ms, has_dlx_header
from shard.dedup import QueueDedup
from shard.queue import VIRTUAL, Queue, Send
from shard.store import QueueStore
from shard.timers import now_ms

if TYPE_CHECKING:
    from shard.timers import TimerHeap

_DELIVER = contract.DELIVER
_CREDIT_SHIFT = contract.CREDIT_BYTES_SHIFT
_CLOSE_CHANNEL = contract.CLOSE_CHANNEL

# Queue arguments that need this class; a queue with none of them is a plain Queue.
FEATURE_ARGS = frozenset((
    "x-message-ttl", "x-expires", "x-dead-letter-exchange", "x-max-length", "x-max-length-bytes",
    "x-delivery-limit", "x-consumer-timeout", "x-message-deduplication",
))

# A queue that ever received a message with a per-message TTL keeps this marker file, so after a
# restart it is opened as a FeatureQueue: its head alone does not tell whether an expiring message
# waits further back, and scanning every record at open would make boot time grow with queue length.
EXPIRING_MARK = ".expiring"


def needs_features(arguments: dict | None) -> bool:
    if not arguments:
        return False
    return any(k in FEATURE_ARGS for k in arguments) or arguments.get("x-queue-type") == "quorum"


def _int_arg(arguments: dict, key: str) -> int | None:
    v = arguments.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def _with_delivery_count(props_raw: bytes, count: int) -> bytes:
    props = decode_properties(props_raw)
    headers = dict(props.headers or {})
    headers["x-delivery-count"] = count
    props.headers = headers
    return encode_properties(props)


class FeatureShard(Protocol):
    """What a feature queue uses of the shard that holds it (shard/worker.py ShardWorker)."""

    timers: TimerHeap
    data: Any  # its data socket: put(identity, item)

    def mark_dirty(self, q: Queue) -> None: ...

    def returns_changed(self, q: FeatureQueue) -> None: ...

    def request_delete_unused(self, op: str, q: Queue) -> None: ...

    def dead_letter(self, q: FeatureQueue, reason: str, flags: int, exchange: str, routing_key: str,
                    props_raw: bytes, body: bytes) -> None: ...


# The saved delivery counts of every queue that has none (FeatureQueue._returns_saved): never written.
_NO_RETURNS: dict[int, int] = {}


class FeatureQueue(Queue):
    __slots__ = (
        "shard", "ttl", "dlx", "dlrk", "max_length", "max_bytes", "overflow", "delivery_limit",
        "count_returns", "returns", "consumer_timeout", "delivered_at", "expires", "last_used",
        "_expire_requested", "_fresh_from", "_wake_at", "dedup", "_returns_saved",
    )

    def __init__(self, qid: int, vhost: str, name: str, defn: Any, store: QueueStore,
                 shard: FeatureShard, arguments: dict | None = None) -> None:
        super().__init__(qid, vhost, name, defn, store)
        self.shard = shard
        # msg_id -> times returned to the queue; saved with the periodic sync (save_returns).
        self.returns: dict[int, int] = {mid: n for mid, n in delivery_counts.load(store.path).items()
                                        if store.holds(mid)}
        # What was last written: only compared and replaced, never changed in place, so shared when empty.
        self._returns_saved = dict(self.returns) if self.returns else _NO_RETURNS
        if self.returns:
            shard.returns_changed(self)  # a later ack changes them: the periodic sync looks at this queue
        self.delivered_at: dict[int, int] = {}  # msg_id -> delivery time (ms), oldest first
        self.last_used = now_ms()
        self._expire_requested = False
        # store.mark() before the first append of this turn: TTL 0 messages may still go to a consumer.
        self._fresh_from: Any = None  # an int for QueueStore, a dict for PriorityStore
        self._wake_at: int | None = None
        self.dedup: QueueDedup | None = None
        self.configure(self.arguments if arguments is None else arguments)
        if store.ready:
            self._arm(now_ms())  # recovered messages may have expired while the node was down

    def configure(self, a: dict) -> None:
        """Take the (effective: arguments with policies folded in) settings; may be called again."""
        self.ttl = _int_arg(a, "x-message-ttl")
        dlx = a.get("x-dead-letter-exchange")
        self.dlx = dlx if isinstance(dlx, str) else None
        dlrk = a.get("x-dead-letter-routing-key")
        self.dlrk = dlrk if isinstance(dlrk, str) else None
        self.max_length = _int_arg(a, "x-max-length")
        self.max_bytes = _int_arg(a, "x-max-length-bytes")
        self.overflow = a.get("x-overflow") or "drop-head"
        self.delivery_limit = _int_arg(a, "x-delivery-limit")
        self.count_returns = self.delivery_limit is not None or a.get("x-queue-type") == "quorum"
        self.consumer_timeout = _int_arg(a, "x-consumer-timeout")
        self.expires = _int_arg(a, "x-expires")
        dedup = dedup_settings(a)
        if dedup is None:
            self.dedup = None
        elif self.dedup is None:
            self.dedup = QueueDedup(dedup)
        else:
            self.dedup.configure(dedup)
        if self.expires:
            self._arm(self.last_used + self.expires)
        self._arm(now_ms())  # a shorter TTL or a lower limit applies to what is queued already

    @classmethod
    def upgrade(cls, q: Queue, defn: Any, shard: FeatureShard, arguments: dict | None = None) -> FeatureQueue:
        """The same queue, with features (a per-message TTL arrived, or a policy now applies)."""
        fq = cls(q.qid, q.vhost, q.name, defn, q.store, shard, arguments)
        fq.consumers = q.consumers
        # Messages held unstored (shard/queue.py deliver_unstored) are stored first, and keyed by
        # their store ids here; the frontend still settles them by their virtual ids (aliases).
        q.materialize()
        aliases = q.aliases
        fq.unacked = {aliases.get(k, k): v for k, v in q.unacked.items()} if aliases else q.unacked
        fq.aliases = aliases
        fq._rr = q._rr
        fq.groups = q.groups
        fq.had_consumers = q.had_consumers
        fq.exclusive_consumer = q.exclusive_consumer
        return fq

    # ----------------------------------------------------------------- publish
    def publish(self, ts: int, flags: int, exchange: str, routing_key: str, props_raw: bytes,
                body: bytes) -> bool:
        """Enqueue one message; False when x-overflow refused it (a duplicate counts as accepted)."""
        dedup = self.dedup
        if dedup is not None:
            seen = dedup.check(props_raw)
            if seen is None:
                return True  # dropped; its confirm still waits for this queue's sync, as the original's
        store = self.store
        limited = self.max_length is not None or self.max_bytes is not None
        if limited and self.overflow != "drop-head" and self._full():
            if self.overflow == "reject-publish-dlx":
                self.shard.dead_letter(self, MAXLEN, flags, exchange, routing_key, props_raw, body)
            return False
        if self._fresh_from is None:
            self._fresh_from = store.mark()
        store.append(ts, flags, exchange, routing_key, props_raw, body)
        if dedup is not None:
            dedup.remember(seen)  # only what was enqueued: a refused message's retry may pass
        if limited and self.overflow == "drop-head":
            self._drop_overflow()
        return True

    def _full(self) -> bool:
        store = self.store
        return ((self.max_length is not None and store.ready >= self.max_length)
                or (self.max_bytes is not None and store.ready_bytes >= self.max_bytes))

    def _drop_overflow(self) -> None:
        store = self.store
        max_length, max_bytes = self.max_length, self.max_bytes
        while store.ready and ((max_length is not None and store.ready > max_length)
                               or (max_bytes is not None and store.ready_bytes > max_bytes)):
            msg = store.drop_head()
            if msg is None:
                break
            self.returns.pop(msg[0], None)
            self._dead(MAXLEN, msg)

    # ----------------------------------------------------------------- delivery
    def deliver(self, send: Send) -> None:
        now = now_ms()
        consumers = self.consumers
        store = self.store
        if consumers and store.ready:
            if self.groups is None:
                self._rr = self.deliver_to(consumers, self._rr, send, now)
            else:
                deliver_ranked(self, send, now)
        self._fresh_from = None
        head = self._expire_head(now)
        self._arm_next(now, head)

    def deliver_to(self, consumers: list[Consumer], i: int, send: Send, now: int) -> int:
        store = self.store
        n = len(consumers)
        unacked = self.unacked_map()
        qid = self.qid
        fresh = self._fresh_from
        returns = self.returns
        timing = self.consumer_timeout is not None
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
            msg_id, redelivered, ts, _flags, exchange, routing_key, props_raw, body = msg
            deadline = self._deadline(ts, props_raw)
            if deadline is not None and deadline <= now and (
                    fresh is None or redelivered or not store.after(msg_id, fresh)):
                store.ack(msg_id)
                returns.pop(msg_id, None)
                self._dead(EXPIRED, msg)
                i -= 1  # this consumer did not get anything: it keeps its turn
                continue
            idle = 0
            if returns:
                count = returns.get(msg_id)
                if count:
                    props_raw = _with_delivery_count(props_raw, count)
            c.credit -= 1 + (len(body) >> _CREDIT_SHIFT)
            if c.no_ack:
                store.ack(msg_id)
                returns.pop(msg_id, None)
            else:
                c.unacked += 1
                c.chan.unacked += 1
                unacked[msg_id] = c
                if timing:
                    self.delivered_at[msg_id] = now
            send(c.fe, [_DELIVER, c.conn_id, c.channel, c.tag, qid, msg_id, redelivered,
                        exchange, routing_key, props_raw, body])
        return i

    def get(self, chan: ChannelRef, no_ack: bool) -> list | None:
        now = now_ms()
        self._touch(now)
        self._expire_head(now)
        msg = self.store.shift()
        if msg is None:
            return None
        msg_id, redelivered, _ts, _flags, exchange, routing_key, props_raw, body = msg
        count = self.returns.get(msg_id)
        if count:
            props_raw = _with_delivery_count(props_raw, count)
        if no_ack:
            self.store.ack(msg_id)
            self.returns.pop(msg_id, None)
        else:
            chan.unacked += 1
            self.unacked_map()[msg_id] = chan
            if self.consumer_timeout is not None:
                self.delivered_at[msg_id] = now
        self._arm_next(now, self._expire_head(now))  # a new head: its deadline
        return [self.qid, msg_id, redelivered, exchange, routing_key, props_raw, body, self.store.ready]

    # ----------------------------------------------------------------- settlement
    def ack(self, msg_id: int, fe: bytes, conn_id: int, channel: int) -> bool:
        vid = 0
        if msg_id >= VIRTUAL:  # delivered unstored before this queue had features (upgrade)
            vid, msg_id = msg_id, self.aliases.get(msg_id, msg_id)
        if not super().ack(msg_id, fe, conn_id, channel):
            return False
        if vid:
            del self.aliases[vid]
        self.returns.pop(msg_id, None)
        self.delivered_at.pop(msg_id, None)
        return True

    def nack(self, msg_id: int, fe: bytes, conn_id: int, channel: int, requeue: bool) -> bool:
        vid = 0
        if msg_id >= VIRTUAL:  # delivered unstored before this queue had features (upgrade)
            vid, msg_id = msg_id, self.aliases.get(msg_id, msg_id)
        owner = self.unacked.get(msg_id)
        if owner is None or owner.conn_id != conn_id or owner.channel != channel or owner.fe != fe:
            return False
        if vid:
            del self.aliases[vid]
        del self.unacked[msg_id]
        owner.settle()
        self.delivered_at.pop(msg_id, None)
        if requeue:
            self._return(msg_id)
        else:
            self._dead_by_id(msg_id, REJECTED)
        return True

    def requeue_owned(self, match) -> int:
        gone = [mid for mid, owner in self.unacked.items() if match(owner)]
        for mid in sorted(gone):
            owner = self.unacked.pop(mid)
            owner.settle()
            self.delivered_at.pop(mid, None)
            self._return(mid)
        return len(gone)

    def purge(self) -> int:
        unacked = self.unacked
        self.returns = {k: v for k, v in self.returns.items() if k in unacked}
        return super().purge()

    def save_returns(self) -> bool:
        """Write the delivery counts if they changed since the last write (periodic sync, stop).
        Whether any are left, written or not (a later ack may change them: the periodic sync keeps
        looking at this queue until none are)."""
        if self.returns != self._returns_saved and not self.deleted:
            delivery_counts.save(self.store.path, self.returns)
            self._returns_saved = dict(self.returns) if self.returns else _NO_RETURNS
        return bool(self.returns or self._returns_saved)

    def _return(self, msg_id: int) -> None:
        if self.count_returns:
            count = self.returns.get(msg_id, 0) + 1
            limit = self.delivery_limit
            if limit is not None and count > limit:
                self.returns.pop(msg_id, None)
                self._dead_by_id(msg_id, DELIVERY_LIMIT)
                return
            self.returns[msg_id] = count
            self.shard.returns_changed(self)  # for the periodic sync (save_returns)
        self.store.requeue(msg_id)

    # ----------------------------------------------------------------- consumers
    def add_consumer(self, consumer: Consumer) -> None:
        super().add_consumer(consumer)
        self._expire_requested = False

    def remove_consumer(self, consumer: Consumer) -> None:
        super().remove_consumer(consumer)
        if not self.consumers:
            self._touch(now_ms())

    # ----------------------------------------------------------------- dead-lettering
    def _dead(self, reason: str, msg: tuple) -> None:
        """A message that has left the queue for `reason`: to the queue's or the message's own DLX."""
        _id, _red, _ts, flags, exchange, routing_key, props_raw, body = msg
        if self.dlx is not None or has_dlx_header(props_raw):
            self.shard.dead_letter(self, reason, flags, exchange, routing_key, props_raw, body)

    def _dead_by_id(self, msg_id: int, reason: str) -> None:
        _ts, flags, exchange, routing_key, props_raw, body = self.store.read(msg_id)
        self.store.ack(msg_id)
        if self.dlx is not None or has_dlx_header(props_raw):
            self.shard.dead_letter(self, reason, flags, exchange, routing_key, props_raw, body)

    # ----------------------------------------------------------------- time
    def _deadline(self, ts: int, props_raw: bytes) -> int | None:
        ttl = self.ttl
        if len(props_raw) >= 2 and props_raw[0] & 0x01:  # expiration flag: decode only then
            exp = expiration_ms(props_raw)
            if exp is not None and (ttl is None or exp < ttl):
                ttl = exp
        return None if ttl is None else ts + ttl

    def _expire_head(self, now: int) -> int | None:
        """Dead-letter expired messages at the head; the head's deadline if it has one."""
        store = self.store
        fresh = self._fresh_from
        while True:
            msg = store.peek()
            if msg is None:
                return None
            msg_id, redelivered, ts, _flags, _ex, _rk, props_raw, _body = msg
            deadline = self._deadline(ts, props_raw)
            if deadline is None or deadline > now:
                return deadline
            if fresh is not None and not redelivered and store.after(msg_id, fresh):
                return None  # arrived this turn: deliver() decides after offering it to consumers
            store.drop_head()
            self.returns.pop(msg_id, None)
            self._dead(EXPIRED, msg)

    def info(self) -> dict:
        info = super().info()
        if self.expires:
            # The node asks before it deletes an expired queue: a declare may have renewed it since.
            info["expired"] = not self.consumers and now_ms() >= self.last_used + self.expires
        return info

    def renew_lease(self) -> None:
        """queue.declare of this queue: x-expires counts from now."""
        if self.expires:
            self._touch(now_ms())

    def _touch(self, now: int) -> None:
        self.last_used = now
        self._expire_requested = False
        if self.expires:
            self._arm(now + self.expires)

    def _arm(self, when: int) -> None:
        if self._wake_at is None or when < self._wake_at:
            self._wake_at = when
            self.shard.timers.schedule(when, self._wake)

    def _arm_next(self, now: int, head_deadline: int | None) -> None:
        if head_deadline is not None:
            self._arm(head_deadline)
        if self.delivered_at:
            self._arm(next(iter(self.delivered_at.values())) + self.consumer_timeout)
        if self.expires and not self.consumers and not self._expire_requested:
            self._arm(self.last_used + self.expires)

    def _wake(self) -> None:
        self._wake_at = None
        if self.deleted:
            return
        now = now_ms()
        if (self.max_length is not None or self.max_bytes is not None) and self.overflow == "drop-head":
            self._drop_overflow()
        if self.delivered_at:
            self._check_consumer_timeout(now)
        if self.expires and not self.consumers and not self._expire_requested \
                and now >= self.last_used + self.expires:
            self._expire_requested = True
            self.shard.request_delete_unused("queue.expire", self)
        self.shard.mark_dirty(self)  # deliver() expires the head and arms the next wake-up

    def _check_consumer_timeout(self, now: int) -> None:
        timeout = self.consumer_timeout
        delivered_at = self.delivered_at
        late = []
        for msg_id, at in delivered_at.items():
            if at + timeout > now:
                break
            late.append(msg_id)
        closed = set()
        for msg_id in late:
            del delivered_at[msg_id]
            owner = self.unacked.get(msg_id)
            if owner is None or owner.timeout is not None:
                continue  # a consumer's own x-consumer-timeout wins: shard/ack_timeouts.py times it
            key = (owner.fe, owner.conn_id, owner.channel)
            if key in closed:
                continue
            closed.add(key)
            text = timeout_text(owner.channel, timeout)
            self.shard.data.put(owner.fe, [_CLOSE_CHANNEL, owner.conn_id, owner.channel, 406, text])
