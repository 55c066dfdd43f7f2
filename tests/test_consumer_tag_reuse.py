"""A consumer tag cancelled with basic.cancel nowait can be consumed again at once on the same
channel, as RabbitMQ allows (3.10.8 answers the second consume-ok and delivers everything; ShardMQ
closed the connection with 530 "attempt to reuse consumer tag" until the shard had answered the
cancel). Each instance of the tag has its own delivery credit: what the frontend held back for the
older instance, and the deliveries that older instance still had on their way, never turn into
credit for the new one (docs/architecture.md "Delivery credit"). Were they credited to it, the new
consumer would hold more than a window: a client that stops reading would still be sent that much
more."""

from __future__ import annotations

import pika
import pytest
from pamqp import commands, frame

from frontend.amqp.connection import CREDIT_RETURN_AT
from tests.test_paused_consumer_credit import BODY, TCPAMQP, _flood_and_check, _ready, _until_paused

pytestmark = pytest.mark.integration

CYCLES = 4
# Small messages (one credit each) per instance of the tag: the frontend holds back their credit until
# a lump of CREDIT_RETURN_AT, which the last instance's deliveries complete (were the older instances'
# credit counted for it, that lump would give it (CYCLES - 1) * PER_INSTANCE credits it never spent).
PER_INSTANCE = CREDIT_RETURN_AT // CYCLES


def _read_delivery(client: TCPAMQP) -> tuple[commands.Basic.Deliver, bytes]:
    deliver = client.read()
    assert isinstance(deliver, commands.Basic.Deliver), deliver
    size = client.read().body_size
    body = b""
    while len(body) < size:
        body += client.read().value
    return deliver, body


def _cancel_and_consume_again(client: TCPAMQP, queue: str, tag: str, no_ack: bool = True) -> None:
    """basic.cancel nowait and basic.consume with the same tag, in one write (no answer waited for)."""
    client.send_binary(frame.marshal(commands.Basic.Cancel(consumer_tag=tag, nowait=True), 1)
                       + frame.marshal(commands.Basic.Consume(queue=queue, consumer_tag=tag, no_ack=no_ack), 1))
    ok = client.read()
    assert isinstance(ok, commands.Basic.ConsumeOk), ok  # was Connection.Close 530 NOT_ALLOWED
    assert ok.consumer_tag == tag


def test_a_tag_cancelled_with_nowait_is_consumed_again_at_once_and_its_credit_is_its_own(node_factory):
    node = node_factory(name="node", frontends=1, shards=1, extra_args=["--stats-interval", "100"])
    queue, tag = "reused", "same-tag"
    client = TCPAMQP(node.port)
    client.open()
    client.send(1, commands.Queue.Declare(queue=queue))
    assert isinstance(client.read(), commands.Queue.DeclareOk)
    client.send(1, commands.Basic.Consume(queue=queue, consumer_tag=tag, no_ack=True))
    assert isinstance(client.read(), commands.Basic.ConsumeOk)
    conn = pika.BlockingConnection(pika.URLParameters(node.url))
    ch = conn.channel()
    ch.confirm_delivery()

    n = 0
    for cycle in range(CYCLES):
        if cycle:
            _cancel_and_consume_again(client, queue, tag)
        for _ in range(PER_INSTANCE):
            ch.basic_publish("", queue, b"%08d" % n)
            n += 1
        for i in range(n - PER_INSTANCE, n):
            deliver, body = _read_delivery(client)
            assert (deliver.consumer_tag, body) == (tag, b"%08d" % i)
    assert _ready(ch, queue) == 0

    # Now the last instance's client stops reading: once its connection pauses the frontend holds no
    # more than its transport's buffer for it (with the older instances' credit the shard would go on
    # for (CYCLES - 1) * PER_INSTANCE credits more: 1.5 MB, 23 of these 64 KiB bodies).
    def publish(i: int) -> None:
        ch.basic_publish("", queue, b"%08d" % i + b"x" * (BODY - 8))

    paused_at = _until_paused(publish, ch, queue)
    total = _flood_and_check(node, publish, ch, queue, paused_at)  # the frontend's buffer for it: bounded

    # Reading again, the client gets every one, in order, once.
    for i in range(total):
        deliver, body = _read_delivery(client)
        assert body[:8] == b"%08d" % i, (i, body[:8])
    assert _ready(ch, queue) == 0
    conn.close()
    client.sock.close()
