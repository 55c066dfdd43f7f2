"""In a paired process a connection's deferred dispatch (a client pipelining hundreds of queue.delete:
frontend/amqp/connection.py ``_dispatch_deferred``, one slice per loop turn) gives its turn once to
the pair's data waiting in call_soon (broker/local_link.py ``batches_queued``): a publish on its way
to the shard part goes before the slice, not behind it. The connection and the link are the real
ones on a real loop; the worker is a stand-in that records when the connection dispatches."""

from __future__ import annotations

import asyncio

import pytest
from pamqp import commands as C

from broker import contract, local_link
from broker.amqp.encoder import encode_method, encode_protocol_header
from broker.turn_batch import TurnBatcher
from frontend.amqp.connection import RUNNING, AMQPConnection


class _Router(local_link.PairedRouterMixin, TurnBatcher):
    """The paired shard's listener without a socket (the lane below is its only destination)."""

    is_router = True

    def _send(self, dest, payload):  # noqa: ANN001 - not reached: the lane is local
        raise AssertionError("a local lane's batch went to the socket")


class _Worker:
    """What AMQPConnection asks of its FrontendWorker here; ``mark_dirty`` is a dispatch's first step."""

    def __init__(self, loop: asyncio.AbstractEventLoop, log: list) -> None:
        self.settings: dict = {}
        self.index = 0
        self.loop = loop
        self.log = log
        self.fence = [0]
        self.defs_version = 0
        self._early: list = []

    def new_conn_id(self) -> int:
        return 1

    def mark_dirty(self, conn: AMQPConnection) -> None:
        self.log.append("dispatch")
        self.loop.call_soon(self._end_of_turn, conn)

    def _end_of_turn(self, conn: AMQPConnection) -> None:
        conn._dirty = False  # the next dispatch marks it again


@pytest.fixture
def pair():
    loop = asyncio.new_event_loop()
    log: list = []
    router = _Router(loop, lambda _ident, _header, items: log.append(("shard", items[0][1])), None)
    saved = local_link._router
    local_link.register_router(router)
    lane = local_link.LocalDealer(loop, router, b"fe-0", lambda *_: None)
    conn = AMQPConnection(_Worker(loop, log))
    conn.state = RUNNING
    # The client's header and connection.open (their events are not needed): the parser takes channels then.
    assert len(conn.parser.feed(encode_protocol_header() + encode_method(0, C.Connection.Open()))) == 2
    yield loop, log, lane, conn
    local_link._router = saved
    loop.close()


def _defer_channel_opens(conn: AMQPConnection, first: int, n: int) -> None:
    """Events read earlier and left for the next turns, as a big read of a control client leaves them."""
    data = b"".join(encode_method(ch, C.Channel.Open()) for ch in range(first, first + n))
    conn._defer(conn.parser.feed(data))
    assert len(conn._deferred) == n


def _publish_on_its_way(lane: local_link.LocalDealer, n: int) -> None:
    """A client read's publish to the paired shard (send_early): queued in call_soon, not handed over."""
    lane.put(None, [contract.CREDIT, n, 1, "tag", 1])
    lane.send_pending()


def _turns(loop: asyncio.AbstractEventLoop, n: int) -> None:
    """n loop iterations: each runs the callbacks scheduled before it began (what call_soon queued)."""
    for _ in range(n):
        loop.call_soon(loop.stop)
        loop.run_forever()


def test_a_deferred_slice_goes_behind_the_data_queued_before_it(pair):
    loop, log, lane, conn = pair
    _defer_channel_opens(conn, 1, 3)  # its slice is scheduled first ...
    _publish_on_its_way(lane, 1)  # ... then the publish read in the same turn
    assert local_link.batches_queued()
    _turns(loop, 5)
    assert log == [("shard", 1), "dispatch"]
    assert not local_link.batches_queued()
    assert sorted(conn.channels) == [1, 2, 3]  # every event handled, once


def test_the_slice_gives_way_once_then_runs_though_more_data_waits(pair):
    """A steady stream of data does not starve the deferred events: one turn given per slice."""
    loop, log, lane, conn = pair
    _defer_channel_opens(conn, 1, 3)
    _publish_on_its_way(lane, 1)
    _turns(loop, 1)  # the slice gave way: rescheduled behind the publish, which the shard got
    assert log == [("shard", 1)]
    _publish_on_its_way(lane, 2)  # more data, queued behind the rescheduled slice
    _turns(loop, 5)
    assert log == [("shard", 1), "dispatch", ("shard", 2)]
    assert sorted(conn.channels) == [1, 2, 3]


def test_nothing_queued_no_turn_given(pair):
    loop, log, _lane, conn = pair
    _defer_channel_opens(conn, 1, 2)
    assert not local_link.batches_queued()
    _turns(loop, 1)
    assert log == ["dispatch"] and sorted(conn.channels) == [1, 2]
