"""The cluster's state in etcd: this node's lease, its address record, the election, the ISR.

This is the only module that talks to etcd. Keys under ``<prefix>/``:

- ``nodes/<name>``: JSON address record of a live node (attached to its lease, so it disappears
  when the node dies);
- ``leader``: JSON address record of the leader, attached to the leader's lease. Created only by a
  transaction that checks it is absent and that the candidate is in the ISR (or that no ISR exists
  yet: the first boot of a cluster);
- ``isr``: JSON list of the node names in sync, not leased (it must outlive every node). Written
  only by the leader, in a transaction that compares the leader key's lease with the writer's: a
  deposed leader's write fails (fencing).

We build the election from a lease and a transaction rather than etcd3's ``Lock`` helper, which
leaks leases. The ``etcd3`` client is blocking (gRPC); every call runs on one worker thread and
the keep-alive on its own thread, so a slow etcd never blocks the node's event loop and a slow
call never delays a keep-alive.

Changes of the leader and ISR keys arrive through one etcd watch (:meth:`Coordinator.watch`), so a
follower waits for them instead of polling. It is our own small loop over etcd3's generated
``WatchStub`` rather than etcd3's ``Watcher``: that one re-opens a failed stream at once, forever
(a busy loop while etcd is down), and cannot be stopped.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

# etcd3 0.12's generated protobuf modules only load with the pure-Python protobuf runtime.
os.environ.setdefault("PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION", "python")
# The node forks its workers (uvloop's spawn: fork + exec) while etcd calls run in other threads.
# With gRPC's fork support on (its default), every fork runs gRPC's fork handlers, which skip
# their work while a call is in flight: the child's gRPC restarted its poller on the parent's
# state and could abort before its exec (a frontend died of SIGABRT), and the parent's connection
# to etcd was left broken: every later call, on new channels too, failed with INTERNAL "Received
# RST_STREAM with error code 1" until the leader fenced itself. A child that only execs needs none
# of it. Read once, when grpc is first imported (below).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import warnings  # noqa: E402

with warnings.catch_warnings():
    # Its generated modules use protobuf's deprecated descriptor API: noise in every node log.
    warnings.simplefilter("ignore", DeprecationWarning)
    import etcd3
    import grpc
    from etcd3 import etcdrpc
    from etcd3.transactions import BaseCompare

log = logging.getLogger("shardmq.coordination")

T = TypeVar("T")

# gRPC reconnects with an exponential back-off of up to two minutes by default: after an etcd
# restart the client would stay away that long (a LavinMQ user's "etcd restarts caused trouble").
# Keep-alive calls that may be outstanding at once (a slow one does not hold back the next).
_KEEPALIVE_IN_FLIGHT = 4

_GRPC_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
# A broken watch is opened again after this pause, doubled per failure up to the maximum (the
# coordinator polls meanwhile: see ``watching``).
_WATCH_RETRY_S = 0.1
_WATCH_RETRY_MAX_S = 1.0


class CoordinationError(Exception):
    """etcd could not be reached (on any endpoint) or answered with an error."""


@dataclasses.dataclass(frozen=True)
class NodeInfo:
    """How other nodes, proxies and tools reach a node."""

    name: str
    host: str
    amqp_port: int
    replication_port: int = 0
    http_port: int = 0
    # Other client listeners a follower proxies (e.g. {"mqtt": 1883}); added as they exist.
    listeners: dict[str, int] = dataclasses.field(default_factory=dict)
    # The node accepts a PROXY protocol header on its client ports (followers then send one).
    proxy_protocol: bool = False

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, raw: bytes | str) -> NodeInfo:
        data = json.loads(raw)
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


class _LeaseCompare(BaseCompare):
    """``lease(key) == id``: etcd3 0.12 has no helper for the LEASE compare target (etcd >= 3.3)."""

    def build_compare(self, compare: Any) -> None:
        compare.target = etcdrpc.Compare.LEASE
        compare.lease = int(self.value)


def parse_endpoint(text: str) -> tuple[str, int]:
    """``host:port`` (or a bare host, port 2379; ``http://`` is tolerated) -> (host, port)."""
    text = text.strip()
    for scheme in ("http://", "https://"):
        if text.startswith(scheme):
            text = text[len(scheme):]
    text = text.rstrip("/")
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        return text, 2379
    return host.strip("[]"), int(port)


class Coordinator:
    """One node's view of the cluster in etcd; every public coroutine runs its etcd calls off the loop.

    ``lease_age()`` is how long ago the lease was last renewed for sure; a leader must stop
    confirming once it exceeds half the TTL (the lease may expire at TTL and another node win).
    ``on_lease_lost`` is called on the loop when etcd says the lease is gone.
    """

    def __init__(self, endpoints: list[str], prefix: str, node_name: str, ttl: int,
                 on_lease_lost: Callable[[], None] | None = None) -> None:
        if not endpoints:
            raise ValueError("no etcd endpoints")
        self.endpoints = [parse_endpoint(e) for e in endpoints]
        self.prefix = "/" + prefix.strip("/")
        self.name = node_name
        self.ttl = ttl
        self.on_lease_lost = on_lease_lost
        # Short per-call deadline: a call that takes longer than a third of the lease is as good
        # as failed, and the next endpoint may answer.
        self.call_timeout = max(0.3, min(2.0, ttl / 3))
        self.lease_id: int | None = None
        self.renewed_at = 0.0  # monotonic time a successful keep-alive was SENT (conservative)
        self.leader_value: str | None = None  # our leader key's value while we hold it
        self._clients: list[etcd3.Etcd3Client | None] = [None] * len(self.endpoints)
        self._current = 0
        self._clients_lock = threading.Lock()
        self._keepalive_clients: list[etcd3.Etcd3Client | None] = [None] * len(self.endpoints)
        # A keep-alive may take up to TTL/2: it runs beside the next ones (never delaying them), and
        # one answered late still renews the lease from when it was sent. With the short deadline of
        # other calls, a loaded etcd answering in 0.4 s failed every keep-alive of a 1 s lease.
        self.keepalive_timeout = max(0.3, ttl / 2)
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="etcd")
        self._keepalive: threading.Thread | None = None
        self._keepalive_failing = False
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        # The watch (see watch()): True while its stream is open with every key watched.
        self.watching = False
        self._watch_thread: threading.Thread | None = None
        self._watch_call: Any = None  # the open Watch RPC, cancelled by stop()
        self._watch_lock = threading.Lock()

    # ------------------------------------------------------------------ keys
    def key(self, *parts: str) -> str:
        return "/".join((self.prefix, *parts))

    # ------------------------------------------------------------ plumbing
    def _client(self, keepalive: bool = False) -> etcd3.Etcd3Client:
        """The current endpoint's client; keep-alives have their own (own connection, longer deadline)."""
        i = self._current
        clients = self._keepalive_clients if keepalive else self._clients
        with self._clients_lock:  # the worker thread and the keep-alive calls share the endpoint
            if clients[i] is None:
                host, port = self.endpoints[i]
                timeout = self.keepalive_timeout if keepalive else self.call_timeout
                clients[i] = etcd3.client(host=host, port=port, timeout=timeout, grpc_options=_GRPC_OPTIONS)
            return clients[i]

    def _drop_client(self, keepalive: bool) -> None:
        """Forget the current endpoint's client after a failed call: the next call opens a new channel.

        A gRPC channel can stay broken (every call INTERNAL, seen once right after the node forked
        its workers) while etcd itself is fine; reusing it kept a node from ever renewing its lease.
        """
        clients = self._keepalive_clients if keepalive else self._clients
        with self._clients_lock:
            client, clients[self._current] = clients[self._current], None
        if client is not None:
            try:
                client.close()
            except Exception:  # closing a broken channel may fail too; it is dropped either way
                log.debug("closing an etcd client failed", exc_info=True)

    def _call(self, fn: Callable[[etcd3.Etcd3Client], T], keepalive: bool = False) -> T:
        """Run ``fn(client)``, moving on to the next endpoint when one fails (blocking)."""
        last: Exception | None = None
        for _ in range(len(self.endpoints)):
            try:
                return fn(self._client(keepalive))
            except (etcd3.Etcd3Exception, grpc.RpcError) as exc:
                last = exc
                host, port = self.endpoints[self._current]
                log.debug("etcd %s:%d: %s", host, port, _describe(exc))
                self._drop_client(keepalive)
                self._current = (self._current + 1) % len(self.endpoints)
        raise CoordinationError(f"etcd unreachable ({_describe(last)})") from last

    async def _run(self, fn: Callable[[etcd3.Etcd3Client], T]) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._call, fn)

    # ------------------------------------------------------------------ lease
    async def start(self, info: NodeInfo) -> None:
        """Grant this node's lease, start its keep-alive and publish the node's address record."""
        self._loop = asyncio.get_running_loop()
        if self._keepalive is None:
            # Started first: it idles while there is no lease, so a failed start can be retried.
            self._stop.clear()
            self._keepalive = threading.Thread(target=self._keepalive_loop, name="etcd-keepalive", daemon=True)
            self._keepalive.start()
        await self.new_lease()
        await self.register(info)

    async def new_lease(self) -> int:
        """Grant a fresh lease (at start, and after the old one was lost)."""
        sent = time.monotonic()
        lease = await self._run(lambda c: c.lease(self.ttl))
        self.lease_id = lease.id
        self.renewed_at = sent
        log.info("etcd lease %x granted (ttl %d s)", lease.id, self.ttl)
        return lease.id

    async def register(self, info: NodeInfo) -> None:
        lease_id = self.lease_id
        await self._run(lambda c: c.put(self.key("nodes", self.name), info.to_json(), lease=lease_id))

    def lease_age(self) -> float:
        return time.monotonic() - self.renewed_at

    def lease_fresh(self) -> bool:
        """Renewed within half the TTL: the lease cannot have expired, nobody else can lead."""
        return self.lease_id is not None and self.lease_age() < self.ttl / 2

    async def renew_now(self) -> bool:
        """One keep-alive now (besides the thread's): a full TTL/2 budget before heavy work."""
        lease_id = self.lease_id
        sent = time.monotonic()
        responses = await self._run(lambda c: list(c.refresh_lease(lease_id)))
        if responses and responses[-1].TTL > 0 and lease_id == self.lease_id:
            self.renewed_at = max(self.renewed_at, sent)
            return True
        return False

    @property
    def keepalive_interval(self) -> float:
        """How often a keep-alive is sent: TTL/10 (at least 100 ms, at most TTL/3).

        The lease counts as renewed from the moment a keep-alive that succeeded was *sent*, and a
        leader fences at TTL/2 without one; so the renewal age reaches interval + round trip before
        the next success. At TTL/3 a round trip over TTL/6 (170 ms with a 1 s lease: a gRPC call
        with the pure-Python protobuf runtime on a starved 2-core machine) fenced a healthy leader.
        At TTL/10, sent without waiting for the previous answer (up to ``_KEEPALIVE_IN_FLIGHT`` at
        once), a round trip of up to 0.4 TTL is absorbed. It costs etcd 10 small requests a second
        per node with a 1 s lease, one a second with the default 10 s.
        """
        return min(self.ttl / 3, max(0.1, self.ttl / 10))

    def _keepalive_loop(self) -> None:
        """Send a keep-alive every ``keepalive_interval`` from this thread; the calls run on a small
        pool of their own, so a slow or hung call never delays the next one (nor the event loop)."""
        boost_thread_priority()
        pool = concurrent.futures.ThreadPoolExecutor(
            _KEEPALIVE_IN_FLIGHT, thread_name_prefix="etcd-keepalive-call", initializer=boost_thread_priority)
        in_flight = threading.Semaphore(_KEEPALIVE_IN_FLIGHT)
        try:
            while not self._stop.is_set():
                lease_id = self.lease_id
                if lease_id is None:  # between a lost lease and the next one
                    self._stop.wait(0.05)
                    continue
                started = time.monotonic()
                if in_flight.acquire(blocking=False):  # else every slot waits for etcd: skip a beat
                    def call(lid: int = lease_id, sent: float = started) -> None:
                        try:
                            self._keepalive_once(lid, sent)
                        finally:
                            in_flight.release()
                    pool.submit(call)
                self._stop.wait(max(0.0, self.keepalive_interval - (time.monotonic() - started)))
        finally:
            pool.shutdown(wait=False)

    def _keepalive_once(self, lease_id: int, sent: float) -> None:
        try:
            responses = self._call(lambda c: list(c.refresh_lease(lease_id)), keepalive=True)
            ttl = responses[-1].TTL if responses else 0
            if ttl <= 0:
                if lease_id == self.lease_id and self._loop is not None:
                    log.warning("etcd lease %x is gone", lease_id)
                    self._loop.call_soon_threadsafe(self._lease_lost, lease_id)
                return
            if lease_id == self.lease_id:
                self.renewed_at = max(self.renewed_at, sent)
            if self._keepalive_failing:
                log.info("etcd keep-alive works again")
            self._keepalive_failing = False
        except CoordinationError as exc:
            if not self._keepalive_failing:  # once per outage: the next tries follow every interval
                log.warning("etcd keep-alive failed: %s", exc)
            self._keepalive_failing = True
        except Exception:  # a keep-alive that dies silently would fence the node forever
            log.exception("etcd keep-alive")

    def _lease_lost(self, lease_id: int) -> None:
        if lease_id == self.lease_id and self.on_lease_lost is not None:
            self.on_lease_lost()

    # ------------------------------------------------------------------ watch
    def watch(self, keys: list[str], on_change: Callable[[], None]) -> None:
        """Call ``on_change()`` on the loop whenever one of ``keys`` (names under the prefix, e.g.
        "leader") is written or deleted, and also each time the watch is (re)established or breaks:
        a change between the caller's last read and the watch's start is never missed, and the
        caller learns that it must poll (``watching`` is False) until the watch is back.

        The stream runs on its own thread with its own gRPC channel, opened by that thread (never
        one of the call clients, never shared with another thread or a child process).
        """
        if self._watch_thread is not None:
            return
        loop = asyncio.get_running_loop()
        self._watch_thread = threading.Thread(target=self._watch_loop, args=(loop, keys, on_change),
                                              name="etcd-watch", daemon=True)
        self._watch_thread.start()

    def _watch_loop(self, loop: asyncio.AbstractEventLoop, keys: list[str], on_change: Callable[[], None]) -> None:
        def notify() -> None:
            try:
                loop.call_soon_threadsafe(on_change)
            except RuntimeError:  # the loop is closed: the node is exiting
                pass

        retry = _WATCH_RETRY_S
        endpoint = 0
        failing = False  # logged once per outage, like the keep-alive
        while not self._stop.is_set():
            host, port = self.endpoints[endpoint]
            client = etcd3.client(host=host, port=port, grpc_options=_GRPC_OPTIONS)
            done = threading.Event()
            created = 0
            try:
                stub = etcdrpc.WatchStub(client.channel)
                call = stub.Watch(_watch_requests([self.key(k) for k in keys], done),
                                  credentials=client.call_credentials, metadata=client.metadata)
                with self._watch_lock:
                    self._watch_call = call
                if self._stop.is_set():
                    call.cancel()
                for resp in call:
                    if resp.canceled or resp.compact_revision:
                        raise CoordinationError(f"etcd cancelled the watch ({resp.cancel_reason or 'compacted'})")
                    if resp.created:
                        created += 1
                        if created == len(keys):
                            self.watching = True
                            retry = _WATCH_RETRY_S
                            if failing:
                                log.info("etcd watch open again")
                            failing = False
                            notify()
                    if resp.events:
                        notify()
            except (grpc.RpcError, CoordinationError, ValueError) as exc:
                if not self._stop.is_set() and not failing:
                    log.warning("etcd watch %s:%d ended (%s): polling the leader key until it is back",
                                host, port, _describe(exc) if isinstance(exc, grpc.RpcError) else exc)
                    failing = True
            finally:
                done.set()  # ends the request stream
                with self._watch_lock:
                    self._watch_call = None
                self.watching = False
                try:
                    client.close()
                except Exception:  # a broken channel may fail to close; it is dropped either way
                    log.debug("closing the etcd watch client failed", exc_info=True)
            if self._stop.is_set():
                return
            notify()  # the caller polls until the watch is back
            endpoint = (endpoint + 1) % len(self.endpoints)
            self._stop.wait(retry)
            retry = min(_WATCH_RETRY_MAX_S, retry * 2)

    def _stop_watch(self) -> None:
        with self._watch_lock:
            call = self._watch_call
        if call is not None:
            call.cancel()

    # -------------------------------------------------------------- reading
    async def leader(self) -> NodeInfo | None:
        raw, _meta = await self._run(lambda c: c.get(self.key("leader")))
        return NodeInfo.from_json(raw) if raw else None

    async def leader_lease(self) -> tuple[NodeInfo | None, int]:
        """The leader's record and the lease that holds it (0 when there is no leader)."""
        raw, meta = await self._run(lambda c: c.get(self.key("leader")))
        if not raw:
            return None, 0
        return NodeInfo.from_json(raw), meta.lease_id

    async def revoke(self, lease_id: int) -> None:
        """Revoke another lease: one of this node's previous incarnations, known dead."""
        await self._run(lambda c: c.revoke_lease(lease_id))

    async def isr(self) -> list[str] | None:
        """The ISR as stored, or None when no leader ever wrote one (a new cluster)."""
        raw, _meta = await self._run(lambda c: c.get(self.key("isr")))
        return json.loads(raw) if raw else None

    async def nodes(self) -> dict[str, NodeInfo]:
        base = self.key("nodes") + "/"
        items = await self._run(lambda c: list(c.get_prefix(base)))
        out = {}
        for raw, meta in items:
            name = meta.key.decode()[len(base):]
            try:
                out[name] = NodeInfo.from_json(raw)
            except (ValueError, TypeError):
                log.warning("ignoring malformed node record %s", name)
        return out

    # ------------------------------------------------------------- election
    async def campaign(self, info: NodeInfo) -> bool:
        """Try once to become leader; True when this node now holds ``<prefix>/leader``.

        Succeeds only if the leader key is absent and this node is in the ISR, or no ISR exists
        (then the new ISR is this node alone). The ISR is compared by revision, so a concurrent
        ISR write makes the attempt fail rather than win on a stale read.
        """
        lease_id = self.lease_id
        value = info.to_json()

        def attempt(c: etcd3.Etcd3Client) -> bool:
            raw, meta = c.get(self.key("isr"))
            t = c.transactions
            compare = [t.create(self.key("leader")) == 0]
            success = [t.put(self.key("leader"), value, lease=lease_id)]
            if raw is None:
                compare.append(t.version(self.key("isr")) == 0)
                success.append(t.put(self.key("isr"), json.dumps([self.name])))
            elif self.name in json.loads(raw):
                compare.append(t.mod(self.key("isr")) == meta.mod_revision)
            else:
                return False
            ok, _ = c.transaction(compare=compare, success=success, failure=[])
            return ok

        won = await self._run(attempt)
        if won:
            self.leader_value = value
            log.info("won the election: %s is leader", self.name)
        return won

    async def write_isr(self, names: list[str]) -> bool:
        """Store the ISR; only while our lease holds the leader key. False = we are not leader."""
        lease_id = self.lease_id
        names = sorted(set(names) | {self.name})

        def attempt(c: etcd3.Etcd3Client) -> bool:
            t = c.transactions
            ok, _ = c.transaction(
                compare=[_LeaseCompare(self.key("leader")) == lease_id, t.version(self.key("leader")) > 0],
                success=[t.put(self.key("isr"), json.dumps(names))], failure=[])
            return ok

        return await self._run(attempt)

    async def still_leader(self) -> bool:
        """Our lease still holds the leader key (a read, for the leader's periodic check)."""
        def check(c: etcd3.Etcd3Client) -> bool:
            t = c.transactions
            ok, _ = c.transaction(
                compare=[_LeaseCompare(self.key("leader")) == self.lease_id,
                         t.version(self.key("leader")) > 0], success=[], failure=[])
            return ok

        return await self._run(check)

    async def resign(self) -> None:
        """Give up leadership at once: delete the leader key if it is still ours."""
        lease_id = self.lease_id
        self.leader_value = None

        def attempt(c: etcd3.Etcd3Client) -> None:
            t = c.transactions
            c.transaction(compare=[_LeaseCompare(self.key("leader")) == lease_id],
                          success=[t.delete(self.key("leader"))], failure=[])

        await self._run(attempt)

    async def abandon_lease(self) -> None:
        """Drop the current lease (revoked when etcd answers) and grant a new one.

        After a fence the old lease may still hold the leader key; revoking it deletes the key
        so the election can proceed without waiting for the TTL.
        """
        old = self.lease_id
        self.lease_id = None
        self.leader_value = None
        if old is not None:
            try:
                await self._run(lambda c: c.revoke_lease(old))
            except CoordinationError as exc:
                log.warning("could not revoke lease %x: %s", old, exc)
        await self.new_lease()

    async def stop(self) -> None:
        """Revoke the lease (our keys vanish, so a follower takes over at once) and close."""
        self._stop.set()
        lease_id, self.lease_id = self.lease_id, None
        if lease_id is not None:
            try:
                await self._run(lambda c: c.revoke_lease(lease_id))
                log.info("etcd lease %x revoked", lease_id)
            except CoordinationError as exc:
                log.warning("could not revoke the etcd lease (it expires in %d s): %s", self.ttl, exc)
        self._stop_watch()
        if self._keepalive is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._keepalive.join, 5.0)
        if self._watch_thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._watch_thread.join, 5.0)
        for c in self._clients + self._keepalive_clients:
            if c is not None:
                c.close()
        self._executor.shutdown(wait=False)


