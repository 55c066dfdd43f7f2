"""The data plane between the frontend and the shard of one paired process (``--colocate``).

A paired worker process (``shard/pair_main.py``) runs frontend K and shard K on one event loop.
Between those two, a batch needs no socket: the end that flushes it hands the batch to the other
end's ``on_batch`` on the same loop, at once or through ``loop.call_soon`` (below): no ``write``,
no ``read``, no wake-up of another process (each of those cost ~22 us on a halted vCPU plus ~8 us in the
sender's ``send``: docs/benchmarks.md, "What would close the gap").

What stays as with sockets (the workers cannot tell): the per-turn batching of ``TurnBatcher``
(one batch per destination per loop turn, a full one at once), ``on_sent`` (the frontend's bytes
in flight, from the items' sizes: ``_size``), ``on_drained`` after each batch handed over (a
worker sends what it produced then, as after a read), the stage trace, and FIFO order per link
(one lane, one direction: what a socket keeps; the shard orders a publish lane's batches after the
control lane's items they need by itself, as it must with sockets).

When a batch is handed over (issue #15, a lone message's latency): at once, the receiver's
``on_batch`` and ``on_drained`` running inside the sender's send, when the sender sends from a point
where it is done with what it was doing (the shard's ``send_pending`` when a read's batches are
handled, either end's turn ``flush``), no batch of that link is still queued (FIFO), and fewer than
``MAX_DEPTH`` such hand-overs are under way (a DELIVER goes to the frontend and its client at once;
what the frontend sends while handling it waits). Otherwise, as before, from ``loop.call_soon``: a
full batch cut in the middle of a ``put`` (the sender is inside its own work), ``send_now``, packed
batches, and the frontend's ``send_pending`` at the end of one client read (``send_early``): were
that at once, the shard would never look busy to the next reads of the same loop iteration, and
their publishes would go a batch per read instead of one per turn (4 publishers: +13 % CPU per
message). An exception in the receiver is reported to the loop's exception handler, as from a
callback, and does not reach the sender. What it saves is a loop iteration on a lone message's path
(docs/benchmarks.md, "A lone message in a pair").

Every other peer (other frontends, other shards' forwards, the
shard's own deduplicating-exchange socket) still goes through the real socket: the shard's listener
is a ``PairedRouter`` that sends a batch in-process only when its destination is the paired
frontend's publish or control lane.

What differs: the batch's item lists are handed over as they are, not packed and unpacked (that
cost ~9 us of a message's CPU at 1,000 msg/s, issue #15), for the kinds of the hot path only
(``DIRECT_KINDS``). That is safe because of what their senders and receivers do, checked kind by
kind (docs/architecture.md "Paired processes"): every such item is a fresh list, built for that
put and never touched by its sender again; its leaves are what unpacking would give (lists, never
tuples; ``bytes`` bodies and properties, never a ``bytearray`` or a ``memoryview`` of a read
buffer: the AMQP parser slices ``bytes``, the MQTT one copies, the shard's store slices its mmap);
the lists inside (a PUBLISH's queue names, which MQTT's routing plan shares between publishes;
an ACK's refs, a CONFIRM's seqs) are only read by the receivers. Every other kind (replies holding
a shard's KV values, GET results, definitions-sized answers: rare, and not audited) gets a copy
packed and unpacked per item, exactly as before. With ``SHARDMQ_TEST_LINK_CHECK=1``
(tests/harness.py sets it on every test node) each batch is also packed: what is handed over must
equal its unpacking, type for type, at the put's flush, at the handover and a while after the
receiver handled it (nothing mutated it); a difference logs ``LINK_CHECK_FAILED`` and
tests/conftest.py fails the test.

The registry is per process: ``enable(index)`` is called once by ``shard/pair_main.py`` before
either worker starts; a process that did not call it (a single-role worker) never sees a link.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from typing import Any

import msgpack

from broker import contract, gc_pause
from broker.turn_batch import OnBatch, TurnBatcher

_BULK_BATCH = 1 << 20  # as broker/unixio.py: a batch this big is decoded with the cyclic GC paused

# Handed over as they are (module docstring): frontend -> shard, then shard -> frontend.
DIRECT_KINDS = frozenset((contract.PUBLISH, contract.PUBLISH_RUN, contract.ACK, contract.CREDIT,
                          contract.DELIVER, contract.CONFIRM, contract.CONFIRM_NACK, contract.PROCESSED))
_PUBLISH = contract.PUBLISH
_PUBLISH_RUN = contract.PUBLISH_RUN
_TO_SHARD, _TO_FRONTEND = 0, 1  # a link's two ways (LocalDealer.queued)
_ITEM_OVERHEAD = 48  # on_sent's bytes of an item beyond its bodies and properties (~ its packed fields)

LINK_CHECK_ENV = "SHARDMQ_TEST_LINK_CHECK"
LINK_CHECK_FAILED = "link check failed"  # the log line's start (tests/conftest.py looks for it)
_CHECK = os.environ.get(LINK_CHECK_ENV) == "1"
_RECHECK_S = 0.2  # the check's last look: this long after the receiver handled the batch
MAX_DEPTH = 2  # hand-overs at once nested at most this deep (module docstring)

log = logging.getLogger("shardmq.link")

_paired: int | None = None  # the index of this process's pair, if it is one
_router: Any = None  # the paired shard's listener, once it is bound
_safe: Any = None  # the batcher inside its _send_pending: what it sends may be handed over at once
_depth = 0  # hand-overs at once under way (nested)


def enable(index: int) -> None:
    """This process runs frontend ``index`` and shard ``index`` (shard/pair_main.py)."""
    global _paired
    _paired = index


def paired_index() -> int | None:
    return _paired


def local_identities(index: int) -> tuple[bytes, bytes]:
    """The identities the paired frontend's two lanes to shard ``index`` connect with."""
    fe = contract.worker_id("frontend", index)
    return fe, fe + contract.CONTROL_LANE_SUFFIX


