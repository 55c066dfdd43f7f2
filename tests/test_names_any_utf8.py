"""Queue and exchange names beyond pamqp's ASCII pattern (RabbitMQ takes any UTF-8 name up to 255
bytes): every reply that echoes such a name reaches the client, and the connection stays open."""

from __future__ import annotations

import pika
import pytest

from tests.helpers import uid

NAMES = ["é-ü-名前", "q!$%&()*;<=>?[]^{|}~", "tab\there", "x" * 30 + "€" * 70]  # the last: 240 bytes (+ a 12-byte uid)


@pytest.mark.parametrize("suffix", NAMES, ids=["latin", "punctuation", "tab", "250-bytes"])
def test_names_any_utf8_are_declared_bound_echoed_and_returned(conn, suffix):
    queue = uid("q") + suffix
    exchange = ("ë" + suffix)[:120]
    assert len(queue.encode()) <= 255
    ch = conn.channel()
    ch.confirm_delivery()
    assert ch.queue_declare(queue).method.queue == queue  # declare-ok echoes the name
    ch.exchange_declare(exchange, "direct")
    ch.queue_bind(queue, exchange, routing_key="k")
    ch.basic_publish(exchange, "k", b"routed")
    with pytest.raises(pika.exceptions.UnroutableError) as e:  # basic.return echoes it
        ch.basic_publish(exchange, "nowhere", b"unroutable", mandatory=True)
    assert [(m.method.exchange, m.body) for m in e.value.messages] == [(exchange, b"unroutable")]
    method, _props, body = ch.basic_get(queue, auto_ack=True)  # get-ok echoes the exchange
    assert (method.exchange, method.routing_key, body) == (exchange, "k", b"routed")
    assert ch.queue_declare(queue, passive=True).method.message_count == 0
    ch.queue_delete(queue)
    ch.exchange_delete(exchange)
    assert conn.is_open and ch.is_open
