"""Client usage patterns that broke against ShardMQ and work against RabbitMQ 3.10.8 (issue 8).

Each test is the client library's own pattern, named for the client; the expected frames and
their order were checked against a private RabbitMQ (loadtest/rabbitmq.py) on this machine.
"""

from __future__ import annotations

import asyncio

import aio_pika
import aiormq
import amqp
import kombu
import pika
import pytest
from aio_pika.patterns import RPC, JsonRPC

from tests.helpers import uid
from tests.node_clients import run_amqplib

pytestmark = pytest.mark.integration

TIMEOUT = 10.0


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


# ------------------------------------------------ 1. unbind is idempotent
@pytest.mark.parametrize("pattern", [RPC, JsonRPC], ids=["RPC", "JsonRPC"])
def test_aio_pika_rpc_pattern_calls_and_closes(shared_node, pattern):
    """aio_pika.patterns.RPC: its close() cancels, unbinds from the auto-delete `rpc.dlx` headers
    exchange (already gone with the auto-delete result queue), then deletes; RabbitMQ answers
    unbind-ok, so must we, or every RPC client's close fails."""
    method = uid("rpc.method")

    async def main():
        server_conn = await aio_pika.connect(shared_node.url, timeout=TIMEOUT)
        client_conn = await aio_pika.connect(shared_node.url, timeout=TIMEOUT)
        try:
            server = await pattern.create(await server_conn.channel())

            async def multiply(*, x: int, y: int) -> int:
                return x * y

            await server.register(method, multiply, auto_delete=True)
            for _round in range(2):  # a second RPC on a fresh channel after the first one closed
                channel = await client_conn.channel()
                client = await pattern.create(channel)
                results = await asyncio.gather(*(client.call(method, kwargs={"x": i, "y": 3})
                                                 for i in range(25)))
                assert results == [i * 3 for i in range(25)]
                await client.close()
                assert not channel.is_closed, "RPC.close() closed the channel (unbind refused?)"
                await channel.close()
            await server.close()
        finally:
            await client_conn.close()
            await server_conn.close()

    _run(main())


def test_pika_teardown_unbinds_from_what_is_already_gone(shared_node):
    """A test teardown's unbind after the exchange or queue went away: unbind-ok, channel open."""
    conn = shared_node.connect()
    try:
        ch = conn.channel()
        q, x = uid("gone-q"), uid("gone-x")
        ch.queue_declare(q, auto_delete=True)
        ch.exchange_declare(x, "direct", auto_delete=True)
        ch.queue_bind(q, x, "k")
        ch.exchange_delete(x)
        ch.queue_unbind(q, x, "k")  # exchange gone
        ch.queue_delete(q)
        ch.queue_unbind(q, "amq.direct", "k")  # queue gone
        ch.exchange_unbind(uid("nodest"), "amq.direct", "k")  # destination exchange gone
        ch.exchange_unbind("amq.fanout", uid("nosrc"), "k")  # source exchange gone
        assert ch.is_open
        # still refused as RabbitMQ refuses them: the default exchange (403)
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as err:
            ch.queue_unbind(q, "", q)
        assert err.value.reply_code == 403
    finally:
        conn.close()


# ------------------------- 2. delete-ok before the cancel of our own consumer
def test_py_amqp_queue_delete_under_own_consumer_returns_delete_ok(shared_node):
    """py-amqp (kombu's transport) raises ConsumerCancelled out of queue_delete() when the cancel
    overtakes delete-ok; RabbitMQ writes delete-ok first, the cancel after."""
    q = uid("pyamqp-del")
    conn = amqp.Connection(f"127.0.0.1:{shared_node.port}", connect_timeout=TIMEOUT)
    conn.connect()
    try:
        ch = conn.channel()
        ch.queue_declare(q)
        ch.basic_qos(0, 1, False)
        ch.basic_publish(amqp.Message(b"one"), routing_key=q)
        got = []
        tag = ch.basic_consume(q, callback=lambda m: (got.append(m.body), m.channel.basic_ack(m.delivery_tag)))
        conn.drain_events(timeout=TIMEOUT)
        assert got == [b"one"]
        assert ch.queue_delete(q) == 0
        # the cancel comes after delete-ok, as from RabbitMQ (py-amqp raises it where it reads it)
        with pytest.raises(amqp.exceptions.ConsumerCancelled) as cancelled:
            conn.drain_events(timeout=TIMEOUT)
        assert tag in str(cancelled.value)
    finally:
        conn.collect()


def test_kombu_consumer_context_deletes_its_queue(shared_node):
    """kombu: a prefetch-1 consumer acked through the connection, the queue deleted inside the
    consumer's context (a pattern of kombu-based workers' cleanup)."""
    q = kombu.Queue(uid("kombu-del"), routing_key="k", auto_delete=False)
    url = f"amqp://guest:guest@127.0.0.1:{shared_node.port}//"
    with kombu.Connection(url, connect_timeout=TIMEOUT) as conn:
        bound = q(conn.default_channel)
        bound.declare()
        with conn.Producer() as producer:
            producer.publish({"n": 1}, routing_key=q.name, serializer="json")
        seen = []

        def on_message(body, message):
            seen.append(body)
            message.ack()

        with conn.Consumer(bound, callbacks=[on_message], prefetch_count=1):
            conn.drain_events(timeout=TIMEOUT)
            assert seen == [{"n": 1}]
            assert bound.delete() == 0
        assert conn.default_channel.is_open


