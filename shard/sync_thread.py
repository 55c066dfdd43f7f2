"""The thread a shard's group syncs run on: one job at a time, its end reported on the loop.

A group sync (shard/worker.py ``_start_sync``) used ``loop.run_in_executor``: per sync a
``concurrent.futures.Future`` (a ``Condition`` and its ``RLock``, entered again by every state
read), a ``_WorkItem``, the pool's thread-count check under a ``Semaphore``, and ``wrap_future``
chaining it to an asyncio future whose state is copied over in a loop callback, which then schedules
the done callback for yet another loop iteration. A confirming publisher with one persistent
message in flight pays all of that per message (~45 Python calls on the loop, more on the thread).

Here the job goes through a ``SimpleQueue`` to one long-lived thread, and its end comes back in one
``call_soon_threadsafe`` that settles the asyncio future (what a stop awaits) and runs the done
callback at once. What runs on the thread, and when the callback runs relative to the sync, is as
before: the callback sees the sync's exception, if any, through the future.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from queue import SimpleQueue
from typing import Any

log = logging.getLogger("shardmq.shard")


class SyncThread:
    """Runs ``fn(*args)`` jobs in order on one daemon thread (started at the first job)."""

    __slots__ = ("_loop", "_jobs", "_thread", "_name")

    def __init__(self, loop: asyncio.AbstractEventLoop, name: str) -> None:
        self._loop = loop
        self._jobs: SimpleQueue = SimpleQueue()
        self._thread: threading.Thread | None = None
        self._name = name

    def run(self, fn: Callable[..., Any], args: tuple, done: Callable[[asyncio.Future], None]) -> asyncio.Future:
        """Start ``fn(*args)`` on the thread; when it returned or raised, the future gets its result
        or exception and ``done(future)`` runs on the loop, in the same callback."""
        fut = self._loop.create_future()
        if self._thread is None:
            self._thread = threading.Thread(target=self._main, name=self._name, daemon=True)
            self._thread.start()
        self._jobs.put((fn, args, fut, done))
        return fut

    def close(self) -> None:
        """No more jobs: the thread ends after the one it runs (if any)."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread = None

    def _main(self) -> None:
        jobs = self._jobs
        while True:
            job = jobs.get()
            if job is None:
                return
            fn, args, fut, done = job
            try:
                fn(*args)
                exc = None
            except BaseException as e:  # reported through the future, as run_in_executor's would be
                exc = e
            try:
                self._loop.call_soon_threadsafe(_finish, fut, done, exc)
            except RuntimeError:  # the loop is closed: nobody waits for this any more
                return


def _finish(fut: asyncio.Future, done: Callable[[asyncio.Future], None], exc: BaseException | None) -> None:
    if not fut.done():  # (cancelled by a loop shutting down)
        if exc is None:
            fut.set_result(None)
        else:
            fut.set_exception(exc)
    done(fut)
