"""Deduplication caches in the shard: per queue (FeatureQueue) and per exchange (owner shard).

Queue deduplication: a ``FeatureQueue`` with ``x-message-deduplication`` holds a
``QueueDedup``; its publish drops a message whose key is in the cache (the publisher
still gets its confirm, after the same group sync an enqueued message would wait for).
Every way into the queue (frontend publishes, dead letters of this shard or of other
shards, forwards of a deduplicating exchange) goes through that publish.

Exchange deduplication: a publisher that reconnects may land on another frontend, so the
check is made in ONE place per exchange: the shard ``exchange_shard(vhost, name)``
(broker/dedup.py). The frontend routes as usual and sends one ``DEDUP_PUBLISH`` to that
owner. The owner (``ExchangeDedup``) drops duplicates and forwards the rest as ordinary
``PUBLISH`` items to every shard holding a routed queue - itself included, over a DEALER
connected to its own ROUTER, so its own queues run the same code and answer the same way.
Each forward carries a token as its confirm seq; the shards answer ``CONFIRM`` /
``CONFIRM_NACK`` to the owner's identity, and the owner confirms the publisher once all of
them have (so only after every append is written, and fsynced when it must be).

A duplicate that arrives while the original is still unconfirmed waits for it and gets the
same answer; an original that ends in a nack leaves the cache again, so a retry is accepted.
The caches live in memory (as LavinMQ's): a restart of the shard forgets them. So a clean stop
waits for the forwards in flight (``in_flight``, shard/forward_settle.py) before the owner closes:
a dead letter's source that got no answer would send it again after the restart, and the empty
cache would let it through twice.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Protocol

from broker import contract, data_sockets
from broker.dedup import DEFAULT_CACHE_SIZE, DedupSettings, dedup_key, exchange_shard

if TYPE_CHECKING:
    import asyncio
    from collections.abc import Callable

    from broker.definitions import Definitions
    from shard.dead_letter_forwards import DeadLetterForwards

_MISSING = object()


def _now_ms() -> int:
    return int(time.monotonic() * 1000)  # entries live in memory only: a monotonic clock is enough


class DedupCache:
    """At most ``size`` keys, oldest inserted evicted first; expired entries go when looked up."""

    __slots__ = ("size", "_store")

    def __init__(self, size: int = DEFAULT_CACHE_SIZE) -> None:
        self.size = size
        self._store: OrderedDict[Any, int | None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._store)

    def contains(self, key: Any, now: int) -> bool:
        deadline = self._store.get(key, _MISSING)
        if deadline is _MISSING:
            return False
        if deadline is None or deadline > now:
            return True
        del self._store[key]
        return False

    def insert(self, key: Any, ttl: int | None, now: int) -> None:
        store = self._store
        store.pop(key, None)
        while len(store) >= self.size:
            store.popitem(last=False)
        store[key] = None if ttl is None else now + ttl

    def discard(self, key: Any) -> None:
        self._store.pop(key, None)


class QueueDedup:
    """The deduplication state of one queue."""

    __slots__ = ("settings", "cache")

    def __init__(self, settings: DedupSettings) -> None:
        self.settings = settings
        self.cache = DedupCache(settings.size)

    def configure(self, settings: DedupSettings) -> None:
        """New arguments (a policy change re-reads them): the remembered keys stay."""
        self.settings = settings
        self.cache.size = settings.size

    def check(self, props_raw: bytes) -> tuple[Any, int | None, int] | None:
        """None when the message is a duplicate, else (key or None, ttl, now) for ``remember``."""
        key, ttl = dedup_key(props_raw, self.settings)
        now = _now_ms()
        if key is not None and self.cache.contains(key, now):
            return None
        return key, ttl, now

    def remember(self, found: tuple[Any, int | None, int]) -> None:
        key, ttl, now = found
        if key is not None:
            self.cache.insert(key, ttl, now)


class _Pending:
    """A forwarded exchange publish waiting for the shards it went to."""

    __slots__ = ("fe", "conn_id", "channel", "seq", "cache_key", "shards", "groups", "ok", "missing", "unsynced",
                 "waiters")

    def __init__(self, fe: bytes, conn_id: Any, channel: Any, seq: Any, cache_key: tuple | None,
                 shards: set[int], groups: list) -> None:
        self.fe = fe
        self.conn_id = conn_id
        self.channel = channel
        self.seq = seq
        self.cache_key = cache_key  # (vhost, exchange, key) while the key is in flight
        self.shards = shards
        self.groups = groups  # the DEDUP_PUBLISH's [[shard, [queue, ...]], ...] (names of a shard that failed)
        self.ok = True
        # After a NACK: the routed queues that may not hold the message (a target that restarted or was
        # never reached: all of its queues; one that refused it: those it named), and whether a target
        # stored it without making it durable as asked (NACK naming no queue: ISR below --min-isr).
        self.missing: list[str] | tuple[()] = ()
        self.unsynced = False
        self.waiters: list[tuple[bytes, Any, Any, Any]] = []  # duplicates that arrived meanwhile


class DedupShard(Protocol):
    """What the exchange caches use of the shard that owns them (shard/worker.py ShardWorker)."""

    index: int
    ident: bytes
    run_dir: str
    epoch: int
    settings: dict
    loop: asyncio.AbstractEventLoop
    defs: Definitions | None
    data: Any  # its data socket: put(identity, item)
    peers: dict[int, Any]  # the DEALER to each other shard
    peers_closed: bool  # a clean stop told them nothing more comes
    dead_letters: DeadLetterForwards

    def on_peer_answers(self, shard: int) -> Callable[[bytes | None, object, list], None]: ...


class ExchangeDedup:
    """The caches of the deduplicating exchanges this shard owns, and their forwards."""

    def __init__(self, worker: DedupShard) -> None:
        self.worker = worker
        # (vhost, exchange) -> (the Exchange definition it was made for, cache): a redeclared
        # exchange is a new object and starts with an empty cache, as in LavinMQ.
        self.caches: dict[tuple[str, str], tuple[Any, DedupCache]] = {}
        self.pending: dict[int, _Pending] = {}
        self.inflight: dict[tuple, _Pending] = {}
        self._token = 0
        self._self_socket: Any = None  # a data_sockets connection to our own data socket
        self._self_seq = 0

    # ------------------------------------------------------------------ publish
    def publish(self, fe: bytes, item: list) -> None:
        """[DEDUP_PUBLISH, ...] from a frontend (field list in broker/contract.py)."""
        (_, vhost, exchange, routing_key, props_raw, body, persistent, conn_id, channel, seq,
         key, ttl, groups, return_to) = item
        cache_key = None
        if key is not None:
            cache = self._cache(vhost, exchange)
            if cache is not None:
                now = _now_ms()
                cache_key = (vhost, exchange, key)
                if cache.contains(key, now):
                    if return_to is not None:  # mandatory: a duplicate routes nowhere (before its confirm)
                        self.worker.data.put(fe, [contract.RETURN, return_to[0], return_to[1], 312, "NO_ROUTE",
                                                  exchange, routing_key, props_raw, body])
                    if seq is not None:
                        original = self.inflight.get(cache_key)
                        if original is not None:
                            original.waiters.append((fe, conn_id, channel, seq))
                        else:
                            self._answer(fe, conn_id, channel, seq, True)
                    return
                cache.insert(key, ttl, now)
        if not groups:  # unroutable: the key is remembered (as RabbitMQ's plugin does), nothing to forward
            if seq is not None:
                self._answer(fe, conn_id, channel, seq, True)
            return
        token = None
        if seq is not None or cache_key is not None:
            self._token += 1
            token = self._token
            pending = _Pending(fe, conn_id, channel, seq, cache_key, {int(s) for s, _ in groups}, groups)
            self.pending[token] = pending
            if cache_key is not None:
                self.inflight[cache_key] = pending
        for shard, names in groups:
            sock = self.socket_to(int(shard))
            if sock is None:
                if token is not None:
                    self._settle(token, int(shard), False, names)  # never sent: none of its queues has it
                continue
            # conn_id our epoch, channel PEER_CHANNEL_DEDUP, seq the token: the shard answers CONFIRM
            # [epoch, 0, [token]] to us (an answer for an earlier life is dropped: shard/forward_lives.py).
            sock.put(None, [contract.PUBLISH, vhost, names, exchange, routing_key, props_raw, body, persistent,
                            None if token is None else self.worker.epoch,
                            None if token is None else contract.PEER_CHANNEL_DEDUP, token])

    def dead_letter(self, x: Any, vhost: str, routing_key: str, props_raw: bytes, body: bytes, persistent: bool,
                    queues: list[str]) -> None:
        """A message dead-lettered to deduplicating exchange `x`: to its owner (this shard too, over
        the DEALER to our own ROUTER), kept in the outbox until the owner confirms it as it confirms a
        publisher (shard/dead_letter_forwards.py)."""
        if not queues:
            return
        worker = self.worker
        groups: dict[int, list[str]] = {}
        for name in queues:
            defn = worker.defs.queue(vhost, name)
            if defn is not None:
                groups.setdefault(defn.shard, []).append(name)
        key, ttl = dedup_key(props_raw, x.dedup)
        # conn_id (our epoch) and seq (the outbox record's id) are set by the outbox; channel PEER_CHANNEL_DLX.
        item = [contract.DEDUP_PUBLISH, vhost, x.name, routing_key, props_raw, body, persistent, None,
                contract.PEER_CHANNEL_DLX, None, key, ttl, [[shard, names] for shard, names in groups.items()], None]
        owner = exchange_shard(vhost, x.name, int(worker.settings.get("shards", 1)))
        worker.dead_letters.send({owner: item}, persistent)

    def _cache(self, vhost: str, exchange: str) -> DedupCache | None:
        x = self.worker.defs.exchange(vhost, exchange)
        settings = getattr(x, "dedup", None)
        if settings is None:
            self.caches.pop((vhost, exchange), None)
            return None  # deleted (or redeclared without dedup) since the frontend routed it
        found = self.caches.get((vhost, exchange))
        if found is not None and found[0] is x:
            found[1].size = settings.size
            return found[1]
        # A new cache is rare (a declare): drop those of exchanges deleted or redeclared since.
        defs = self.worker.defs
        for (v, name), (old, _c) in list(self.caches.items()):
            if defs.exchange(v, name) is not old:
                del self.caches[(v, name)]
        cache = DedupCache(settings.size)
        self.caches[(vhost, exchange)] = (x, cache)
        return cache

    def socket_to(self, shard: int) -> Any:
        """The DEALER to `shard`'s ROUTER: a peer's, or ours connected to our own ROUTER. None for a
        peer once we told the peers we are done (a clean stop, ShardWorker._say_peers_done)."""
        worker = self.worker
        if shard != worker.index:
            return None if worker.peers_closed else worker.peers.get(shard)
        if self._self_socket is None:
            self._self_socket = data_sockets.shard_connection(worker.loop, worker.run_dir, worker.index, worker.ident,
                                                              worker.on_peer_answers(worker.index), self._self_header)
        return self._self_socket

    def self_batches(self) -> int:
        """Batches sent so far to our own ROUTER (forward back-pressure, ShardWorker.forwards_behind)."""
        return self._self_seq

    def _self_header(self, _dest: bytes | None) -> list:
        self._self_seq += 1
        return [self.worker.epoch, self._self_seq]

    # ------------------------------------------------------------------ answers
    def peer_confirmed(self, shard: int, tokens: list[int], ok: bool, refused: list[str] | None = None) -> None:
        """`shard`'s CONFIRM (ok) or CONFIRM_NACK for forwarded publishes (ShardWorker.on_peer_answers).
        A NACK's ``refused`` (contract VERSION 26) names the queues that did not store it; without it
        the shard stored it but did not make it durable as asked (its sync failed, or the ISR is short
        of --min-isr): every routed queue of that shard holds it."""
        for token in tokens:
            self._settle(token, shard, ok, refused)

    def in_flight(self) -> int:
        """Forwards not answered yet, counted per target shard. A clean stop waits for them
        (shard/forward_settle.py): the answer owed to a dead letter's source shard depends on them,
        and a source without it sends the dead letter again after the restart, when our cache is empty."""
        return sum(len(p.shards) for p in self.pending.values())

    def shard_up(self, shard: int) -> None:
        """`shard` restarted: what it had not confirmed is lost, so those publishes are nacked."""
        for token in [t for t, p in self.pending.items() if shard in p.shards]:
            p = self.pending[token]
            self._settle(token, shard, False, [n for s, names in p.groups if int(s) == shard for n in names])

    def _settle(self, token: int, shard: int, ok: bool, missing: list[str] | None = None) -> None:
        """`shard` answered (ok) or failed the forward `token`; ``missing`` (a failure only): its queues
        that may not hold the message, None when all of them do (stored, not durable as asked)."""
        p = self.pending.get(token)
        if p is None or shard not in p.shards:
            return
        p.shards.discard(shard)
        if not ok:
            p.ok = False
            if missing is None:
                p.unsynced = True
            elif missing:
                p.missing = [*p.missing, *missing]
        if p.shards:
            return
        del self.pending[token]
        if p.cache_key is not None:
            if self.inflight.get(p.cache_key) is p:
                del self.inflight[p.cache_key]
            if not p.ok:
                # Not stored everywhere: a retry of this message must not be dropped as a duplicate.
                found = self.caches.get(p.cache_key[:2])
                if found is not None:
                    found[1].discard(p.cache_key[2])
        # A NACK says what a publish's NACK says (contract CONFIRM_NACK): which routed queues may not hold
        # the message (a dead letter's source sends it again to those only), none ([]), or, without
        # ``refused``, that every one holds it but not durably as asked. A bare NACK used to mean "maybe
        # not stored" too, so a dead letter's source sent it again each second of an ISR outage: a copy
        # more in each target queue per second (tests/test_replication_dlx_dedup.py).
        refused = None if p.ok or (p.unsynced and not p.missing) else list(p.missing)
        if p.seq is not None:
            self._answer(p.fe, p.conn_id, p.channel, p.seq, p.ok, refused)
        for fe, conn_id, channel, seq in p.waiters:
            self._answer(fe, conn_id, channel, seq, p.ok, refused)

    def _answer(self, fe: bytes, conn_id: Any, channel: Any, seq: int, ok: bool,
                refused: list[str] | None = None) -> None:
        # BatchSocket.put gathers items per destination and sends once per loop turn.
        if ok:
            self.worker.data.put(fe, [contract.CONFIRM, conn_id, channel, [seq]])
        elif refused is None or channel != contract.PEER_CHANNEL_DLX:  # a publisher's frontend: a nack is a nack
            self.worker.data.put(fe, [contract.CONFIRM_NACK, conn_id, channel, [seq]])
        else:
            self.worker.data.put(fe, [contract.CONFIRM_NACK, conn_id, channel, [seq], refused])

    def close(self) -> None:
        if self._self_socket is not None:
            self._self_socket.close()
            self._self_socket = None