def test_amqplib_delete_queue_under_own_consumer(shared_node):
    """Node.js amqplib: the consumer's null (cancel) must not overtake deleteQueue()'s reply."""
    result = run_amqplib("amqplib_delete_consumed_queue.js", shared_node.url, uid("amqplib-del"))
    assert result.get("error") is None, result
    assert result["deleted"] == {"messageCount": 0}, result
    assert "cancelled" in result["events"], result


# ---------------------------------- 3. close right after filling the write buffer
def test_amqplib_close_after_filling_the_write_buffer(shared_node):
    """Node.js amqplib writes connection.close ahead of publishes still in its buffer; the node
    answers close-ok and reads (discarding) until the client closes, so the close callback fires."""
    result = run_amqplib("amqplib_close_after_full_buffer.js", shared_node.url)
    assert result.get("closed") is True, result
    assert result["sent"] > 100, result  # the buffer really filled up
    assert result["ms"] < 5000, result
    assert "ECONNRESET" not in result["_stdout"] and "EPIPE" not in result["_stdout"], result


# ------------------------------------------------- 4. channel numbers
def test_aiormq_opens_channel_65535(shared_node):
    """aiormq opens channel 65535 on purpose; RabbitMQ limits the count of open channels only."""

    async def main():
        conn = await aiormq.connect(shared_node.url)
        try:
            channel = await conn.channel(channel_number=65535)
            declared = await channel.queue_declare(uid("ch65535"), auto_delete=True)
            assert declared.queue
            assert channel.number == 65535
            await channel.close()
        finally:
            await conn.close()

    _run(main())


# ---------------------------------------- 5. reply texts longer than 255 bytes
def test_pika_long_queue_name_error_stays_a_channel_error(shared_node):
    """A redeclare mismatch on a 240-character queue name: RabbitMQ cuts the reply text to 252
    bytes + "..." and closes the channel (406); the connection stays up."""
    name = uid("long-") + "x" * 200
    conn = shared_node.connect()
    try:
        ch = conn.channel()
        ch.queue_declare(name, auto_delete=True)
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as err:
            conn.channel().queue_declare(name, durable=True)
        assert err.value.reply_code == 406
        text = err.value.reply_text
        assert text.startswith("PRECONDITION_FAILED - inequivalent arg 'durable' for queue '")
        assert len(text.encode()) == 255 and text.endswith("...")
        assert conn.is_open and ch.is_open
        ch.queue_delete(name)
    finally:
        conn.close()


# ------------------------------------------------- 7. what the server says it can do
def test_server_capabilities_are_rabbitmqs(shared_node):
    """Clients and tools read connection.start's capabilities: the same set and values as
    RabbitMQ 3.10.8 (direct reply-to works, so it says so)."""
    conn = shared_node.connect()
    try:
        caps = conn._impl.server_properties["capabilities"]
    finally:
        conn.close()
    assert caps == {
        "publisher_confirms": True, "exchange_exchange_bindings": True, "basic.nack": True,
        "consumer_cancel_notify": True, "connection.blocked": True, "authentication_failure_close": True,
        "per_consumer_qos": True, "consumer_priorities": True, "direct_reply_to": True,
    }


def test_amq_default_is_not_an_exchange_name_over_amqp(shared_node):
    """`amq.default` names the default exchange in RabbitMQ's management API only: over AMQP,
    RabbitMQ 3.10.8 answers 404 to a publish or a passive declare and 403 to a declare or delete
    (checked against a private RabbitMQ); ShardMQ answers the same."""
    conn = shared_node.connect()
    try:
        expected = [
            (lambda c: (c.basic_publish("amq.default", "q", b"x"), c.queue_declare("", exclusive=True)),
             404, "NOT_FOUND - no exchange 'amq.default' in vhost '/'"),
            (lambda c: c.exchange_declare("amq.default", passive=True),
             404, "NOT_FOUND - no exchange 'amq.default' in vhost '/'"),
            (lambda c: c.exchange_declare("amq.default", "direct", durable=True),
             403, "ACCESS_REFUSED - exchange name 'amq.default' contains reserved prefix 'amq.*'"),
            (lambda c: c.exchange_delete("amq.default"),
             403, "ACCESS_REFUSED - deletion of system exchange 'amq.default' in vhost '/' not allowed"),
        ]
        for action, code, text in expected:
            channel = conn.channel()
            with pytest.raises(pika.exceptions.ChannelClosedByBroker) as err:
                action(channel)
            assert (err.value.reply_code, err.value.reply_text) == (code, text)
    finally:
        conn.close()
