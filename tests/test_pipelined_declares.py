"""A channel's declares, binds and deletes sent without waiting for each *-Ok (frontend/amqp/pipeline.py).

The frontend sends them to the node while earlier ones are in flight; the client must still see
exactly what one-at-a-time handling gives: every *-Ok in the order sent, a publish after them routed
through them, and nothing of what followed a method that closed the channel.
"""

from __future__ import annotations

from pamqp import commands as C
from pamqp import frame as pframe

from tests.helpers import names_on_different_shards, uid
from tests.raw_amqp import FrameClient
from tests.test_queues import exists

# Queue names are picked per shard by their crc32 (tests/helpers.py): nodes place by name.
QUEUE_PLACEMENT = "hash"


def _frames(channel: int, *methods) -> bytes:
    return b"".join(pframe.marshal(m, channel) for m in methods)


def test_pipelined_declares_are_answered_in_order(shared_node):
    # Names on both shards: their counts come back from different shards, in any order.
    names = [n for i in range(40) for n in names_on_different_shards(f"pipe{i}-{uid('')}")]
    raw = FrameClient(shared_node.port)
    try:
        raw.open_channel(1)
        raw.sock.sendall(_frames(1, *(C.Queue.Declare(queue=n, auto_delete=False) for n in names)))
        got = [raw.expect(1, C.Queue.DeclareOk).queue for _ in names]
        assert got == names
        # Binds, a publish through them, a get: the publish waits for every bind before it.
        x = uid("pipe-x")
        raw.sock.sendall(b"".join((
            _frames(1, C.Exchange.Declare(exchange=x, exchange_type="fanout", auto_delete=False)),
            _frames(1, *(C.Queue.Bind(queue=n, exchange=x, routing_key="") for n in names)),
            raw.publish_frames(1, x, "", b"through every binding"),
        )))
        raw.expect(1, C.Exchange.DeclareOk)
        for _ in names:
            raw.expect(1, C.Queue.BindOk)
        raw.sock.sendall(_frames(1, *(C.Basic.Get(queue=n, no_ack=True) for n in names)))
        for _ in names:
            raw.expect(1, C.Basic.GetOk)
            raw.recv()  # header
            _, body = raw.recv()
            assert body.value == b"through every binding"
        # Deletes in flight together, then a passive declare of each: all gone, in order.
        raw.sock.sendall(_frames(1, *(C.Queue.Delete(queue=n) for n in names), C.Exchange.Delete(exchange=x)))
        for _ in names:
            assert raw.expect(1, C.Queue.DeleteOk).message_count == 0
        raw.expect(1, C.Exchange.DeleteOk)
    finally:
        raw.close()
    conn = shared_node.connect()
    try:
        assert not any(exists(conn, n) for n in names[:4])
    finally:
        conn.close()


def test_nothing_after_a_failed_method_in_the_pipeline_runs(shared_node):
    first, missing, after, later = uid("pipe-a"), uid("pipe-missing"), uid("pipe-b"), uid("pipe-c")
    raw = FrameClient(shared_node.port)
    try:
        raw.open_channel(1)
        raw.sock.sendall(_frames(
            1,
            C.Queue.Declare(queue=first),
            C.Queue.Declare(queue=missing, passive=True),  # 404 closes the channel
            C.Queue.Declare(queue=after),
            C.Exchange.Declare(exchange=later, exchange_type="direct"),
            C.Queue.Bind(queue=first, exchange="amq.direct", routing_key="k"),
        ))
        assert raw.expect(1, C.Queue.DeclareOk).queue == first
        close = raw.expect(1, C.Channel.Close)
        assert close.reply_code == 404, close
        raw.send(1, C.Channel.CloseOk())
        # The channel is usable again after reopening; what was sent behind the error never ran.
        raw.open_channel(1)
        raw.send(1, C.Exchange.Declare(exchange=later, passive=True))
        assert raw.expect(1, C.Channel.Close).reply_code == 404
    finally:
        raw.close()
    conn = shared_node.connect()
    try:
        assert exists(conn, first)
        assert not exists(conn, after)
        ch = conn.channel()
        ch.basic_publish("amq.direct", "k", b"unbound")
        assert ch.queue_declare(first, passive=True).method.message_count == 0
        ch.queue_delete(first)
    finally:
        conn.close()