def _copy(item: list) -> tuple[list, int]:
    """An item of a kind not handed over as is: packed and unpacked, as a socket would; its size."""
    data = msgpack.packb(item, use_bin_type=True)
    if len(data) >= _BULK_BATCH:
        with gc_pause.paused():
            return msgpack.unpackb(data, raw=False, strict_map_key=False, use_list=True), len(data)
    return msgpack.unpackb(data, raw=False, strict_map_key=False, use_list=True), len(data)


def _own(items: list) -> int:
    """Make ``items`` the receiver's (copies of the kinds not in DIRECT_KINDS, in place); the batch's
    size as on_sent counts it: bodies and properties plus a little per item (the packed size of a copy)."""
    size = _ITEM_OVERHEAD * len(items)  # each direct item's; a copy's is its packed size instead
    direct = DIRECT_KINDS
    i = 0
    for item in items:  # no enumerate: a copy (the rare case) is the only one that needs the index
        kind = item[0]
        if kind == _PUBLISH:
            size += len(item[5]) + len(item[6])
        elif kind not in direct:
            items[i], n = _copy(item)
            size += n - _ITEM_OVERHEAD
        elif kind == _PUBLISH_RUN:
            bodies = item[6]
            size += sum(map(len, bodies)) + len(item[5]) + 6 * len(bodies)
        i += 1
    return size


def _hand_over(sender: TurnBatcher, target: TurnBatcher, ident: bytes | None, header: Any, items: list,
               queued: list[int], way: int) -> None:
    """Send one batch to ``target`` in-process (the sender's ``_send_items``): at once or from
    call_soon (module docstring). ``queued[way]`` counts this link's batches waiting in call_soon."""
    global _safe, _depth
    size = _own(items)
    if sender.on_sent is not None:
        sender.on_sent(size)
    if _safe is sender and _depth < MAX_DEPTH and not queued[way]:
        _safe = None  # the receiver's own sends are at once only from its own send_pending/flush
        _depth += 1
        try:
            if _CHECK:
                _receive_checked(target, ident, header, items, _packed_same(header, items), None, way)
            else:
                _receive_items(target, ident, header, items, None, way)
        except Exception as exc:  # as the loop would report a callback's: the sender goes on
            sender.loop.call_exception_handler({"message": "paired link: receiving a batch failed",
                                                "exception": exc})
        finally:
            _depth -= 1
            _safe = sender
        return
    queued[way] += 1
    if _CHECK:
        sender.loop.call_soon(_receive_checked, target, ident, header, items, _packed_same(header, items),
                              queued, way)
    else:
        sender.loop.call_soon(_receive_items, target, ident, header, items, queued, way)


