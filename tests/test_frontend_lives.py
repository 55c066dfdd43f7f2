"""A shard's confirm for a killed frontend's connection does not ack a connection of the frontend's next life.

A shard answers CONFIRM [conn_id, channel, seqs] to the frontend's identity ``fe-N``, which the
restarted frontend takes over. When the frontend dies the node tells the shard (WORKER_DOWN), which
forgets the confirms it holds for it, but not those of a group sync already running: they go out when
the sync ends. Connection ids restarted at 1 with each life of a frontend, so such a late confirm
acked the publish of whichever new connection had the dead one's id, before its own shard had stored
it durably. Here shard 0's sync is held (SHARDMQ_TEST_STALL_FSYNC_WHILE's ``.shard-0`` twin) while a
connection's publish waits on it; the frontend is killed and restarted; new connections publish to
a queue of shard 1, whose syncs are held too, so none of them may be confirmed; then shard 0's sync
is released.
"""

from __future__ import annotations

import time
from pathlib import Path

import pika
from pamqp import commands as C
from pamqp import frame as pframe
from pamqp import header as pheader
from pamqp.body import ContentBody

from tests.helpers import WAIT, count, names_on_different_shards, uid, wait_count
from tests.mgmt_api import Api
from tests.raw_amqp import RawClient

QUEUE_PLACEMENT = "hash"  # names picked per shard (tests/helpers.py)
COLOCATE = "off"  # one role's process is killed (or stopped) while the other of its index lives on

_SERIAL = (1 << 24) - 1  # a connection id's count within its frontend life (frontend/worker.py)


def _confirming(port: int) -> RawClient:
    deadline = time.monotonic() + WAIT
    while True:
        try:
            c = RawClient(port, timeout=10)
            c.handshake()
            break
        except OSError:  # the restarted frontend is not listening yet
            assert time.monotonic() < deadline, "the frontend did not listen again"
            time.sleep(0.05)
    c.open_channel(1)
    c.send_method(1, C.Confirm.Select())
    c.expect(C.Confirm.SelectOk, channel=1)
    return c


def _publish_persistent(c: RawClient, queue: str, body: bytes) -> None:
    c.send(pframe.marshal(C.Basic.Publish(exchange="", routing_key=queue), 1)
           + pframe.marshal(pheader.ContentHeader(0, len(body), C.Basic.Properties(delivery_mode=2)), 1)
           + pframe.marshal(ContentBody(body), 1))


def test_a_late_confirm_for_a_killed_frontends_connection_acks_nothing_in_its_next_life(node_factory, tmp_path):
    stall = tmp_path / "stall"
    node = node_factory(frontends=1, shards=2, env={"SHARDMQ_TEST_STALL_FSYNC_WHILE": str(stall)},
                        extra_args=["--stats-interval", "100"])  # the connection list, for the dead one's id
    q0, q1 = names_on_different_shards(uid("q"))
    with node.connect() as conn:  # connection 1 of the frontend's first life
        ch = conn.channel()
        ch.queue_declare(q0, durable=True)
        ch.queue_declare(q1, durable=True)
    held0, held1 = Path(f"{stall}.shard-0"), Path(f"{stall}.shard-1")
    held0.touch()
    held1.touch()
    try:
        old = _confirming(node.port)
        _publish_persistent(old, q0, b"old")
        port = old.sock.getsockname()[1]
        rows = Api(node.http_port).wait_for("/api/connections", lambda rows: any(r["peer_port"] == port for r in rows))
        serial = next(r["conn_id"] for r in rows if r["peer_port"] == port) & _SERIAL
        assert serial < 50, serial
        with node.connect() as conn:
            wait_count(conn.channel(), q0, 1)  # stored; its confirm waits on shard 0's held sync
        node.wait_worker_restarted("frontend", 0, node.kill_worker("frontend", 0))
        old.close()

        # As many new connections as the dead one's count in its life, and some: ids that restarted at 1
        # give one of them the dead connection's id.
        new = [_confirming(node.port) for _ in range(serial + 2)]
        for i, c in enumerate(new):
            _publish_persistent(c, q1, b"new%d" % i)  # delivery tag 1 on each; shard 1 cannot confirm it
        held0.unlink()  # shard 0's sync ends: its confirm for the dead connection goes out
        with node.connect() as conn:  # ... before this one's, from the same shard to the same frontend
            ch = conn.channel()
            ch.confirm_delivery()
            ch.basic_publish("", q0, b"probe", pika.BasicProperties(delivery_mode=2))
            wait_count(ch, q1, len(new))
        for i, c in enumerate(new):
            got = c.next_frame(timeout=0.05)
            assert got is None, f"new connection {i} got {got!r} while its message's shard cannot confirm it"
    finally:
        held0.unlink(missing_ok=True)
        held1.unlink(missing_ok=True)
    for c in new:  # shard 1's sync now ends: each gets its own confirm
        ack = c.expect(C.Basic.Ack, channel=1, timeout=WAIT)
        assert ack.delivery_tag == 1
        c.close()
    with node.connect() as conn:
        assert count(conn.channel(), q1) == len(new)