def test_server_named_queue_then_empty_name_bind_in_one_write(shared_node):
    # An empty queue name means the last declared queue: the bind behind a server-named declare
    # waits for its name even though both were sent at once.
    raw = FrameClient(shared_node.port)
    try:
        raw.open_channel(1)
        raw.sock.sendall(b"".join((
            _frames(1, C.Queue.Declare(queue="", exclusive=True), C.Queue.Bind(queue="", exchange="amq.direct",
                                                                                 routing_key="srv")),
            raw.publish_frames(1, "amq.direct", "srv", b"to the server-named queue"),
            _frames(1, C.Basic.Get(queue="", no_ack=True)),
        )))
        name = raw.expect(1, C.Queue.DeclareOk).queue
        assert name.startswith("amq.gen-")
        raw.expect(1, C.Queue.BindOk)
        assert raw.expect(1, C.Basic.GetOk).routing_key == "srv"
    finally:
        raw.close()


def test_pipelined_deletes_answer_their_own_counts_in_order(shared_node):
    # The node asks the shards for every delete's counts while the deletes before it are still
    # applied (broker/node.py _early_counts): each delete-ok must still carry its own queue's count,
    # in the order sent, from both shards; a queue deleted and declared again in the same burst
    # counts 0 the second time (its count is asked for again, not taken from before).
    names = [n for i in range(30) for n in names_on_different_shards(f"pdel{i}-{uid('')}")]
    conn = shared_node.connect()
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        for i, n in enumerate(names):
            ch.queue_declare(n)
            for _ in range(i % 7):
                ch.basic_publish("", n, b"x")
    finally:
        conn.close()
    again = names[0]
    raw = FrameClient(shared_node.port)
    try:
        raw.open_channel(1)
        raw.sock.sendall(_frames(1, *(C.Queue.Delete(queue=n) for n in names),
                                 C.Queue.Declare(queue=again), C.Queue.Delete(queue=again),
                                 C.Queue.Delete(queue=names[1], if_empty=True)))
        got = [raw.expect(1, C.Queue.DeleteOk).message_count for _ in names]
        assert got == [i % 7 for i in range(len(names))]
        assert raw.expect(1, C.Queue.DeclareOk).message_count == 0
        assert raw.expect(1, C.Queue.DeleteOk).message_count == 0
        # An if-empty delete of a queue deleted earlier in the burst: gone, so nothing to count.
        assert raw.expect(1, C.Queue.DeleteOk).message_count == 0
    finally:
        raw.close()
    conn = shared_node.connect()
    try:
        assert not any(exists(conn, n) for n in names)
    finally:
        conn.close()


def test_delete_right_after_publishes_counts_them(shared_node):
    # Publishes then deletes in one write: the node asks the shards for the counts over the control
    # plane, which must not overtake the publishes still on the frontend's publish lane
    # (frontend/worker.py node_request holds the delete until the shard processed them).
    names = [n for i in range(20) for n in names_on_different_shards(f"pubdel{i}-{uid('')}")]
    raw = FrameClient(shared_node.port)
    try:
        raw.open_channel(1)
        raw.sock.sendall(_frames(1, *(C.Queue.Declare(queue=n) for n in names)))
        for _ in names:
            raw.expect(1, C.Queue.DeclareOk)
        raw.sock.sendall(b"".join((
            *(raw.publish_frames(1, "", n, b"m") for n in names for _ in range(2)),
            _frames(1, *(C.Queue.Delete(queue=n) for n in names)),
        )))
        assert [raw.expect(1, C.Queue.DeleteOk).message_count for _ in names] == [2] * len(names)
    finally:
        raw.close()
