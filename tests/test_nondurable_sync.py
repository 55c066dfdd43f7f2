"""Non-durable queues are not fsynced (issue #15): the node deletes their directories at its next
start, so an fsync of them bought nothing; a killed shard still finds what they hold in the page
cache. Persistent messages in durable queues are synced as before (tests/test_recovery.py,
tests/test_confirms.py); the store-level check of "no fsync at all" is in tests/test_store.py.
"""

from __future__ import annotations

import os

import pika

from broker.datadir import DELAYED_DIR, name_hash
from shard.synced_mark import NAME as SYNCED_MARK
from tests.harness import wait_until
from tests.helpers import uid, wait_count

# Separate frontend and shard processes (--colocate off, tests/conftest.py): the frontend keeps listening while its shard is killed and restarted.
COLOCATE = "off"

PERSISTENT = pika.BasicProperties(delivery_mode=2)


def _mark(data: str, vhost: str, name: str, under: str = "") -> str:
    return os.path.join(data, under, name_hash(vhost), name_hash(name), SYNCED_MARK)


def _wait_for(predicate, timeout: float, what: str) -> None:
    wait_until(predicate, timeout, what, 0.05)


def test_a_non_durable_queue_is_never_synced_and_survives_a_killed_shard(node_factory):
    node = node_factory(name="node", frontends=1, shards=1)
    conn = node.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    durable, transient = uid("durable"), uid("transient")
    ch.queue_declare(durable, durable=True)
    ch.queue_declare(transient, durable=False)
    # A non-durable delayed-message exchange's store is not fsynced either.
    delayed = uid("delayed")
    ch.exchange_declare(delayed, "x-delayed-message", durable=False, arguments={"x-delayed-type": "direct"})
    ch.queue_bind(transient, delayed, "later")
    ch.basic_publish(delayed, "later", b"in an hour",
                     pika.BasicProperties(delivery_mode=2, headers={"x-delay": 3_600_000}))
    for i in range(50):
        ch.basic_publish("", transient, b"p%d" % i, PERSISTENT)
    ch.basic_publish("", durable, b"t", pika.BasicProperties(delivery_mode=1))  # dirty, no sync asked
    data = str(node.data_dir)
    # The periodic sync (once a second) took the durable queue, dirty since after the transient
    # queue's publishes: the transient queue was dirty at that pass too. A store's synced mark is
    # written right after its fsync, so the durable queue's mark says that pass ran...
    _wait_for(lambda: os.path.exists(_mark(data, "/", durable)), 10, "the periodic sync of the durable queue")
    # ... and a confirmed persistent publish waits for the next group sync, which starts only after
    # that pass has finished every store in it.
    ch.basic_publish("", durable, b"p", PERSISTENT)
    assert os.path.isdir(os.path.dirname(_mark(data, "/", transient)))
    assert not os.path.exists(_mark(data, "/", transient))
    assert os.path.isdir(os.path.dirname(_mark(data, "/", delayed, DELAYED_DIR)))
    assert not os.path.exists(_mark(data, "/", delayed, DELAYED_DIR))
    wait_count(ch, transient, 50)
    conn.close()

    # What a killed shard left in the page cache is still there: the non-durable queue's persistent
    # messages are back (its transient ones would be dropped, as after any shard crash).
    old = node.kill_worker("shard", 0)
    node.wait_worker_restarted("shard", 0, old)
    conn = node.connect()
    ch = conn.channel()
    wait_count(ch, transient, 50)
    wait_count(ch, durable, 1)
    got = [ch.basic_get(transient, auto_ack=True)[2] for _ in range(50)]
    assert got == [b"p%d" % i for i in range(50)]
    conn.close()
