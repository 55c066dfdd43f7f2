"""Real client libraries end to end against a node: pika (blocking), aio-pika (asyncio), kombu.

Each test is a round trip the way an application would write it, with the
library's own defaults (heartbeats, channel numbers, confirm handling).
"""

from __future__ import annotations

import asyncio
import uuid

import aio_pika
import aiormq
import kombu
import pika
import pytest

from tests.helpers import uid

TIMEOUT = 10.0


# -------------------------------------------------------------------------- pika
def test_pika_blocking_rpc_style_round_trip(shared_node):
    """Request on a named queue, reply on an exclusive server-named queue via reply_to/correlation_id."""
    server = shared_node.connect()
    client = shared_node.connect()
    try:
        sch = server.channel()
        requests = sch.queue_declare(uid("rpc"), auto_delete=True).method.queue
        sch.basic_qos(prefetch_count=1)

        def serve(channel, method, props, body):
            channel.basic_publish("", props.reply_to, body.upper(),
                                  pika.BasicProperties(correlation_id=props.correlation_id))
            channel.basic_ack(method.delivery_tag)

        sch.basic_consume(requests, serve)
        cch = client.channel()
        replies = cch.queue_declare("", exclusive=True).method.queue
        answers = {}
        cch.basic_consume(replies, lambda _c, _m, p, b: answers.__setitem__(p.correlation_id, b), auto_ack=True)
        for i in range(20):
            cch.basic_publish("", requests, b"req%d" % i,
                              pika.BasicProperties(reply_to=replies, correlation_id=str(i)))
        deadline = TIMEOUT
        while len(answers) < 20 and deadline > 0:
            server.process_data_events(0.01)
            client.process_data_events(0.01)
            deadline -= 0.02
        assert answers == {str(i): b"REQ%d" % i for i in range(20)}
    finally:
        client.close()
        server.close()


def test_pika_start_consuming_until_cancel(shared_node):
    connection = shared_node.connect()
    try:
        ch = connection.channel()
        q = ch.queue_declare("", exclusive=True).method.queue
        for i in range(5):
            ch.basic_publish("", q, b"%d" % i)
        got = []

        def on_message(channel, method, _props, body):
            got.append(body)
            channel.basic_ack(method.delivery_tag)
            if len(got) == 5:
                channel.stop_consuming()

        ch.basic_consume(q, on_message)
        connection.call_later(TIMEOUT, ch.stop_consuming)  # bound the wait if deliveries never come
        ch.start_consuming()
        assert got == [b"0", b"1", b"2", b"3", b"4"]
    finally:
        connection.close()


def test_pika_consume_generator_with_inactivity_timeout(shared_node):
    connection = shared_node.connect()
    try:
        ch = connection.channel()
        q = ch.queue_declare("", exclusive=True).method.queue
        ch.basic_publish("", q, b"one")
        got = []
        for method, _props, body in ch.consume(q, inactivity_timeout=TIMEOUT):
            assert method is not None, "no delivery within the timeout"
            got.append(body)
            ch.basic_ack(method.delivery_tag)
            break
        assert ch.cancel() == 0  # nothing left pending in pika's buffer
        assert got == [b"one"]
    finally:
        connection.close()