def _send_pending_safe(batcher: TurnBatcher, send_pending: Callable[[], None]) -> None:
    """``batcher``'s ``_send_pending`` (its send_pending and its turn's flush) with its hand-overs
    allowed at once: the worker that calls either is done with what it was doing."""
    global _safe
    outer = _safe
    _safe = batcher
    try:
        send_pending()
    finally:
        _safe = outer


def _receive_items(target: TurnBatcher, ident: bytes | None, header: Any, items: list,
                   queued: list[int] | None = None, way: int = 0) -> None:
    """Hand one batch's items to ``target``'s on_batch, as a socket's read would (at once, or from
    call_soon: then ``queued[way]`` counted it)."""
    if queued is not None:
        queued[way] -= 1
    if target._closed:
        return  # the end stopped (a pair's stop: frontend first): what was in flight is dropped
    if target._trace is not None:
        target._trace.batch(target._trace_in, items, target._trace_keep)
    target.on_batch(ident, header, items)
    on_drained = target.on_drained
    if on_drained is not None and not target._closed:
        on_drained()


# ----------------------------------------------------------------------------- test-mode check
def _same(a: Any, b: Any) -> bool:
    """Equal and of the same types all the way down (a tuple is not a list, a bytearray not bytes)."""
    if a.__class__ is not b.__class__:
        return False
    if a.__class__ is list:
        return len(a) == len(b) and all(map(_same, a, b))
    if a.__class__ is dict:  # msgpack keeps a map's order
        return len(a) == len(b) and all(_same(k, k2) and _same(v, b[k2])
                                        for (k, v), k2 in zip(a.items(), b, strict=True))
    return a == b or (a != a and b != b)  # NaN


def _packed_same(header: Any, items: list) -> bytes | None:
    """The batch packed, after checking that unpacking it gives back what is handed over."""
    try:
        payload = contract.pack(header, items)
    except Exception as exc:  # a leaf msgpack cannot pack: a socket could not have carried it
        log.error(LINK_CHECK_FAILED + ": a batch does not pack: %r", exc)
        return None
    got_header, got = contract.unpack(payload)
    if not _same(header, got_header):
        log.error(LINK_CHECK_FAILED + ": header %r unpacks as %r", header, got_header)
    for item, unpacked in zip(items, got, strict=True):
        if not _same(item, unpacked):
            log.error(LINK_CHECK_FAILED + ": item %r unpacks as %r", _short(item), _short(unpacked))
    return payload


def _short(item: Any) -> str:
    text = repr(item)
    return text if len(text) < 400 else text[:400] + "..."


def _receive_checked(target: TurnBatcher, ident: bytes | None, header: Any, items: list,
                     payload: bytes | None, queued: list[int] | None = None, way: int = 0) -> None:
    if payload is not None and contract.pack(header, items) != payload:
        log.error(LINK_CHECK_FAILED + ": a batch changed between its flush and its handover: %s", _short(items))
        payload = None
    # The items handed over as they are (the copies are the receiver's alone, to change as it likes).
    direct = [item for item in items if item[0] in DIRECT_KINDS]
    before = contract.pack(0, direct) if payload is not None and direct else None
    _receive_items(target, ident, header, items, queued, way)
    if before is not None:
        target.loop.call_later(_RECHECK_S, _recheck, direct, before)


def _recheck(direct: list, packed: bytes) -> None:
    if contract.pack(0, direct) != packed:
        log.error(LINK_CHECK_FAILED + ": an item changed after it was handed over (its sender kept and changed "
                  "it, or its receiver changed something its sender keeps): %s", _short(direct))


