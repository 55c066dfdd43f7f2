"""queue.delete with if-empty or if-unused never deletes a queue whose counts its shard did not give.

The node asks the queue's shard for its messages and consumers before a delete; a shard that does not
answer within the node's query timeout (stalled, restarting) made the answer "none", so an if-empty
delete of a queue holding messages deleted it with them (delete-ok, message_count 0). The shard is
held stopped (SIGSTOP) until the client has its answer: the node's timeout passes every time.
"""

from __future__ import annotations

import os
import signal
import threading

import pika
import pika.exceptions
import pytest

from tests.harness import wait_until
from tests.helpers import uid
from tests.mgmt_api import Api

COLOCATE = "off"  # the shard is stopped: its frontend (a paired process otherwise) must go on serving
WAIT = 30.0


def _declared(api: Api, name: str) -> bool:
    """Whether the node's definitions hold the queue (the list asks no shard: it is held stopped)."""
    return name in {row["name"] for row in api.get("/api/queues/%2F")}


@pytest.mark.parametrize("condition", ["if_empty", "if_unused"])
def test_a_conditional_delete_keeps_the_queue_when_its_shard_does_not_answer(node_factory, condition):
    node = node_factory(name="node", frontends=1, shards=1, extra_args=["--shard-hang-timeout", "0"])
    api = Api(node.http_port)
    conn = node.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    name = uid("kept")
    ch.queue_declare(name, durable=True)
    for i in range(3):
        ch.basic_publish("", name, b"m%d" % i, pika.BasicProperties(delivery_mode=2))
    consumer = node.connect()
    if condition == "if_unused":
        consumer.channel().basic_consume(name, lambda *_: None)  # consume-ok: the shard has it
    deleter = node.connect()
    out: list = []

    def delete() -> None:
        try:
            out.append(deleter.channel().queue_delete(name, **{condition: True}))
        except Exception as exc:  # the expected answer is a channel error
            out.append(exc)

    shard = node.worker_pid("shard", 0)
    os.kill(shard, signal.SIGSTOP)
    try:
        t = threading.Thread(target=delete, daemon=True)
        t.start()
        # Once the node's query to the stopped shard timed out: refused (answered at once), or deleted
        # (gone from the node's definitions; delete-ok waits for the shard to apply it).
        wait_until(lambda: out or not _declared(api, name), WAIT, "the node's decision")
    finally:
        os.kill(shard, signal.SIGCONT)
    t.join(WAIT)
    assert out, "the delete got no answer"
    assert isinstance(out[0], pika.exceptions.ChannelClosedByBroker), f"deleted unchecked: {out[0]}"
    assert out[0].reply_code == 404 and "did not answer" in out[0].reply_text
    assert _declared(api, name)
    consumer.close()  # its unacked messages (if_unused) go back
    wait_until(lambda: ch.queue_declare(name, passive=True).method.message_count == 3, WAIT,
               "the three messages ready in the kept queue")
    conn.close()
    deleter.close()
    assert "Traceback" not in node.log_text()