# ---------------------------------------------------------------------- aio-pika
def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_aio_pika_publish_consume_with_confirms(shared_node):
    async def main():
        connection = await aio_pika.connect(shared_node.url, timeout=TIMEOUT)
        async with connection:
            channel = await connection.channel(publisher_confirms=True)
            exchange = await channel.declare_exchange(uid("aio-x"), aio_pika.ExchangeType.TOPIC,
                                                      auto_delete=True)
            queue = await channel.declare_queue(exclusive=True)
            await queue.bind(exchange, "orders.#")
            n = 500
            # Many publishes in flight at once: aio-pika matches each to its ack (multiple or single).
            confirms = await asyncio.gather(*(
                exchange.publish(aio_pika.Message(b"%d" % i, headers={"i": i},
                                                  delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
                                 routing_key=f"orders.eu.{i % 3}")
                for i in range(n)))
            assert all(isinstance(c, aiormq.spec.Basic.Ack) for c in confirms), confirms[:3]
            await channel.set_qos(prefetch_count=50)
            got = []
            async with queue.iterator() as it:
                async for message in it:
                    async with message.process():
                        got.append((message.body, message.headers["i"], message.routing_key))
                    if len(got) == n:
                        break
            assert [b for b, _, _ in got] == [b"%d" % i for i in range(n)]
            assert [h for _, h, _ in got] == list(range(n))
            assert got[4][2] == "orders.eu.1"
            declared = await channel.declare_queue(queue.name, passive=True)
            assert declared.declaration_result.message_count == 0

    run(main())


def test_aio_pika_nack_requeue_and_get(shared_node):
    async def main():
        connection = await aio_pika.connect(shared_node.url, timeout=TIMEOUT)
        async with connection:
            channel = await connection.channel()
            queue = await channel.declare_queue(exclusive=True)
            await channel.default_exchange.publish(aio_pika.Message(b"again"), routing_key=queue.name)
            first = await queue.get(timeout=TIMEOUT)
            assert not first.redelivered
            await first.nack(requeue=True)
            second = await queue.get(timeout=TIMEOUT)
            assert (second.body, second.redelivered) == (b"again", True)
            await second.ack()
            assert await queue.get(fail=False, timeout=TIMEOUT) is None

    run(main())


def test_aio_pika_mandatory_return_raises_with_confirms(shared_node):
    async def main():
        connection = await aio_pika.connect(shared_node.url, timeout=TIMEOUT)
        async with connection:
            channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
            with pytest.raises(aio_pika.exceptions.DeliveryError) as info:
                await channel.default_exchange.publish(aio_pika.Message(b"x"), routing_key=uid("nowhere"),
                                                       mandatory=True)
            assert info.value.message.body == b"x"

    run(main())


# ------------------------------------------------------------------------- kombu
def kombu_url(node) -> str:
    return f"amqp://guest:guest@127.0.0.1:{node.port}//"


def test_kombu_simple_queue_round_trip(shared_node):
    name = uid("kombu-simple")
    with kombu.Connection(kombu_url(shared_node), connect_timeout=TIMEOUT) as conn:
        queue = conn.SimpleQueue(name)
        try:
            queue.put({"task": "add", "args": [2, 3]}, serializer="json")
            message = queue.get(block=True, timeout=TIMEOUT)
            assert message.payload == {"task": "add", "args": [2, 3]}
            assert message.content_type == "application/json"
            message.ack()
            with pytest.raises(queue.Empty):
                queue.get(block=True, timeout=0.2)
        finally:
            queue.consumer.cancel()  # deleting a queue under a consumer gets it a basic.cancel
            queue.queue.delete()
            queue.close()


def test_kombu_celery_style_producer_consumer(shared_node):
    """The shape of a Celery task message: direct exchange, routing key, JSON body, headers, ack."""
    exchange = kombu.Exchange(uid("celery-x"), type="direct", durable=True)
    queue = kombu.Queue(uid("celery"), exchange, routing_key="celery", durable=True)
    task_id = str(uuid.uuid4())
    with kombu.Connection(kombu_url(shared_node), connect_timeout=TIMEOUT) as conn:
        with conn.Producer() as producer:
            producer.publish(
                [[2, 3], {}, {"callbacks": None}], exchange=exchange, routing_key="celery",
                declare=[queue], serializer="json",
                headers={"lang": "py", "task": "tasks.add", "id": task_id},
                correlation_id=task_id, delivery_mode=2, retry=False,
            )
        received = []

        def on_message(body, message):
            received.append((body, message.headers, message.properties.get("correlation_id")))
            message.ack()

        with conn.Consumer(queue, callbacks=[on_message], accept=["json"]):
            conn.drain_events(timeout=TIMEOUT)
        assert received == [([[2, 3], {}, {"callbacks": None}],
                             {"lang": "py", "task": "tasks.add", "id": task_id}, task_id)]
        bound = queue(conn.default_channel)
        assert bound.queue_declare(passive=True).message_count == 0
        bound.delete()
        exchange(conn.default_channel).delete()
