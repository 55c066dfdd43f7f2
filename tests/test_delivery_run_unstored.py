"""Shard-side delivery runs (docs/architecture.md "The publish path"): the bodies of a PUBLISH_RUN that
an empty plain queue's no-ack consumers take unstored are delivered in one go
(Queue.deliver_unstored_run, TurnBatcher.put_many). Both must do exactly what their one-at-a-time
forms did: deliver_unstored per body until it refuses (credit used up in the middle of a run, a
manual-ack or inactive consumer next in the round-robin), and put per item (same batches)."""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker import contract
from broker.turn_batch import MAX_BATCH_ITEMS, TurnBatcher
from shard.consumers import ChannelRef, Consumer
from shard.queue import Queue
from shard.store import QueueStore, make_queue_dir


class Capture(TurnBatcher):
    __slots__ = ("sent",)

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop, lambda *_: None, None)
        self.sent: list = []

    def _send(self, dest, payload: bytes) -> None:
        self.sent.append((dest, contract.unpack(payload)[1]))


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def test_put_many_cuts_batches_where_single_puts_do(loop):
    rnd = random.Random(3)
    many, single = Capture(loop), Capture(loop)
    n = 0
    for _ in range(400):
        dest = rnd.choice((b"a", b"b"))
        roll = rnd.random()
        if roll < 0.1:
            weight = rnd.randint(1, MAX_BATCH_ITEMS)
            many.put_weighted(dest, ["run", weight], weight)
            single.put_weighted(dest, ["run", weight], weight)
        elif roll < 0.15:
            many.flush()
            single.flush()
        else:
            items = [["one", n + i] for i in range(rnd.choice((0, 1, 3, 100, MAX_BATCH_ITEMS, 1300)))]
            n += len(items)
            many.put_many(dest, items)
            for item in items:
                single.put(dest, item)
    many.flush()
    single.flush()
    assert many.sent == single.sent and n > 10 * MAX_BATCH_ITEMS


def _queue(tmp_path, consumers: list[tuple[bool, bool, int, int]]) -> Queue:
    """A plain empty queue with consumers (no_ack, active, credit, frontend number)."""
    path, _ = make_queue_dir(str(tmp_path), "/", "q")
    q = Queue(7, "/", "q", SimpleNamespace(durable=False, auto_delete=False, arguments={}),
              QueueStore(path, empty_dir=True))
    for i, (no_ack, active, credit, fe) in enumerate(consumers):
        c = Consumer(ChannelRef(b"fe%d" % fe, 10 + i, 1), f"c{i}", no_ack, False, 0, {})
        c.active = active
        c.credit = credit
        q.add_consumer(c)
    return q


# No-ack consumers only: what deliver_unstored does for a manual-ack one is not a delivery run's
# business (the run stops there and leaves it to deliver_unstored: the explicit test below).
_consumer = st.tuples(st.just(True), st.booleans(), st.integers(-2, 12), st.integers(0, 1))


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(_consumer, min_size=1, max_size=3), st.integers(0, 5),
       st.lists(st.sampled_from([b"", b"x", b"y" * 600, b"z" * 2000]), min_size=1, max_size=20))
def test_a_delivery_run_is_deliver_unstored_per_body_until_it_refuses(tmp_path_factory, consumers, rr, bodies):
    one = _queue(tmp_path_factory.mktemp("one"), consumers)
    run = _queue(tmp_path_factory.mktemp("run"), consumers)
    one._rr = run._rr = rr % (len(consumers) + 1)
    sent_one: list = []
    took_one = 0
    for body in bodies:
        if not one.deliver_unstored(lambda fe, item: sent_one.append((fe, item)), "ex", "rk", b"\x00\x00", body):
            break
        took_one += 1
    sent_run: list = []
    took = run.deliver_unstored_run(lambda fe, items: sent_run.extend((fe, item) for item in items),
                                    "ex", "rk", b"\x00\x00", bodies)
    assert took == took_one
    for fe in (b"fe0", b"fe1"):  # in order per frontend (batches go per frontend)
        assert [item for d, item in sent_run if d == fe] == [item for d, item in sent_one if d == fe]
    assert len(sent_run) == took
    assert [(c.credit, c.tag) for c in run.consumers] == [(c.credit, c.tag) for c in one.consumers]
    assert (run._rr, run.n_delivered, run.n_deliver_no_ack) == (one._rr, one.n_delivered, one.n_deliver_no_ack)


def test_credit_used_up_in_the_middle_of_a_run(tmp_path):
    q = _queue(tmp_path, [(True, True, 5, 0)])
    sent: list = []
    bodies = [b"a", b"b" * 600, b"c", b"d", b"e", b"f"]  # 600 B cost 2 credits: 1 + 2 + 1 + 1 = 5
    assert q.deliver_unstored_run(lambda fe, items: sent.append((fe, items)), "", "q", b"", bodies) == 4
    assert [(fe, [item[-1] for item in items]) for fe, items in sent] == [(b"fe0", bodies[:4])]
    assert q.consumers[0].credit == 0
    assert q.deliver_unstored_run(lambda fe, items: sent.append(items), "", "q", b"", bodies[4:]) == 0
    assert len(sent) == 1
    # A manual-ack consumer next in the round-robin stops a run (its messages go body by body).
    q = _queue(tmp_path / "b", [(True, True, 100, 0), (False, True, 100, 1)])
    sent = []
    assert q.deliver_unstored_run(lambda fe, items: sent.append((fe, items)), "", "q", b"", bodies) == 1
    assert [(fe, [item[-1] for item in items]) for fe, items in sent] == [(b"fe0", [b"a"])]
