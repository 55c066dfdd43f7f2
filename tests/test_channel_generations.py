"""The frontend's channel bookkeeping against a recording stand-in worker (no sockets, no node).

What the shards see of a channel is its key (number + 65536 * generation, broker/contract.py);
a client's channel.close is answered only when every shard the channel used has answered.
"""

from __future__ import annotations

import asyncio

from pamqp import commands as C
from pamqp import frame as pframe

from broker import contract
from broker.amqp import events as E
from frontend.amqp.channel import Consumer
from frontend.amqp.connection import RUNNING, AMQPConnection


class RecordingWorker:
    def __init__(self) -> None:
        self.settings: dict = {}
        self.index = 0
        self.loop = asyncio.new_event_loop()
        self.put: list = []  # (shard, item)
        self.requests: list = []  # (shard, item, callback)
        self._req = 0

    def new_conn_id(self) -> int:
        return 7

    def mark_dirty(self, conn) -> None:
        pass

    def shard_put(self, shard: int, item: list) -> None:
        self.put.append((shard, item))

    def shard_request(self, shard: int, build, conn, callback) -> None:
        self._req += 1
        self.requests.append((shard, build(self._req), callback))


def _running() -> tuple[AMQPConnection, RecordingWorker]:
    worker = RecordingWorker()
    conn = AMQPConnection(worker)
    conn.state = RUNNING
    return conn, worker


def _frames(conn: AMQPConnection) -> list:
    data, conn._out = b"".join(conn._out), []
    out = []
    while data:
        used, channel, value = pframe.unmarshal(data)
        data = data[used:]
        out.append((channel, type(value).__name__))
    return out


def test_close_ok_waits_for_every_shard_the_channel_used():
    conn, worker = _running()
    conn._open_channel(1)
    ch = conn.channels[1]
    assert _frames(conn) == [(1, "OpenOk")]
    ch.shards = {0, 1}
    ch.m_channel_close(C.Channel.Close(200, "bye", 0, 0))
    assert [(s, item[0], item[1], item[2]) for s, item, _ in worker.requests] == [
        (0, contract.CHANNEL_CLOSED, 7, ch.key), (1, contract.CHANNEL_CLOSED, 7, ch.key)]
    assert _frames(conn) == []  # nothing yet: shard 1 has not requeued
    worker.requests[0][2](True, {})
    assert _frames(conn) == [] and conn.channels.get(1) is ch  # the number is not free yet
    worker.requests[1][2](True, {})
    assert _frames(conn) == [(1, "CloseOk")]
    assert 1 not in conn.channels


def test_close_of_a_channel_that_used_no_shard_is_answered_at_once():
    conn, worker = _running()
    conn._open_channel(3)
    _frames(conn)
    conn.channels[3].m_channel_close(C.Channel.Close(200, "bye", 0, 0))
    assert _frames(conn) == [(3, "CloseOk")] and worker.requests == []


def test_items_for_an_earlier_opening_of_a_number_are_dropped():
    conn, worker = _running()
    conn._open_channel(1)
    old = conn.channels[1]
    old.m_channel_close(C.Channel.Close(200, "bye", 0, 0))
    conn._open_channel(1)
    new = conn.channels[1]
    assert new.number == old.number == 1 and new.key != old.key and new.key & 0xFFFF == 1
    new.m_confirm_select(C.Confirm.Select())
    _frames(conn)
    new.confirm.publish(1)
    conn.on_confirm(old.key, [1], True)  # a late confirm of the old opening: not the new one's seq 1
    assert new.confirm.unconfirmed == 1
    conn.on_deliver(0, [contract.DELIVER, 7, old.key, "ctag", 1, 1, False, "", "q", b"\x00\x00", b"x"])
    conn.on_cancel_notify(old.key, "ctag")
    conn.on_close_channel(old.key, 406, "PRECONDITION_FAILED - late")
    conn.flush_turn()
    assert _frames(conn) == [] and new.state == 1  # OPEN, nothing written to the new opening
    conn.on_confirm(new.key, [1], True)
    assert new.confirm.unconfirmed == 0


def test_cancel_ok_waits_for_the_shard_and_deliveries_before_it_reach_the_client():
    """basic.cancel-ok only once the shard dropped the consumer; a no-ack delivery the shard sent
    before that is written to the client, not lost (RabbitMQ delivers between cancel and cancel-ok)."""
    conn, worker = _running()
    conn._open_channel(1)
    ch = conn.channels[1]
    consumer = Consumer("ctag", "q", 0, True)
    consumer.ready = True
    ch.consumers["ctag"] = consumer
    _frames(conn)
    ch.handle(E.MethodFrame(1, C.Basic.Cancel("ctag")))
    [(shard, item, _cb)] = worker.requests
    assert (shard, item[0], item[2], item[3]) == (0, contract.CANCEL, ch.key, "ctag")
    assert _frames(conn) == []
    conn.on_deliver(0, [contract.DELIVER, 7, ch.key, "ctag", 1, 1, False, "", "q", b"\x00\x00", b"x"])
    _cb(True, {})  # the shard's answer
    assert _frames(conn) == [(1, "Deliver"), (1, "ContentHeader"), (1, "ContentBody"), (1, "CancelOk")]
    assert "ctag" not in ch.consumers
