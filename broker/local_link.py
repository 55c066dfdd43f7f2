"""The data plane between the frontend and the shard of one paired process (``--colocate``).

A paired worker process (``shard/pair_main.py``) runs frontend K and shard K on one event loop.
Between those two, a batch needs no socket: the end that flushes it hands the packed batch to the
other end's ``on_batch`` through ``loop.call_soon``, on the same loop: no ``write``, no ``read``,
no wake-up of another process (each of those cost ~22 us on a halted vCPU plus ~8 us in the
sender's ``send``: docs/benchmarks.md, "What would close the gap").

What stays as with sockets (the workers cannot tell): the per-turn batching of ``TurnBatcher``
(one batch per destination per loop turn, a full one at once), the contract's batches packed and
unpacked as the sockets do (so a body handed over is a fresh ``bytes``, never a view of a buffer
the sender reuses), ``on_sent`` (the frontend's bytes in flight), ``on_drained`` after each batch
handed over (a worker sends what it produced then, as after a read), the stage trace, and FIFO
order per direction (``call_soon`` keeps it). Every other peer (other frontends, other shards'
forwards, the shard's own deduplicating-exchange socket) still goes through the real socket: the
shard's listener is a ``PairedRouter`` that sends a batch in-process only when its destination is
the paired frontend's publish or control lane.

The registry is per process: ``enable(index)`` is called once by ``shard/pair_main.py`` before
either worker starts; a process that did not call it (a single-role worker) never sees a link.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from broker import contract, gc_pause
from broker.turn_batch import OnBatch, TurnBatcher

_BULK_BATCH = 1 << 20  # as broker/unixio.py: a batch this big is decoded with the cyclic GC paused

_paired: int | None = None  # the index of this process's pair, if it is one
_router: Any = None  # the paired shard's listener, once it is bound


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


def _receive(target: TurnBatcher, ident: bytes | None, payload: bytes) -> None:
    """Hand one batch to ``target``'s on_batch, as a socket's read would (runs from call_soon)."""
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

    def _send(self, dest: bytes | None, payload: bytes) -> None:
        link = self._local.get(dest)  # type: ignore[arg-type]
        if link is None:
            super()._send(dest, payload)  # type: ignore[misc]
            return
        if self._closed:  # type: ignore[attr-defined]
            return
        if self.on_sent is not None:  # type: ignore[attr-defined]
            self.on_sent(len(payload))  # type: ignore[attr-defined]
        self.loop.call_soon(_receive, link, None, payload)  # type: ignore[attr-defined]


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

    __slots__ = ("router", "identity")

    is_router = False

    def __init__(self, loop: asyncio.AbstractEventLoop, router: Any, identity: bytes, on_batch: OnBatch,
                 header_for: Callable[[bytes | None], Any] | None = None) -> None:
        super().__init__(loop, on_batch, header_for)
        self.router = router
        self.identity = identity
        router._local[identity] = self

    @property
    def connected(self) -> bool:
        return not self._closed and not self.router._closed

    def _send(self, dest: bytes | None, payload: bytes) -> None:
        if self._closed:
            return
        if self.on_sent is not None:
            self.on_sent(len(payload))
        self.loop.call_soon(_receive, self.router, self.identity, payload)

    def close(self) -> None:
        if self._closed:
            return
        self.flush()
        self._closed = True
        if self.router._local.get(self.identity) is self:
            del self.router._local[self.identity]
