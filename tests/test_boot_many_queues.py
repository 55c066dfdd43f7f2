"""A node booted on a data dir of many durable queues has every one of them, usable (issue #15).

The boot path is not the live one: the node loads definitions.json, and every worker gets the
definitions in one SNAPSHOT whose queues travel as columns (``Definitions.to_dict(queue_columns=True)``)
and which the node drops once every worker applied it. So a restarted frontend or shard after the
boot gets a fresh snapshot, and it must route to, and open, every queue as well.
"""

from __future__ import annotations

import time

import pika
from pamqp import commands

from broker.amqp import encoder
from loadtest.amqp_client import AMQPClient, AMQPClosed
from tests.mgmt_api import Api

N = 1500
MAX_LEN = {"x-max-length": 2}


def _names() -> list[str]:
    return [f"boot-{i:05d}" for i in range(N)]


def _pipelined(c: AMQPClient, methods: list, reply: type) -> list:
    out = []
    for start in range(0, len(methods), 500):
        chunk = methods[start:start + 500]
        c.send(b"".join(encoder.encode_method(1, m) for m in chunk))
        out.extend(c._wait_method(1, reply) for _ in chunk)
    return out


def _connect(node, timeout: float = 30.0) -> AMQPClient:
    """A client once the node (its frontend, maybe restarting) takes connections."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return AMQPClient(node.url.rstrip("/") + "/%2F", timeout=5).connect()
        except (OSError, AMQPClosed):
            assert time.monotonic() < deadline, "the node took no connection"
            time.sleep(0.05)


def _channel(node) -> pika.adapters.blocking_connection.BlockingChannel:
    ch = node.connect().channel()
    ch.confirm_delivery()
    return ch


def _publish(ch, names: list[str], body: bytes, persistent: bool = True) -> None:
    for name in names:
        ch.basic_publish("", name, body, pika.BasicProperties(delivery_mode=2 if persistent else 1))


def _get_each(ch, names: list[str], body: bytes) -> None:
    for name in names:
        method, _props, got = ch.basic_get(name, auto_ack=True)
        assert method is not None and got == body, (name, got)


def _all_there(c: AMQPClient, names: list[str]) -> None:
    oks = _pipelined(c, [commands.Queue.Declare(queue=n, passive=True) for n in names], commands.Queue.DeclareOk)
    assert [ok.queue for ok in oks] == names


def test_every_queue_is_there_and_usable_after_a_boot_and_after_worker_restarts(node_factory):
    node = node_factory(name="node", frontends=1, shards=2)
    names = _names()
    limited = names[::100]  # with x-max-length 2: their arguments must survive the boot
    with _connect(node) as c:
        _pipelined(c, [commands.Queue.Declare(queue=n, durable=True, arguments=MAX_LEN if n in limited else {})
                       for n in names], commands.Queue.DeclareOk)
        _pipelined(c, [commands.Queue.Declare(queue=f"transient-{i}") for i in range(20)], commands.Queue.DeclareOk)
    node.restart()
    api = Api(node.http_port)
    listed = api.wait_for("/api/queues?columns=name,arguments,durable", lambda items: len(items) == N)
    assert sorted(i["name"] for i in listed) == names  # the transient ones died with the old node
    assert {i["name"] for i in listed if i["arguments"] == MAX_LEN} == set(limited)
    with _connect(node) as c:
        _all_there(c, names)
    ch = _channel(node)
    _publish(ch, names[::37], b"after-boot")
    _get_each(ch, names[::37], b"after-boot")
    _publish(ch, [limited[1]] * 3, b"m")  # x-max-length 2 still holds
    assert ch.queue_declare(limited[1], passive=True).method.message_count == 2
    ch.connection.close()

    # A frontend and a shard restarted after the boot get a snapshot of their own (the boot's was
    # dropped once every worker had applied it): all queues are still routed to and open.
    node.wait_worker_restarted("frontend", 0, node.kill_worker("frontend", 0))
    with _connect(node) as c:
        _all_there(c, names)
    ch = _channel(node)
    _publish(ch, names[5::41], b"after-frontend-restart")
    _get_each(ch, names[5::41], b"after-frontend-restart")
    kept = names[7::53]
    _publish(ch, kept, b"kept")  # persistent and confirmed before the shard's kill: still there after
    ch.connection.close()
    node.wait_worker_restarted("shard", 1, node.kill_worker("shard", 1))
    with _connect(node) as c:
        _all_there(c, names)
    ch = _channel(node)
    _get_each(ch, kept, b"kept")
    _publish(ch, names[11::29], b"after-shard-restart")
    _get_each(ch, names[11::29], b"after-shard-restart")
    ch.connection.close()
