"""Publishes to an idle shard leave at the end of the client read, not of the loop turn.

frontend/worker.py shard_put / send_early: when every publish-lane batch sent to a shard has been
answered (PROCESSED), the publishes a client read put for it are sent as soon as that read is
handled (one batch for the whole read), not after the rest of the loop turn; while batches are in
flight everything waits for the turn's end, as before (docs/architecture.md "Lanes").
The first tests drive the rule against recording lanes (no sockets); the last ones send bursts of
publishes in one socket write to a real node and check that every message arrives once, in order,
and that confirms count every publish.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

import pytest
from pamqp import commands as C
from pamqp import frame as pframe
from pamqp import header as pheader
from pamqp.body import ContentBody

from broker import contract
from broker.defs_fence import FenceWord
from broker.turn_batch import TurnBatcher
from frontend.worker import FrontendWorker
from tests.helpers import WAIT, uid
from tests.raw_amqp import RawClient


class _Recording(TurnBatcher):
    """A lane that keeps what it sends (header, items) instead of writing to a socket."""

    def __init__(self, loop, header_for, sent: list, name: str) -> None:
        super().__init__(loop, lambda *_: None, header_for)
        self.sent = sent
        self.name = name

    def _send(self, dest, payload) -> None:
        if self.on_sent is not None:
            self.on_sent(len(payload))
        header, items = contract.unpack(payload)
        self.sent.append((self.name, header, [item[0] for item in items]))


@pytest.fixture
def worker(tmp_path):
    loop = asyncio.new_event_loop()
    fence = FenceWord(str(tmp_path))  # the node's side of the definitions fence, which a worker maps
    w = FrontendWorker(0, str(tmp_path), loop)
    w.shard_count = 1
    w.epochs = [1]
    w._sent, w._processed, w._unanswered = [0], [0], [deque()]
    w._bytes_in_flight, w._unsent_bytes, w._ctl_put, w._pub_need = [0], [0], [0], [0]
    w.sent = []
    lane = _Recording(loop, w._header_for(0), w.sent, "publish")
    lane.on_sent = w._sent_bytes(0)
    w.shards = [lane]
    w.control = [_Recording(loop, w._control_header_for(0), w.sent, "control")]
    yield w
    loop.close()
    fence.close()


def _publish(worker: FrontendWorker) -> None:
    worker.shard_put(0, [contract.PUBLISH, "/", ["q"], "", "q", b"", b"body", False, None, None, None])


def _end_of_turn(worker: FrontendWorker) -> None:
    worker.shards[0].flush()
    worker.control[0].flush()


def _batches(worker):
    return [(name, header[1], kinds) for name, header, kinds in worker.sent]


def test_a_reads_publishes_to_an_idle_shard_leave_at_its_end_in_one_batch(worker):
    _publish(worker)
    _publish(worker)
    assert worker.sent == []  # not one by one while the read is handled
    worker.send_early()  # the end of the read
    assert _batches(worker) == [("publish", 1, [contract.PUBLISH, contract.PUBLISH])]
    _end_of_turn(worker)
    worker.send_early()
    assert len(worker.sent) == 1  # nothing sent twice


def test_a_publish_run_to_an_idle_shard_leaves_at_the_end_of_the_read_too(worker):
    worker.shard_put(0, [contract.PUBLISH_RUN, "/", ["q"], "", "q", b"", [b"a", b"b", b"c"], False,
                         None, None, None])
    assert worker.sent == []
    worker.send_early()
    assert _batches(worker) == [("publish", 1, [contract.PUBLISH_RUN])]
    worker.shard_put(0, [contract.PUBLISH_RUN, "/", ["q"], "", "q", b"", [b"d"], False, None, None, None])
    worker.send_early()  # batch 1 in flight: waits for the turn's end
    assert len(worker.sent) == 1


def test_publishes_wait_for_the_turns_end_while_a_batch_is_in_flight_and_go_early_when_answered(worker):
    _publish(worker)
    worker.send_early()
    _publish(worker)  # batch 1 not answered: batched until the turn ends
    worker.send_early()
    assert len(worker.sent) == 1
    _end_of_turn(worker)
    assert worker.sent[-1][1][1] == 2
    worker._on_shard(0, [[contract.PROCESSED, 1]])
    _publish(worker)  # batch 2 still in flight
    worker.send_early()
    assert len(worker.sent) == 2
    _end_of_turn(worker)
    worker._on_shard(0, [[contract.PROCESSED, 3]])
    assert worker._bytes_in_flight == [0]
    _publish(worker)  # everything answered: early again
    worker.send_early()
    assert [seq for _n, seq, _k in _batches(worker)] == [1, 2, 3, 4]
    assert worker._unsent_bytes == [0]


def test_a_shard_that_became_busy_during_the_read_gets_the_publishes_at_the_turns_end(worker):
    _publish(worker)  # idle when put...
    worker.shards[0].flush()  # ...but a batch left before the read ended (a full one, say)
    _publish(worker)
    worker.send_early()
    assert len(worker.sent) == 1  # the second waits: batch 1 is in flight
    _end_of_turn(worker)
    assert [seq for _n, seq, _k in _batches(worker)] == [1, 2]


def test_control_items_put_before_early_publishes_go_first_and_the_publishes_count_them(worker):
    worker.shard_put(0, [contract.ACK, 1, 1, [0, 5]])
    worker.shard_put(0, [contract.ACK, 1, 1, [0, 6]])
    _publish(worker)
    worker.send_early()
    assert [(name, kinds) for name, _s, kinds in _batches(worker)] == [
        ("control", [contract.ACK, contract.ACK]), ("publish", [contract.PUBLISH])]
    assert worker.sent[1][1][2] == 2  # the shard handles the publish only after both acks
    worker.shard_put(0, [contract.ACK, 1, 1, [0, 7]])
    _end_of_turn(worker)
    assert [(name, kinds) for name, _s, kinds in _batches(worker)[2:]] == [("control", [contract.ACK])]


# ------------------------------------------------------------------ end to end
def _burst(channel: int, queue: str, bodies: list[bytes]) -> bytes:
    """Publishes of ``bodies`` as one buffer: the node reads the whole burst in one go."""
    out = []
    for body in bodies:
        out.append(pframe.marshal(C.Basic.Publish(exchange="", routing_key=queue), channel))
        out.append(pframe.marshal(pheader.ContentHeader(0, len(body), C.Basic.Properties()), channel))
        out.append(pframe.marshal(ContentBody(body), channel))
    return b"".join(out)


@pytest.mark.parametrize("transport", ["unix", "zmq"])
@pytest.mark.parametrize("no_ack", [True, False], ids=["no-ack", "manual-ack"])
def test_bursts_read_in_one_go_arrive_once_and_in_order_and_are_all_confirmed(node_factory, no_ack, transport):
    node = node_factory(name="node", frontends=1, shards=1, extra_args=["--ipc-transport", transport])
    q = uid("burst")
    conn = node.connect()
    ch = conn.channel()
    ch.queue_declare(q)
    got: list[bytes] = []

    def on_message(channel, method, _props, body):
        got.append(body)
        if not no_ack:
            channel.basic_ack(method.delivery_tag)

    if not no_ack:
        ch.basic_qos(prefetch_count=1000)
    ch.basic_consume(q, on_message, auto_ack=no_ack)
    sizes = [1, 2, 7, 64, 300, 5]
    expected: list[bytes] = []
    with RawClient(node.port) as pub:
        pub.handshake()
        pub.open_channel(1)
        pub.send_method(1, C.Confirm.Select())
        pub.expect(C.Confirm.SelectOk, channel=1)
        confirmed = 0
        for n, size in enumerate(sizes):
            bodies = [b"%d-%d" % (n, i) for i in range(size)]
            expected += bodies
            pub.send(_burst(1, q, bodies))
            deadline = time.monotonic() + WAIT
            while len(got) < len(expected) or confirmed < len(expected):
                assert time.monotonic() < deadline, f"burst {n}: {len(got)} of {len(expected)} delivered, " \
                                                    f"{confirmed} confirmed"
                conn.process_data_events(time_limit=0.01)
                got_frame = pub.next_frame(timeout=0.01)
                if got_frame is not None and isinstance(got_frame[1], C.Basic.Ack):
                    ack = got_frame[1]
                    assert ack.multiple or ack.delivery_tag == confirmed + 1, (ack, confirmed)
                    confirmed = ack.delivery_tag
            assert confirmed == len(expected)
    assert got == expected  # each once, in publish order
    conn.process_data_events(time_limit=0.05)
    assert got == expected  # and nothing more came
    deadline = time.monotonic() + WAIT
    while ch.queue_declare(q, passive=True).method.message_count:
        assert time.monotonic() < deadline, "acked messages still counted in the queue"
        conn.process_data_events(time_limit=0.02)
    conn.close()


class _Session:
    """What _on_shard needs of a client session: deliveries in, one flush_turn per write."""

    def __init__(self, worker: FrontendWorker) -> None:
        self.worker = worker
        self.conn_id = 7
        self.delivered: list = []
        self.writes: list[list] = []
        self.dirty = False

    def on_deliver(self, _shard: int, item: list) -> None:
        self.delivered.append(item[-1])
        if not self.dirty:  # as AMQPConnection: once per write
            self.dirty = True
            self.worker.mark_dirty(self)

    def flush_turn(self) -> None:
        self.writes.append(self.delivered)
        self.delivered = []
        self.dirty = False


def test_a_shard_reads_deliveries_are_written_when_the_read_is_handled_not_at_the_turns_end(worker):
    session = _Session(worker)
    worker.conns[7] = session

    def deliver(body: bytes, tag: str) -> list:
        return [contract.DELIVER, 7, 1, tag, 1, 1, False, "", "q", b"", body]

    worker._on_shard(0, [deliver(b"a", "t1"), deliver(b"b", "t2"), [contract.PROCESSED, 0]])
    worker._on_shard(0, [deliver(b"c", "t1")])  # two batches in one read
    assert session.writes == []
    worker._shard_drained()  # the lane's on_drained: the read is handled
    assert session.writes == [[b"a", b"b", b"c"]]  # one write, before the loop runs again
    worker._on_shard(0, [deliver(b"d", "t1")])
    worker._shard_drained()
    assert session.writes == [[b"a", b"b", b"c"], [b"d"]]
    worker.loop.run_until_complete(asyncio.sleep(0))  # the end-of-turn callbacks: nothing left to write
    assert session.writes == [[b"a", b"b", b"c"], [b"d"]]
