"""Policies, operator policies and vhost limits on a real node.

They are set through a RabbitMQ-style definitions file (``--definitions``)
that the node re-reads on SIGHUP; the node applies changes to existing
queues and exchanges and persists them.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pika
import pytest


def write_defs(path, policies=(), operator_policies=(), limits=None) -> None:
    data = {"policies": list(policies), "operator_policies": list(operator_policies), "parameters": []}
    if limits is not None:
        data["parameters"].append({"vhost": "/", "component": "vhost-limits", "name": "limits", "value": limits})
    path.write_text(json.dumps(data))


def policy(name, pattern, definition, priority=0, apply_to="all"):
    return {"vhost": "/", "name": name, "pattern": pattern, "apply-to": apply_to, "priority": priority,
            "definition": definition}


def reload(node) -> None:
    os.kill(node.pid, signal.SIGHUP)


def eventually(check, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result or time.monotonic() > deadline:
            return result
        time.sleep(0.05)


def get_body(ch, q):
    return ch.basic_get(q, auto_ack=True)[2]


@pytest.fixture
def defs_node(node_factory, tmp_path):
    path = tmp_path / "definitions.json"
    write_defs(path, [policy("ae", "^ae\\.", {"alternate-exchange": "ae-target"}, apply_to="exchanges")])
    node = node_factory(name="pol", frontends=2, shards=2, extra_args=["--definitions", str(path)])
    node.defs_path = path
    return node


def test_alternate_exchange_by_policy_argument_wins_and_reload(defs_node):
    c = defs_node.connect()
    ch = c.channel()
    ch.exchange_declare("ae-target", "fanout")
    ch.exchange_declare("ae-other", "fanout")
    q_target = ch.queue_declare("q-ae-target").method.queue
    q_other = ch.queue_declare("q-ae-other").method.queue
    ch.queue_bind(q_target, "ae-target")
    ch.queue_bind(q_other, "ae-other")
    ch.exchange_declare("ae.main", "direct")
    ch.exchange_declare("ae.arg", "direct", arguments={"alternate-exchange": "ae-other"})
    ch.exchange_declare("plain.main", "direct")
    ch.confirm_delivery()
    ch.basic_publish("ae.main", "unroutable", b"via-policy")
    ch.basic_publish("ae.arg", "unroutable", b"via-argument")
    ch.basic_publish("plain.main", "unroutable", b"dropped")
    assert get_body(ch, q_target) == b"via-policy"
    assert get_body(ch, q_other) == b"via-argument"
    assert get_body(ch, q_target) is None and get_body(ch, q_other) is None

    # Change the policy at runtime: existing exchanges follow it.
    write_defs(defs_node.defs_path, [policy("ae", "^ae\\.", {"alternate-exchange": "ae-other"})])
    reload(defs_node)

    def rerouted():
        ch.basic_publish("ae.main", "unroutable", b"after-change")
        return get_body(ch, q_other) == b"after-change"

    assert eventually(rerouted)
    c.close()


def test_policies_persist_across_restart_without_the_file(defs_node):
    c = defs_node.connect()
    ch = c.channel()
    ch.exchange_declare("ae-target", "fanout", durable=True)
    q = ch.queue_declare("q-persist", durable=True).method.queue
    ch.queue_bind(q, "ae-target")
    ch.exchange_declare("ae.durable", "direct", durable=True)
    c.close()
    defs_node.extra_args = []  # no --definitions: only what the node stored
    defs_node.restart()
    c = defs_node.connect()
    ch = c.channel()
    ch.confirm_delivery()
    ch.basic_publish("ae.durable", "nothing", b"still-policy")
    assert get_body(ch, q) == b"still-policy"
    c.close()


def test_max_length_policy_and_operator_policy_stricter_wins(defs_node):
    write_defs(defs_node.defs_path,
               [policy("len", "^len\\.", {"max-length": 5}, apply_to="queues"),
                policy("len-low", "^len\\.", {"max-length": 1}, priority=-1, apply_to="queues")],
               [policy("op", "^len\\.op", {"max-length": 2}, apply_to="queues")])
    reload(defs_node)
    c = defs_node.connect()
    ch = c.channel()
    ch.confirm_delivery()

    def limited(q: str, n: int) -> bool:
        ch.queue_purge(q)
        for i in range(10):
            ch.basic_publish("", q, b"%d" % i)
        return ch.queue_declare(q, passive=True).method.message_count == n

    q5 = ch.queue_declare("len.five").method.queue
    assert eventually(lambda: limited(q5, 5))  # highest-priority policy: 5, not 1
    q2 = ch.queue_declare("len.op").method.queue
    assert limited(q2, 2)  # operator policy 2 < policy 5
    q3 = ch.queue_declare("len.arg", arguments={"x-max-length": 3}).method.queue
    assert limited(q3, 3)  # argument 3 < policy 5
    q_free = ch.queue_declare("free.q").method.queue
    assert limited(q_free, 10)
    # Removing the policies lifts the limit on existing queues.
    write_defs(defs_node.defs_path, [])
    reload(defs_node)
    assert eventually(lambda: limited(q5, 10))
    c.close()


def test_vhost_max_queues_and_max_connections(defs_node):
    write_defs(defs_node.defs_path, limits={"max-queues": 2, "max-connections": 2})
    reload(defs_node)
    c1 = defs_node.connect()
    ch = c1.channel()

    def limited() -> bool:
        try:
            probe = defs_node.connect()
        except pika.exceptions.AMQPConnectionError:
            return True
        probe.close()
        return False

    c2 = defs_node.connect()
    assert eventually(limited)  # the third connection is refused
    with pytest.raises(pika.exceptions.AMQPConnectionError) as err:
        defs_node.connect()
    args = getattr(err.value, "args", ())
    assert "530" in repr(args) or "connection limit" in repr(args)
    c2.close()
    c2 = defs_node.connect()  # a slot is free again
    ch.queue_declare("mq-1", exclusive=True)
    ch.queue_declare("mq-2", exclusive=True)
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as err2:
        ch.queue_declare("mq-3", exclusive=True)
    assert err2.value.reply_code == 406
    assert err2.value.reply_text == ("PRECONDITION_FAILED - cannot declare queue 'mq-3': queue limit in vhost "
                                     "'/' (2) is reached")
    c1.close()
    c2.close()


def test_expires_policy_deletes_an_unused_queue(node_factory, tmp_path):
    """The node deletes a queue whose `expires` comes from a policy, not only from x-expires."""
    from tests.helpers import wait_queue_gone

    path = tmp_path / "definitions.json"
    write_defs(path, [policy("exp", "^exp\\.", {"expires": 300}, apply_to="queues")])
    node = node_factory(name="exp", frontends=1, shards=2, extra_args=["--definitions", str(path)])
    c = node.connect()
    ch = c.channel()
    ch.confirm_delivery()
    ch.queue_declare("exp.q")
    ch.queue_declare("other.q")
    wait_queue_gone(ch, "exp.q")
    assert ch.queue_declare("other.q", passive=True).method.message_count >= 0  # untouched
    c.close()