def _receive(target: TurnBatcher, ident: bytes | None, payload: bytes, queued: list[int], way: int) -> None:
    """Hand one packed batch to ``target``'s on_batch, as a socket's read would (runs from call_soon)."""
    queued[way] -= 1
    if target._closed:
        return  # the end stopped (a pair's stop: frontend first): what was in flight is dropped
    try:
        if len(payload) >= _BULK_BATCH:
            with gc_pause.paused():
                header, items = contract.unpack(payload)
        else:
            header, items = contract.unpack(payload)
    except ValueError:
        return
    if target._trace is not None:
        target._trace.batch(target._trace_in, items, target._trace_keep)
    target.on_batch(ident, header, items)
    on_drained = target.on_drained
    if on_drained is not None and not target._closed:
        on_drained()


class PairedRouterMixin:
    """Put before a listener class (UnixRouter, zmq BatchSocket): batches for the paired frontend's
    lanes go in-process, every other destination through the socket as before."""

    __slots__ = ()

    def _init_local(self) -> None:
        self._local: dict[bytes, LocalDealer] = {}

    def _send_items(self, dest: bytes | None, header: Any, items: list) -> None:
        link = self._local.get(dest)  # type: ignore[arg-type]
        if link is None:
            super()._send_items(dest, header, items)  # type: ignore[misc]
        elif not self._closed:  # type: ignore[attr-defined]
            _hand_over(self, link, None, header, items, link.queued, _TO_FRONTEND)  # type: ignore[arg-type]

    def _send_pending(self) -> None:
        # _send_pending_safe, inline: this runs for every batch the shard sends to its frontend.
        global _safe
        outer = _safe
        _safe = self
        try:
            super()._send_pending()  # type: ignore[misc]
        finally:
            _safe = outer

    def _send(self, dest: bytes | None, payload: bytes) -> None:
        link = self._local.get(dest)  # type: ignore[arg-type]
        if link is None:
            super()._send(dest, payload)  # type: ignore[misc]
            return
        if self._closed:  # type: ignore[attr-defined]
            return
        if self.on_sent is not None:  # type: ignore[attr-defined]
            self.on_sent(len(payload))  # type: ignore[attr-defined]
        link.queued[_TO_FRONTEND] += 1
        self.loop.call_soon(_receive, link, None, payload, link.queued, _TO_FRONTEND)  # type: ignore[attr-defined]


def register_router(router: Any) -> None:
    global _router
    router._init_local()
    _router = router


def router_for(index: int, identity: bytes) -> Any:
    """The paired shard's listener when ``identity`` (connecting to shard ``index``) is one of the
    paired frontend's lanes in this process; None: use a socket."""
    if _paired is None or index != _paired or _router is None or _router._closed:
        return None
    return _router if identity in local_identities(index) else None


class LocalDealer(TurnBatcher):
    """The paired frontend's connection to its own shard: the BatchSocket interface, no socket."""

    __slots__ = ("router", "identity", "queued")

    is_router = False

    def __init__(self, loop: asyncio.AbstractEventLoop, router: Any, identity: bytes, on_batch: OnBatch,
                 header_for: Callable[[bytes | None], Any] | None = None) -> None:
        super().__init__(loop, on_batch, header_for)
        self.router = router
        self.identity = identity
        # This link's batches waiting in call_soon: [to the shard, to the frontend] (FIFO per link).
        self.queued = [0, 0]
        router._local[identity] = self

    @property
    def connected(self) -> bool:
        return not self._closed and not self.router._closed

    def _send_items(self, dest: bytes | None, header: Any, items: list) -> None:
        if not self._closed:
            _hand_over(self, self.router, self.identity, header, items, self.queued, _TO_SHARD)

    def flush(self) -> None:
        # The frontend's turn's end only: its send_pending (send_early, at the end of one client read)
        # stays queued, so the reads of one loop iteration still find the shard busy and batch
        # together (4 publishers at once were a batch per read, +13 % CPU per message).
        _send_pending_safe(self, super().flush)

    def _send(self, dest: bytes | None, payload: bytes) -> None:
        """A batch already packed (``send_packed``): unpacked on the other end, as a socket's."""
        if self._closed:
            return
        if self.on_sent is not None:
            self.on_sent(len(payload))
        self.queued[_TO_SHARD] += 1
        self.loop.call_soon(_receive, self.router, self.identity, payload, self.queued, _TO_SHARD)

    def close(self) -> None:
        if self._closed:
            return
        self.flush()
        self._closed = True
        if self.router._local.get(self.identity) is self:
            del self.router._local[self.identity]