def _watch_requests(keys: list[str], done: threading.Event) -> Iterator[Any]:
    """The Watch RPC's request stream: one create request per key, then open until ``done``."""
    for key in keys:
        yield etcdrpc.WatchRequest(create_request=etcdrpc.WatchCreateRequest(key=key.encode()))
    done.wait()


def boost_thread_priority(nice: int = -10) -> bool:
    """Give the calling thread a higher CPU share (Linux: threads have their own nice value).

    The lease keep-alive and the fence watchdog must run on time even when the node's own workers
    (and everything else on the host) keep the CPUs busy: a starved keep-alive means a needless
    failover. Needs CAP_SYS_NICE (root, or ``AmbientCapabilities=CAP_SYS_NICE`` in the systemd
    unit); without it the thread keeps the default priority.
    """
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        return True
    except (PermissionError, OSError, AttributeError):
        return False


def _describe(exc: BaseException | None) -> str:
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        return f"{exc.code().name}: {exc.details()}"
    # etcd3 raises its own exception (no text) inside the handler of the gRPC error that says why
    cause = exc.__context__ if exc is not None else None
    if isinstance(cause, grpc.RpcError) and hasattr(cause, "code"):
        return f"{type(exc).__name__}, {cause.code().name}: {cause.details()}"
    return str(exc) or type(exc).__name__
