"""broker/gc_pause.py BulkChanges: no full collection while definitions change in bulk, the process's
own thresholds back once the bulk is over (and someone else's setting meanwhile left alone)."""

from __future__ import annotations

import asyncio
import gc

import pytest

from broker import gc_pause


@pytest.fixture
def thresholds():
    saved = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    yield
    gc.set_threshold(*saved)


def _run(coro) -> None:
    asyncio.new_event_loop().run_until_complete(coro)


async def _until_over(bulk: gc_pause.BulkChanges, timeout: float = 10.0) -> None:
    """Wait for the bulk's quiet windows to end it (a loaded machine runs the timers late)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while bulk.deferring and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.01)


def test_a_bulk_defers_full_collections_until_a_quiet_window(thresholds, monkeypatch):
    monkeypatch.setattr(gc_pause, "BULK_WINDOW_S", 0.05)

    async def main() -> None:
        bulk = gc_pause.BulkChanges(asyncio.get_running_loop())
        bulk.note(gc_pause.BULK_OPS - 1)  # a few changes: nothing deferred
        assert gc.get_threshold() == (700, 10, 10) and not bulk.deferring
        await asyncio.sleep(0.08)
        for _ in range(4):  # a bulk lasting several windows: deferred all along
            bulk.note(gc_pause.BULK_OPS)
            assert gc.get_threshold() == (700, 10, gc_pause.DEFERRED_FULL_THRESHOLD)
            await asyncio.sleep(0.03)
        assert bulk.deferring
        await _until_over(bulk)  # windows without a bulk: the process's own thresholds again
        assert gc.get_threshold() == (700, 10, 10) and not bulk.deferring
        bulk.note(gc_pause.BULK_OPS)
        gc.set_threshold(500, 5, 5)  # someone else's change while deferring stands
        await _until_over(bulk)
        assert gc.get_threshold() == (500, 5, 5) and not bulk.deferring
        bulk.note(gc_pause.BULK_OPS)
        bulk.close()  # a stopping node puts them back at once
        assert gc.get_threshold() == (500, 5, 5)

    _run(main())


def test_bulks_closer_than_the_quiet_windows_are_one(thresholds, monkeypatch):
    """Queues declared in bulk, then deleted in bulk a second later: the full collection that was due
    after the declares waits for the deletes' end (it walked the declared queues' objects in one
    piece at the deletes' start). Window ends are driven by hand (_window), so no timing matters."""
    monkeypatch.setattr(gc_pause, "BULK_WINDOW_S", 3600)
    deferred = (700, 10, gc_pause.DEFERRED_FULL_THRESHOLD)

    async def main() -> None:
        bulk = gc_pause.BulkChanges(asyncio.get_running_loop())
        bulk.note(gc_pause.BULK_OPS)  # the declares
        assert gc.get_threshold() == deferred
        bulk._window()
        bulk._window()  # the tail of the declares: a window below BULK_OPS
        assert gc.get_threshold() == deferred and bulk.deferring
        bulk.note(gc_pause.BULK_OPS)  # the deletes, the window after
        bulk._window()
        assert gc.get_threshold() == deferred and bulk.deferring
        for _ in range(gc_pause.QUIET_WINDOWS - 1):
            bulk._window()
            assert gc.get_threshold() == deferred and bulk.deferring
        bulk._window()  # QUIET_WINDOWS in a row without a bulk: over
        assert gc.get_threshold() == (700, 10, 10) and not bulk.deferring
        bulk.note(gc_pause.BULK_OPS)  # a later bulk counts its quiet windows from none
        bulk._window()
        bulk.note(1)
        bulk._window()
        assert bulk.deferring
        bulk.close()
        assert gc.get_threshold() == (700, 10, 10)

    _run(main())
