"""Channel ends as RabbitMQ orders them: close-ok after the requeue; reopened numbers start clean.

- channel.close-ok is written once every shard the channel used has cancelled its consumers and
  requeued its unacked messages (RabbitMQ's notify_down_all is synchronous), so the client's next
  step, on any connection, sees them back in the queue.
- Shards know a channel by its key (number + 65536 * generation): a CONFIRM or DELIVER a shard
  sent for an earlier opening of the same number is dropped, never applied to the new opening.
"""

from __future__ import annotations

from pamqp import commands as C
from pamqp import frame as pframe
from pamqp import header as pheader
from pamqp.body import ContentBody

from tests.helpers import connections_on_two_frontends, names_on_different_shards, uid
from tests.raw_amqp import RawClient

# Queue names are picked per shard by their crc32 (tests/helpers.py): nodes place by name.
QUEUE_PLACEMENT = "hash"


def test_pika_close_ok_comes_after_the_unacked_messages_are_requeued(shared_node):
    """After channel.close-ok, a basic.get on another frontend finds every unacked message back,
    marked redelivered, on both shards the channel consumed from."""
    a, b = connections_on_two_frontends(shared_node)
    try:
        setup = b.channel()
        setup.confirm_delivery()
        queues = names_on_different_shards(uid("close-requeue"))
        for q in queues:
            setup.queue_declare(q, auto_delete=False)
            for i in range(5):
                setup.basic_publish("", q, b"m%d" % i)
        for _round in range(3):
            consumer = a.channel()
            got: list = []
            for q in queues:
                consumer.basic_consume(q, lambda _c, m, _p, body, got=got: got.append(body), auto_ack=False)
            while len(got) < 10:
                a.process_data_events(0.05)
            consumer.close()  # returns on close-ok
            for q in queues:
                method = setup.queue_declare(q, passive=True).method
                assert method.message_count == 5, (q, method.message_count)
                first = setup.basic_get(q, auto_ack=False)[0]
                assert first is not None and first.redelivered
                setup.basic_nack(first.delivery_tag, requeue=True)
        for q in queues:
            setup.queue_delete(q)
    finally:
        a.close()
        b.close()


def _publish_frames(channel: int, queue: str, body: bytes) -> bytes:
    return b"".join((
        pframe.marshal(C.Basic.Publish(exchange="", routing_key=queue), channel),
        pframe.marshal(pheader.ContentHeader(0, len(body), C.Basic.Properties(delivery_mode=2)), channel),
        pframe.marshal(ContentBody(body), channel),
    ))


def test_a_reopened_channel_number_gets_no_confirm_of_its_previous_opening(shared_node):
    """Persistent publishes to a durable queue are confirmed after a group fsync; the channel is
    closed before they are, and opened again at once: the new opening gets acks for its own
    publishes only (delivery tags from 1 again), never one of the old opening's."""
    q = uid("gen-confirm")
    with RawClient(shared_node.port) as raw:
        raw.handshake()
        raw.open_channel(1)
        raw.send_method(1, C.Queue.Declare(queue=q, durable=True))
        raw.expect(C.Queue.DeclareOk, channel=1)
        for _round in range(5):
            raw.send_method(1, C.Confirm.Select())
            raw.expect(C.Confirm.SelectOk, channel=1)
            raw.send(b"".join(_publish_frames(1, q, b"old%d" % i) for i in range(200))
                     + pframe.marshal(C.Channel.Close(200, "bye", 0, 0), 1))
            while True:  # acks of the old opening may come before its close-ok; nothing after
                got = raw.next_frame(5.0)
                assert got is not None, "no channel.close-ok"
                if isinstance(got[1], C.Channel.CloseOk):
                    break
                assert isinstance(got[1], C.Basic.Ack), got
            raw.open_channel(1)
            raw.send_method(1, C.Confirm.Select())
            raw.expect(C.Confirm.SelectOk, channel=1)
            raw.send(_publish_frames(1, q, b"new"))
            acked = 0
            while acked < 1:
                got = raw.next_frame(5.0)
                assert got is not None, "the new opening's publish was never confirmed"
                ack = got[1]
                assert isinstance(ack, C.Basic.Ack), ack
                assert ack.delivery_tag == 1 and not ack.multiple, ack  # its own, not a late old one
                acked += 1
            assert raw.next_frame(0.3) is None, "an extra ack reached the reopened channel"
        raw.send_method(1, C.Queue.Delete(queue=q))
        raw.expect(C.Queue.DeleteOk, channel=1)
