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
        await asyncio.sleep(0.15)  # a window without a bulk: the process's own thresholds again
        assert gc.get_threshold() == (700, 10, 10) and not bulk.deferring
        bulk.note(gc_pause.BULK_OPS)
        gc.set_threshold(500, 5, 5)  # someone else's change while deferring stands
        await asyncio.sleep(0.15)
        assert gc.get_threshold() == (500, 5, 5) and not bulk.deferring
        bulk.note(gc_pause.BULK_OPS)
        bulk.close()  # a stopping node puts them back at once
        assert gc.get_threshold() == (500, 5, 5)

    _run(main())
