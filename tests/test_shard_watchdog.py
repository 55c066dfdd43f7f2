"""A hung shard (alive, silent) is noticed by its node, logged, killed and restarted (broker/shard_watchdog.py).

Shard 1 is SIGSTOPped: its process lives on and holds its queue, so the supervisor, which restarts
crashed workers, sees nothing. Its reports to the node (every --stats-interval) stop; after
--shard-hang-timeout the node logs it and kills it, the supervisor restarts it, and the queue works
again with what was confirmed before. Shard 0, healthy and idle all along, is left alone.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import pika

from tests.helpers import WAIT, names_on_different_shards, uid

QUEUE_PLACEMENT = "hash"  # names picked per shard (tests/helpers.py)

HUNG = "has sent nothing for"  # broker/shard_watchdog.py's log line


def test_a_stopped_shard_is_noticed_killed_and_restarted(node_factory):
    node = node_factory(frontends=1, shards=2,
                        extra_args=["--stats-interval", "200", "--shard-hang-timeout", "1"])
    q = names_on_different_shards(uid("q"))[1]
    conn = node.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare(q, durable=True)
    ch.basic_publish("", q, b"before", pika.BasicProperties(delivery_mode=2))
    conn.close()
    healthy = node.worker_pid("shard", 0)
    hung = node.worker_pid("shard", 1)

    os.kill(hung, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + WAIT
        while HUNG not in node.log_text():
            assert time.monotonic() < deadline, f"the hung shard was not noticed:\n{node.log_tail()}"
            time.sleep(0.05)
    finally:
        with contextlib.suppress(ProcessLookupError):  # killed and gone: fine; alive: not left stopped
            os.kill(hung, signal.SIGCONT)
    assert f"shard 1 (pid {hung}) {HUNG}" in node.log_text()
    node.wait_worker_restarted("shard", 1, hung)

    conn = node.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    ch.basic_publish("", q, b"after", pika.BasicProperties(delivery_mode=2))  # confirmed by the new shard 1
    got = [ch.basic_get(q, auto_ack=True)[2] for _ in range(2)]
    assert got == [b"before", b"after"]
    conn.close()
    assert node.worker_pid("shard", 0) == healthy
    assert node.log_text().count(HUNG) == 1
