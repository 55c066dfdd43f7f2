"""TurnBatcher.put_weighted (broker/turn_batch.py): an item standing for several (a PUBLISH_RUN of n
messages) counts n towards a batch's MAX_BATCH_ITEMS, so batches of runs hold as many messages as
batches of single items, in order, and a run is never split by the batcher."""

from __future__ import annotations

import asyncio
import random

import pytest

from broker import contract
from broker.turn_batch import MAX_BATCH_ITEMS, TurnBatcher


class Capture(TurnBatcher):
    __slots__ = ("sent",)

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop, lambda *_: None, None)
        self.sent: list[list] = []

    def _send(self, dest, payload: bytes) -> None:
        self.sent.append((dest, contract.unpack(payload)[1]))


def _weight(items: list) -> int:
    return sum(item[1] if item[0] == "run" else 1 for item in items)


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def test_a_run_counts_its_weight_towards_the_batch(loop):
    b = Capture(loop)
    for i in range(500):
        b.put(None, ["one", i])
    b.put_weighted(None, ["run", 20], 20)  # 500 + 20 > MAX: the 500 go first, the run waits
    assert [len(items) for _dest, items in b.sent] == [500]
    for i in range(MAX_BATCH_ITEMS - 21):
        b.put(None, ["one", i])
    assert len(b.sent) == 1
    b.put(None, ["one", "last"])  # 20 + 492 = MAX_BATCH_ITEMS
    assert len(b.sent) == 2 and _weight(b.sent[1][1]) == MAX_BATCH_ITEMS
    b.put_weighted(None, ["run", MAX_BATCH_ITEMS + 5], MAX_BATCH_ITEMS + 5)  # heavier than a batch: alone
    assert b.sent[2][1] == [["run", MAX_BATCH_ITEMS + 5]]
    b.flush()
    assert len(b.sent) == 3


def test_random_mixes_keep_order_and_batch_weight(loop):
    rnd = random.Random(7)
    b = Capture(loop)
    put = []
    for i in range(5000):
        dest = rnd.choice((b"a", b"b"))
        if rnd.random() < 0.3:
            item = ["run", rnd.randint(1, MAX_BATCH_ITEMS), i]
            b.put_weighted(dest, item, item[1])
        else:
            item = ["one", i]
            b.put(dest, item)
        put.append((dest, item))
        if rnd.random() < 0.01:
            b.flush()
    b.flush()
    for dest in (b"a", b"b"):
        batches = [items for d, items in b.sent if d == dest]
        assert [item for items in batches for item in items] == [item for d, item in put if d == dest]
        assert all(_weight(items) <= MAX_BATCH_ITEMS for items in batches)


def test_the_stage_trace_sees_every_body_of_a_run(loop):
    import io
    import zlib

    from broker.stage_trace import SAMPLE, StageTrace

    keys = [k for k in (i.to_bytes(16, "big") for i in range(5000)) if zlib.crc32(k) % SAMPLE == 0][:3]
    out = io.StringIO()
    b = Capture(loop)
    b.set_trace(StageTrace(out), "in", "fe_publish_out")
    run = [contract.PUBLISH_RUN, "/", ["q"], "", "q", b"\x00\x00", [keys[0], b"x" * 16, keys[1]], False,
           None, None, None]
    b.put_weighted(None, run, 3)
    b.put(None, [contract.PUBLISH, "/", ["q"], "", "q", b"\x00\x00", keys[2], False, None, None, None])
    b.flush()
    assert [line.split()[:2] for line in out.getvalue().splitlines()] == [
        ["fe_publish_out", k.hex()] for k in keys]
