"""The same raw frame sequences against a private RabbitMQ (loadtest/rabbitmq.py) and a ShardMQ
node: the frames that come back must be the same (class, channel, and the fields clients act on).

Each scenario is one of issue 8's client-compatibility items, so a regression shows up as a
difference from RabbitMQ's own answer, not from a guess written into a test.
"""

from __future__ import annotations

import struct

import pytest
from pamqp import commands as C
from pamqp import encode as pencode

from loadtest.rabbitmq import PrivateRabbitMQ
from tests.helpers import uid
from tests.raw_amqp import RawClient, frame, method_payload

pytestmark = pytest.mark.integration


class Client(RawClient):
    """A raw client that announces consumer_cancel_notify, as pika, py-amqp and amqplib do."""

    def send_start_ok(self, mechanism: str = "PLAIN", response: bytes = b"\0guest\0guest") -> None:
        mech = mechanism.encode()
        args = (pencode.field_table({"product": "parity", "capabilities": {"consumer_cancel_notify": True}})
                + bytes((len(mech),)) + mech + struct.pack(">I", len(response)) + response + b"\x05en_US")
        self.send(frame(1, 0, method_payload(10, 11, args)))


@pytest.fixture(scope="module")
def rabbitmq_port():
    rmq = PrivateRabbitMQ(start_timeout=90).start()
    try:
        yield rmq.port
    finally:
        rmq.stop()


def _summary(value) -> tuple:
    name = type(value).__name__
    for field in ("reply_code", "reply_text", "class_id", "method_id", "message_count"):
        if hasattr(value, field):
            name += f" {field}={getattr(value, field)!r}"
    return name


def _drain(c: Client, quiet: float = 0.5) -> list:
    out = []
    while (got := c.next_frame(quiet)) is not None:
        out.append((got[0], _summary(got[1])))
    return out


def _delete_under_own_consumer(port: int, q: str) -> list:
    c = Client(port)
    c.handshake()
    c.open_channel(1)
    c.send_method(1, C.Queue.Declare(queue=q))
    c.expect(C.Queue.DeclareOk)
    c.send_method(1, C.Basic.Consume(queue=q, consumer_tag="t1"))
    c.expect(C.Basic.ConsumeOk)
    c.send_method(1, C.Queue.Delete(queue=q))
    return _drain(c)


def _delete_under_consumer_of_a_client_without_cancel_notify(port: int, q: str) -> list:
    """RabbitMQ sends basic.cancel only to clients that announced consumer_cancel_notify."""
    c = RawClient(port)
    c.handshake()
    c.open_channel(1)
    c.open_channel(2)
    c.send_method(1, C.Queue.Declare(queue=q))
    c.expect(C.Queue.DeclareOk)
    c.send_method(2, C.Basic.Consume(queue=q, consumer_tag="t2"))
    c.expect(C.Basic.ConsumeOk)
    c.send_method(1, C.Queue.Delete(queue=q))
    return _drain(c)


def _unbind_what_is_gone(port: int, q: str) -> list:
    c = Client(port)
    c.handshake()
    c.open_channel(1)
    for method in (C.Queue.Unbind(queue=q, exchange="no-such-x", routing_key="k"),
                   C.Queue.Unbind(queue=q, exchange="amq.direct", routing_key="k"),
                   C.Exchange.Unbind(destination="no-such-x", source="amq.direct", routing_key="k"),
                   C.Queue.Unbind(queue=q, exchange="", routing_key=q)):
        c.send_method(1, method)
    return _drain(c)


def _more_channels_than_channel_max(port: int, q: str) -> list:
    c = Client(port)
    c.handshake(channel_max=2)
    for number in (65535, 7, 1):
        c.send_method(number, C.Channel.Open())
    return _drain(c)


def _long_reply_text(port: int, q: str) -> list:
    c = Client(port)
    c.handshake()
    c.open_channel(1)
    name = q + "-" + "x" * 200
    c.send_method(1, C.Queue.Declare(queue=name, auto_delete=True))
    c.expect(C.Queue.DeclareOk)
    c.send_method(1, C.Queue.Declare(queue=name, durable=True))
    return _drain(c)


@pytest.mark.parametrize("scenario", [_delete_under_own_consumer,
                                      _delete_under_consumer_of_a_client_without_cancel_notify, _unbind_what_is_gone,
                                      _more_channels_than_channel_max, _long_reply_text],
                         ids=lambda f: f.__name__.strip("_"))
def test_same_frames_as_rabbitmq(rabbitmq_port, shared_node, scenario):
    q = uid("parity")
    rabbit = scenario(rabbitmq_port, q)
    ours = [(ch, text.replace(q, "<q>")) for ch, text in scenario(shared_node.port, q)]
    assert ours == [(ch, text.replace(q, "<q>")) for ch, text in rabbit]
