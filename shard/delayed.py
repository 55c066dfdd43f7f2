"""Delayed-message exchanges: the shard keeps their messages until due, then routes them.

A message published with a positive ``x-delay`` to a delayed exchange
(``x-delayed-message``, the ``delayed-message`` policy key, or LavinMQ's
``x-delayed-exchange: true`` argument) reaches the shard that owns the
exchange's delay store (``broker.routing.delay_store_shard``) as one
``DELAYED_PUBLISH`` item. The shard appends it to the exchange's delay store,
a ``QueueStore`` under ``<data>/delayed/<sha1(vhost)>/<sha1(exchange)>/``,
whose record timestamp is the **due time** (wall-clock ms), not the arrival
time: recovery needs no header decoding and never disagrees with what the
publish decided.

In memory there is one heap for the whole shard, of one int per pending message
(``due_ms << 96 | store number << 64 | msg_id``, about 52 bytes, a third of a
tuple's cost), and at most one useful entry in the shard's ``TimerHeap``. When it
fires, every due message is read back from its store and routed through the
shard's replica of the definitions (the exchange routes as its
``x-delayed-type``), with its CC/BCC keys, by ``ShardWorker.route_to_queues``,
the same function dead-lettering uses. Its delay record is removed
afterwards: at once when nothing has to be synced, otherwise after the group
sync that makes the local appends durable, so neither a killed process nor a
power loss between the two loses it (it may be delivered twice instead).

A copy routed to a queue of another shard keeps its record until that shard confirms it; a clean
stop waits for those confirms (``in_flight``, shard/forward_settle.py), or the restarted shard would
route the message again. A stopping shard routes nothing that falls due.

A queue that does not take a due message (full with ``x-overflow: reject-publish``, or its append
failed: a full disk), here or on another shard (whose CONFIRM_NACK names it), gets it again later:
the record stays, and only the queues that refused it are tried again, after 1 s, then 2, 4 ... up
to 30 s, until they take it or are deleted. RabbitMQ's plugin makes one attempt at publishing
each due message (its README's limitations), so such a queue drops it there; here a due message is
not lost to a full queue (as RabbitMQ's at-least-once dead-lettering retries a reject-publish
target). A
``reject-publish-dlx`` queue dead-letters it, as RabbitMQ's: done. A CONFIRM_NACK that names no
queue says the copy was stored but not made durable as asked (the group sync failed, or fewer
in-sync followers than --min-isr): the target holds it, a resend would only add copies while
the ISR stays short, so the record is removed as after a confirm (logged). A clean stop does not
wait for a refusing queue: the record is routed again after the restart, to every queue bound then
(those that took it get it a second time: at least once).

The store's read cursor is moved past every record as soon as it is appended
(``shift``), so any record can be removed (``ack``) in due order rather than
append order.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
from typing import TYPE_CHECKING, Protocol

from broker.datadir import DELAYED_DIR, name_hash
from broker.routing import delay_store_shard, may_have_cc, sender_routes
from shard.store import QueueStore, queue_dir
from shard.timers import now_ms

if TYPE_CHECKING:
    import asyncio
    from collections.abc import Callable

    from broker.definitions import Definitions
    from shard.timers import TimerHeap

log = logging.getLogger("shardmq.shard")

# Due messages routed per loop turn: a burst falling due at once interleaves with deliveries,
# acks and publishes instead of holding the loop (2,000 routings take a few ms).
_ROUTE_PER_TURN = 2000

# A queue that refused a due message (full, reject-publish) gets it again after this long, doubling
# per attempt up to _RETRY_MAX_MS.
_RETRY_MS = 1000
_RETRY_MAX_MS = 30_000

# Heap keys: due_ms << 96 | store number << 64 | msg_id (segment << 32 | position).
_DUE_SHIFT = 96
_NO_SHIFT = 64
_NO_MASK = (1 << 32) - 1
_ID_MASK = (1 << 64) - 1


def _sender_routes(props: bytes) -> tuple[bytes, list[str]]:
    """The properties a due message is routed with (BCC removed) and its CC/BCC routing keys."""
    if not may_have_cc(props):
        return props, []
    try:
        return sender_routes(props)
    except ValueError:
        return props, []


class DelayStore:
    """The pending delayed messages of one exchange."""

    __slots__ = ("no", "vhost", "exchange", "durable", "store", "pending", "deleted")

    def __init__(self, no: int, vhost: str, exchange: str, durable: bool, store: QueueStore) -> None:
        self.no = no  # its number in the heap keys
        self.vhost = vhost
        self.exchange = exchange
        self.durable = durable
        self.store = store
        self.pending = 0
        self.deleted = False


class Forward:
    """A due message routed to queues of other shards, kept until each of them confirmed it, or one
    that a queue refused, kept until that queue took it."""

    __slots__ = ("seq", "ds", "msg_id", "items", "sync_pending", "refused", "attempts", "retry_armed")

    def __init__(self, seq: int, ds: DelayStore, msg_id: int, items: dict[int, list], sync_pending: bool,
                 refused: list[str]) -> None:
        self.seq = seq
        self.ds = ds
        self.msg_id = msg_id
        self.items = items  # shard -> PUBLISH item not yet confirmed by it (sent again if it restarts)
        self.sync_pending = sync_pending  # local appends wait for the group sync
        self.refused = refused  # queue names (here or on other shards) to route it to again
        self.attempts = 0
        self.retry_armed = False


class DelayShard(Protocol):
    """What the delay stores use of the shard that owns them (shard/worker.py ShardWorker)."""

    index: int
    settings: dict
    loop: asyncio.AbstractEventLoop
    timers: TimerHeap
    defs: Definitions | None
    stopping: bool
    fsync: bool  # settings "sync" is fsync

    def fence_check(self) -> None: ...

    def confirm_stored(self, fe: bytes, conn_id: int | None, channel: int | None, seq: int | None,
                       sync_store: QueueStore | None) -> None: ...

    def after_sync(self, callback: Callable[[], None]) -> None: ...

    def forget_store(self, store: QueueStore) -> None: ...

    def route_to_queues(self, vhost: str, names: list[str] | tuple, flags: int, exchange: str, routing_key: str,
                        props: bytes, body: bytes, confirm_seq: int | None = None,
                        peer_channel: int = ..., send: bool = True,
                        refused: list[str] | None = None) -> tuple[bool, dict[int, list]]: ...

    def forward(self, shard: int, item: list) -> None: ...


class DelayedMessages:
    """Every delay store of one shard, one heap of due times, one timer."""

    def __init__(self, worker: DelayShard) -> None:
        self.worker = worker
        self.stores: dict[tuple[str, str], DelayStore] = {}
        self._heap: list[int] = []  # due_ms << 96 | store no << 64 | msg_id
        self._by_no: dict[int, DelayStore] = {}
        self._store_no = itertools.count(1)
        self._armed_at: int | None = None  # due time of our earliest TimerHeap entry
        self._peers_up: set[int] = set()
        # Recovered messages may be due at once; they wait until every peer shard has loaded
        # its definitions, or a peer still starting would drop what we forward to it.
        self._peers_ready = False
        self._forwards: dict[int, Forward] = {}  # confirm seq of the PUBLISH items -> forward
        self._forward_seq = itertools.count(1)

    # ----------------------------------------------------------------- setup
    def _root(self) -> str:
        return os.path.join(self.worker.settings["data_dir"], DELAYED_DIR)

    def load(self) -> None:
        """Open (and recover) the delay stores this shard owns under the current shard count."""
        worker = self.worker
        shards = int(worker.settings.get("shards", 1))
        root = self._root()
        if os.path.isdir(root):
            for v in worker.defs.vhosts.values():
                vdir = os.path.join(root, name_hash(v.name))
                if not os.path.isdir(vdir):
                    continue
                for xname, x in v.exchanges.items():
                    if (delay_store_shard(v.name, xname, shards) == worker.index
                            and os.path.isdir(os.path.join(vdir, name_hash(xname)))):
                        self._open(v.name, xname, x.durable)
        self._check_peers()
        if self._heap:
            log.info("shard %d: %d delayed messages recovered", worker.index, len(self._heap))
            self._arm(self._heap[0] >> _DUE_SHIFT)

    def _open(self, vhost: str, exchange: str, durable: bool) -> DelayStore:
        path = queue_dir(self._root(), vhost, exchange)
        # A non-durable exchange's store is not fsynced, as a non-durable queue's: after a restart the
        # exchange is gone and the node deletes its store (DataDir.remove_stale_delay_stores).
        store = QueueStore(path, segment_size=int(self.worker.settings.get("segment_size", 8 << 20)), fsync=durable)
        no = next(self._store_no)
        ds = self.stores[(vhost, exchange)] = self._by_no[no] = DelayStore(no, vhost, exchange, durable, store)
        heap = self._heap
        tag = no << _NO_SHIFT
        while (msg := store.shift()) is not None:
            heap.append(msg[2] << _DUE_SHIFT | tag | msg[0])
            ds.pending += 1
        heapq.heapify(heap)
        return ds

    def peer_up(self, index: int, restarted: bool) -> None:
        """SHARD_UP: with a new epoch the peer died (its new incarnation is starting); with the
        epoch we know it is ready, and gets again what it has not confirmed."""
        self._peers_up.add(index)
        if not restarted and self._forwards:
            worker = self.worker
            for fwd in self._forwards.values():
                item = fwd.items.get(index)
                if item is not None:
                    worker.forward(index, item)
        if not self._peers_ready:
            self._check_peers()
            if self._peers_ready and self._heap:
                self._fire(None)

    def _check_peers(self) -> None:
        shards = int(self.worker.settings.get("shards", 1))
        self._peers_ready = all(i in self._peers_up for i in range(shards) if i != self.worker.index)

    # --------------------------------------------------------------- publish
    def publish(self, fe: bytes, item: list) -> None:
        (_, vhost, exchange, routing_key, props_raw, body, persistent, delay, conn_id, channel, seq) = item
        worker = self.worker
        x = worker.defs.exchange(vhost, exchange)
        if x is None:
            # Deleted between the frontend's routing and now: as an unroutable message.
            worker.confirm_stored(fe, conn_id, channel, seq, None)
            return
        ds = self.stores.get((vhost, exchange))
        if ds is None:
            ds = self._open(vhost, exchange, x.durable)
        due = now_ms() + int(delay)
        store = ds.store
        msg_id = store.append(due, 1 if persistent else 0, exchange, routing_key, props_raw, body)
        store.shift()  # cursor past it: records are removed in due order, not append order
        ds.pending += 1
        heapq.heappush(self._heap, due << _DUE_SHIFT | ds.no << _NO_SHIFT | msg_id)
        self._arm(due)
        sync = store if persistent and ds.durable and worker.fsync else None
        worker.confirm_stored(fe, conn_id, channel, seq, sync)

    # ------------------------------------------------------------------ timer
    def _arm(self, due: int) -> None:
        if self._armed_at is None or due < self._armed_at:
            self._armed_at = due
            self.worker.timers.schedule(due, lambda: self._fire(due))

    def _fire(self, at: int | None) -> None:
        """Route every message that is due, in due order, in this loop turn."""
        if at is not None and at == self._armed_at:
            self._armed_at = None
        heap = self._heap
        worker = self.worker
        if not self._peers_ready or worker.stopping:
            return  # peer_up fires again once every peer is ready; a stopping shard routes nothing
        worker.fence_check()  # due now: routed as of now (broker/defs_fence.py); before the heap is read
        now = now_ms()
        done: dict[DelayStore, list[int]] = {}
        after_sync: dict[DelayStore, list[int]] = {}
        budget = _ROUTE_PER_TURN
        more = False
        limit = (now + 1) << _DUE_SHIFT  # keys below it are due
        by_no = self._by_no
        while heap and heap[0] < limit:
            budget -= 1
            if budget < 0:
                more = True
                break
            key = heapq.heappop(heap)
            ds = by_no.get((key >> _NO_SHIFT) & _NO_MASK)
            if ds is None:
                continue  # its exchange was deleted
            msg_id = key & _ID_MASK
            try:
                _ts, flags, exchange, routing_key, props, body = ds.store.read(msg_id)
            except KeyError:
                continue
            seq = next(self._forward_seq)
            refused: list[str] = []
            synced, sent = self._route(ds.vhost, flags, exchange, routing_key, props, body, seq, refused)
            if sent or refused:
                fwd = self._forwards[seq] = Forward(seq, ds, msg_id, sent, synced, refused)
                if synced:
                    worker.after_sync(lambda fwd=fwd: self._settle(fwd, None))
                if refused:
                    self._retry_later(fwd)
            else:
                (after_sync if synced else done).setdefault(ds, []).append(msg_id)
        for ds, ids in done.items():
            self._remove(ds, ids)
        for ds, ids in after_sync.items():
            worker.after_sync(lambda ds=ds, ids=ids: self._remove(ds, ids))
        if more:
            log.debug("shard %d: %d due delayed messages routed this turn, more follow", worker.index,
                      _ROUTE_PER_TURN)
            worker.loop.call_soon(self._fire, None)
        elif heap and (self._armed_at is None or heap[0] >> _DUE_SHIFT < self._armed_at):
            self._arm(heap[0] >> _DUE_SHIFT)

    def _route(self, vhost: str, flags: int, exchange: str, routing_key: str, props: bytes, body: bytes,
               seq: int, refused: list[str]) -> tuple[bool, dict[int, list]]:
        worker = self.worker
        route = worker.defs.route
        props, extra = _sender_routes(props)
        keys = [routing_key, *extra]
        if len(keys) == 1:
            names = route(vhost, exchange, routing_key, props)
        else:
            found: dict[str, None] = {}
            for key in keys:
                found.update(dict.fromkeys(route(vhost, exchange, key, props)))
            names = list(found)
        if not names:
            return False, {}  # unroutable when due: dropped (mandatory was not honoured at publish)
        return worker.route_to_queues(vhost, names, flags, exchange, routing_key, props, body, seq,
                                      refused=refused)

    def peer_confirmed(self, shard: int, seqs: list[int], ok: bool = True, refused: list[str] | None = None) -> None:
        """Another shard has stored (and synced, if it had to) forwarded due messages (ok), or answered
        CONFIRM_NACK: ``refused`` names its queues that did not take the message (the others did), to
        be tried again; a NACK naming none (stored, but not synced or not replicated to --min-isr
        followers; or dead-lettered by a reject-publish-dlx queue) settles it as a confirm would."""
        for seq in seqs:
            fwd = self._forwards.get(seq)
            if fwd is None:
                continue
            if refused:
                fwd.items.pop(shard, None)
                fwd.refused.extend(name for name in refused if name not in fwd.refused)
                self._retry_later(fwd)
                continue
            if not ok:
                log.warning("shard %d: a due delayed message of exchange %r in vhost %r was stored on shard %d "
                            "but not made durable there (sync failed or too few in-sync followers); not sent "
                            "again", self.worker.index, fwd.ds.exchange, fwd.ds.vhost, shard)
            self._settle(fwd, shard)

    def _retry_later(self, fwd: Forward) -> None:
        if fwd.retry_armed:
            return
        fwd.retry_armed = True
        delay = min(_RETRY_MS << min(fwd.attempts, 16), _RETRY_MAX_MS)
        fwd.attempts += 1
        self.worker.timers.schedule(now_ms() + delay, lambda: self._retry(fwd))

    def _retry(self, fwd: Forward) -> None:
        """Route a due message again to the queues that refused it (only those: the others have it)."""
        fwd.retry_armed = False
        worker = self.worker
        ds = fwd.ds
        if self._forwards.get(fwd.seq) is not fwd or worker.stopping:
            return  # settled, or stopping: the record stays, routed again after the restart
        if ds.deleted:
            del self._forwards[fwd.seq]
            return
        if not self._peers_ready:
            self._retry_later(fwd)
            return
        worker.fence_check()  # routed as of now (broker/defs_fence.py)
        try:
            _ts, flags, exchange, routing_key, props, body = ds.store.read(fwd.msg_id)
        except KeyError:
            del self._forwards[fwd.seq]
            return
        props, _extra = _sender_routes(props)  # the props its first routing sent (BCC removed)
        names, fwd.refused = fwd.refused, []
        synced, sent = worker.route_to_queues(ds.vhost, names, flags, exchange, routing_key, props, body, fwd.seq,
                                              refused=fwd.refused)
        fwd.items.update(sent)
        if synced:
            fwd.sync_pending = True
            worker.after_sync(lambda: self._settle(fwd, None))
        if fwd.refused:
            self._retry_later(fwd)
        else:
            self._finish(fwd)  # taken here (or its queues deleted): done once the answers are in

    def in_flight(self) -> int:
        """Forwarded due messages not confirmed yet, counted per target shard (a clean stop waits for
        them, shard/forward_settle.py: the record stays in the delay store until they are, and a record
        still there is routed again after the restart). What went to a shard that restarted counts too
        (it is sent again once that shard is ready); the wait is bounded."""
        return sum(len(fwd.items) for fwd in self._forwards.values())

    def _settle(self, fwd: Forward, shard: int | None) -> None:
        if shard is None:
            fwd.sync_pending = False
        else:
            fwd.items.pop(shard, None)
        self._finish(fwd)

    def _finish(self, fwd: Forward) -> None:
        """The record goes once every target has the message: answered, synced, none refusing it."""
        if (not fwd.items and not fwd.sync_pending and not fwd.refused
                and self._forwards.pop(fwd.seq, None) is not None):
            self._remove(fwd.ds, [fwd.msg_id])

    def _remove(self, ds: DelayStore, ids: list[int]) -> None:
        if ds.deleted:
            return
        store = ds.store
        for msg_id in ids:
            if store.ack(msg_id):
                ds.pending -= 1
        store.flush_acks()

    # ------------------------------------------------------------ definitions
    def exchange_deleted(self, vhost: str, exchange: str) -> None:
        ds = self.stores.pop((vhost, exchange), None)
        if ds is not None:
            self._drop([ds])

    def vhost_deleted(self, vhost: str) -> None:
        gone = [self.stores.pop(key) for key in [k for k in self.stores if k[0] == vhost]]
        if gone:
            self._drop(gone)

    def _drop(self, gone: list[DelayStore]) -> None:
        for ds in gone:
            ds.deleted = True
            del self._by_no[ds.no]
            self.worker.forget_store(ds.store)
            ds.store.delete()
        by_no = self._by_no
        self._heap = [k for k in self._heap if (k >> _NO_SHIFT) & _NO_MASK in by_no]
        heapq.heapify(self._heap)

    # -------------------------------------------------------------- durability
    def dirty_stores(self) -> list[QueueStore]:
        return [ds.store for ds in self.stores.values() if ds.store.dirty]

    def all_stores(self) -> list[QueueStore]:
        return [ds.store for ds in self.stores.values()]

    def info(self) -> dict:
        return {f"{v}/{x}": ds.pending for (v, x), ds in self.stores.items()}
