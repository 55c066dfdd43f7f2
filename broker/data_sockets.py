"""The data plane's sockets (frontends and shard peers <-> a shard), by the node's ``--ipc-transport``.

``unix`` (``broker/unixio.py``): unix stream sockets written and read by the event loops themselves.
``zmq`` (``broker/zmqio.py``): ZeroMQ ROUTER/DEALER over ``ipc://``. Both have the ``BatchSocket``
interface (``put``, one flush per loop turn, ``on_batch(dest, header, items)``, ``on_sent``,
``set_trace``, ``close``), so the workers do not know which one they hold.

The node exports its setting as ``SHARDMQ_IPC_TRANSPORT`` before it spawns workers (as
``--trace-stages``): a shard binds its data socket before it has the node's snapshot, and every end
of one node must agree.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import Any

from broker import contract, local_link

ENV = "SHARDMQ_IPC_TRANSPORT"
DEFAULT = "unix"  # the node always exports its setting; this is for a worker started on its own

OnBatch = Callable[[bytes | None, Any, list], None]


def transport() -> str:
    """``unix`` or ``zmq``: what this node's workers use (an unknown value falls back to the default)."""
    value = os.environ.get(ENV, DEFAULT)
    return value if value in ("unix", "zmq") else DEFAULT


def shard_listener(loop: asyncio.AbstractEventLoop, run_dir: str, index: int, on_batch: OnBatch) -> Any:
    """Shard ``index``'s data socket, bound before this returns (peers' batches: ``on_batch(ident, ...)``).

    In a paired process (``--colocate``, broker/local_link.py) it also serves the paired frontend's
    lanes in-process."""
    paired = local_link.paired_index() == index
    if transport() == "unix":
        from broker.unixio import UnixRouter

        cls = _paired_class(UnixRouter) if paired else UnixRouter
        router = cls(loop, contract.shard_stream_path(run_dir, index), on_batch)
    else:
        import zmq

        from broker.zmqio import BatchSocket, make_socket

        sock = make_socket(zmq.Context.instance(), zmq.ROUTER)
        sock.bind(contract.shard_address(run_dir, index))
        cls = _paired_class(BatchSocket) if paired else BatchSocket
        router = cls(loop, sock, on_batch)
    if paired:
        local_link.register_router(router)
    return router


def _paired_class(base: type) -> type:
    return type(f"Paired{base.__name__}", (local_link.PairedRouterMixin, base), {})


def shard_connection(loop: asyncio.AbstractEventLoop, run_dir: str, index: int, identity: bytes,
                     on_batch: OnBatch, header_for: Callable[[bytes | None], Any] | None = None) -> Any:
    """A connection to shard ``index`` under ``identity`` (kept up across the shard's restarts);
    the paired frontend's lanes to its own shard are in-process (broker/local_link.py)."""
    router = local_link.router_for(index, identity)
    if router is not None:
        return local_link.LocalDealer(loop, router, identity, on_batch, header_for)
    if transport() == "unix":
        from broker.unixio import UnixDealer

        return UnixDealer(loop, contract.shard_stream_path(run_dir, index), identity, on_batch, header_for)
    import zmq

    from broker.zmqio import BatchSocket, make_socket

    sock = make_socket(zmq.Context.instance(), zmq.DEALER, identity)
    sock.connect(contract.shard_address(run_dir, index))
    return BatchSocket(loop, sock, on_batch, header_for)
