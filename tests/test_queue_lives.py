"""A shard's late auto-delete request deletes the queue life it names, never a queue declared since.

When the last consumer of an auto-delete queue goes away, its shard asks the node to delete it
(``queue.auto_delete``). The node used to check only that a queue of that name existed, was
auto-delete and had no consumer: a request about a queue that was deleted and declared again
meanwhile deleted the new queue, which never had a consumer, and its messages with it.

The case made here is a client whose connection (its frontend) dies, and which declares its exclusive
auto-delete queue again on a new connection: the node deletes the dead connection's queue at once, the
client's new declare follows, and only then does the shard read that the frontend is gone (it is held
stopped, SIGSTOP, from before the frontend dies until the new declare is in the node's definitions).
The shard reads its control stream in the node's order - the frontend's death, the delete, the new
declare - so it asks for the old queue's auto-delete after the node declared the new one, every time.
"""

from __future__ import annotations

import os
import signal

import pika

from tests.harness import wait_until
from tests.helpers import connections_on_two_frontends, in_thread, thread_result, uid
from tests.mgmt_api import Api

COLOCATE = "off"  # a frontend is killed and a shard stopped: each must be its own process
WAIT = 30.0
N = 5


def _declared(api: Api, name: str) -> bool:
    """Whether the node's definitions hold the queue (the list asks no shard: one is held stopped)."""
    return name in {row["name"] for row in api.get("/api/queues/%2F")}


def test_a_late_auto_delete_of_a_dead_connections_queue_spares_its_redeclared_successor(node_factory):
    # One shard: every queue of the test on the shard that is held. No hang watchdog: the shard is
    # stopped for as long as the steps take on a loaded machine.
    node = node_factory(name="node", frontends=2, shards=1, extra_args=["--shard-hang-timeout", "0"])
    api = Api(node.http_port)
    dying, client = connections_on_two_frontends(node)
    name, barrier = uid("replies"), uid("barrier")
    old = dying.channel()
    old.queue_declare(name, exclusive=True, auto_delete=True)
    old.basic_consume(name, lambda *_: None, auto_ack=True)  # consume-ok: the shard has the consumer
    # A second auto-delete queue of the same shard, its consumer on the frontend that lives: its
    # auto-delete later is the barrier (the node handles its shard's requests in order).
    bch = client.channel()
    bch.queue_declare(barrier, auto_delete=True)
    tag = bch.basic_consume(barrier, lambda *_: None, auto_ack=True)

    shard = node.worker_pid("shard", 0)
    os.kill(shard, signal.SIGSTOP)
    try:
        frontend = int(dying._impl.server_properties["shardmq_frontend"])
        killed = node.kill_worker("frontend", frontend)
        # The connection's exclusive queue goes with it (no shard asked for that): the node's part.
        wait_until(lambda: not _declared(api, name), WAIT, "the dead connection's queue deleted by the node")
        # The client declares it again on its other connection; declare-ok waits for the shard.
        declaring = in_thread(lambda: client.channel().queue_declare(name, exclusive=True, auto_delete=True))
        wait_until(lambda: _declared(api, name), WAIT, "the new declare applied by the node")
    finally:
        os.kill(shard, signal.SIGCONT)
    assert thread_result(*declaring).method.message_count == 0
    node.wait_worker_restarted("frontend", frontend, killed)

    ch = client.channel()
    ch.confirm_delivery()
    for i in range(N):
        ch.basic_publish("", name, b"m%d" % i, pika.BasicProperties(delivery_mode=2))
    # The shard asked about the old queue before it applied the new declare (which declare-ok waited
    # for), and asks about the barrier only now: once the barrier is gone, the node has decided the
    # old queue's request too.
    bch.basic_cancel(tag)
    wait_until(lambda: not _declared(api, barrier), WAIT, "the barrier queue auto-deleted")
    assert _declared(api, name), "the old queue's late auto-delete deleted the queue declared since"
    got = []
    for _ in range(N):
        method, _props, body = ch.basic_get(name, auto_ack=True)
        assert method is not None, f"messages lost: only {got} left"
        got.append(body)
    assert got == [b"m%d" % i for i in range(N)]
    client.close()
    assert "Traceback" not in node.log_text()
