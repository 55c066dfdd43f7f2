"""A real node with ``--ipc-transport unix`` (broker/unixio.py): frontends and shard peers reach the
shards over unix stream sockets, publishes are confirmed and delivered, a dead letter crosses to
another shard, and after ``kill -9`` of a shard the frontend's and the peer's connections come back
by themselves (the transport's unit tests are in tests/test_unixio.py)."""

from __future__ import annotations

import stat
import time

import pika

from tests.harness import Node
from tests.test_worker_crash import connect_retry, drain_ids, name_on_shard

PERSISTENT = pika.BasicProperties(delivery_mode=2)


def publish_confirmed(node: Node, queue: str, bodies: list[bytes]) -> None:
    conn = connect_retry(node)
    ch = conn.channel()
    ch.confirm_delivery()
    for body in bodies:
        ch.basic_publish("", queue, body, PERSISTENT)  # returns once confirmed (raises on a nack)
    conn.close()


def test_a_node_on_the_unix_data_plane_confirms_delivers_dead_letters_and_survives_a_shard_kill(node_factory):
    node = node_factory(frontends=1, shards=2, extra_args=["--ipc-transport", "unix"])
    run = node.data_dir / "run"
    for i in (0, 1):
        assert stat.S_ISSOCK((run / f"shard-{i}.stream").stat().st_mode)
        assert not (run / f"shard-{i}.sock").exists()
    q0, q1 = name_on_shard("u0", 0, 2), name_on_shard("u1", 1, 2)
    conn = node.connect()
    ch = conn.channel()
    ch.queue_declare(q1, durable=True)
    ch.queue_declare(q0, durable=True, arguments={"x-dead-letter-exchange": "",
                                                  "x-dead-letter-routing-key": q1})
    conn.close()

    publish_confirmed(node, q0, [b"a-%03d" % i for i in range(100)])
    publish_confirmed(node, q1, [b"b-%03d" % i for i in range(100)])
    conn = node.connect()
    ch = conn.channel()
    method, _props, body = ch.basic_get(q0)
    assert body == b"a-000"
    ch.basic_reject(method.delivery_tag, requeue=False)  # dead-lettered from shard 0 to shard 1
    conn.close()
    assert drain_ids(node, q0) == [b"a-%03d" % i for i in range(1, 100)]
    deadline = time.monotonic() + 10
    got: list[bytes] = []
    while len(got) < 101:
        got += drain_ids(node, q1)
        assert time.monotonic() < deadline, f"{len(got)} of 101 on {q1}"
    assert sorted(got) == sorted([b"a-000"] + [b"b-%03d" % i for i in range(100)])

    old = node.kill_worker("shard", 1)
    node.wait_worker_restarted("shard", 1, old)
    # The frontend's lanes and shard 0's peer connection reconnect to the new shard 1 on their own.
    deadline = time.monotonic() + 30
    while True:
        try:
            publish_confirmed(node, q1, [b"c-%03d" % i for i in range(50)])
            break
        except (pika.exceptions.NackError, pika.exceptions.AMQPError):
            assert time.monotonic() < deadline, "publishes to the restarted shard were never confirmed"
            time.sleep(0.2)
            drain_ids(node, q1)  # what a nacked attempt may still have stored
    publish_confirmed(node, q0, [b"d-000"])
    conn = node.connect()
    ch = conn.channel()
    method, _props, _body = ch.basic_get(q0)
    ch.basic_reject(method.delivery_tag, requeue=False)  # shard 0 -> restarted shard 1
    conn.close()
    deadline = time.monotonic() + 10
    got = []
    while b"d-000" not in got:
        got += drain_ids(node, q1)
        assert time.monotonic() < deadline, f"the dead letter never reached the restarted shard: {len(got)}"
    assert set(got) >= {b"c-%03d" % i for i in range(50)}
