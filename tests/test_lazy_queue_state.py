"""An empty queue holds no containers of its own; they are made on first use and work from then on.

A shard holds 100,000 idle queues cheaply because an empty queue shares empty defaults (its
consumer list, unacked map, requeue heap, pending acks, fd lists) and makes the synced mark and
the msgs path only when used (docs/architecture.md "Memory per queue"). These tests check both
halves: the unit tests that a new store and queue (just declared, or opened again from an empty
directory) hold the shared defaults and that using them never writes into those shared objects;
the node test that every queue feature works on queues that were created empty, declared now and
recovered from disk after a restart.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pika
import pytest

from shard import store as store_mod
from shard.consumers import ChannelRef, Consumer
from shard.queue import NO_UNACKED, Queue
from shard.segment import DATA_START, PLACEHOLDER
from shard.store import QueueStore, make_queue_dir
from tests.helpers import WAIT

PERSISTENT = pika.BasicProperties(delivery_mode=2)


# ------------------------------------------------------------------------------------ unit: store
def _assert_idle(store: QueueStore) -> None:
    assert not hasattr(store, "__dict__")  # slots: no per-instance dict
    assert store._requeued == () and store._sync_fds == () and store._ack_fds == ()
    assert store._deferred_close == () and store._ack_pending is store_mod._NO_ACKS
    assert store._synced is None and store._wseg is PLACEHOLDER and store._segs == {}
    assert store._wseg.fd == -1 and store._dir_fd == -1 and store._mark_fd == -1  # no fd per idle queue


def _use(store: QueueStore) -> None:
    """Append, shift, ack, requeue, flush, sync and close a store; what it reads back is right."""
    ids = [store.append(0, 1, "", "k", b"", f"m{i}".encode()) for i in range(3)]
    assert [store.shift()[7] for _ in range(3)] == [b"m0", b"m1", b"m2"]
    assert store.ack(ids[0])
    assert store.requeue(ids[1])
    msg = store.shift()
    assert msg[0] == ids[1] and msg[1] is True  # redelivered
    assert store.ack(ids[1]) and store.ack(ids[2])
    store.flush_acks()
    store.sync()
    assert store.ready == 0 and not store.dirty
    store.close()


@pytest.mark.parametrize("fsync", [True, False])
def test_new_and_reopened_empty_store_share_defaults_and_work(tmp_path, fsync):
    path, made = make_queue_dir(str(tmp_path), "/", "q")
    assert made
    fresh = QueueStore(path, empty_dir=True, fsync=fsync)
    _assert_idle(fresh)
    fresh.close()
    reopened = QueueStore(path, fsync=fsync)  # recovery of an empty directory
    _assert_idle(reopened)
    _use(reopened)
    again = QueueStore(path, fsync=fsync)  # recovered with acked segments: nothing comes back
    assert again.ready == 0 and again.shift() is None
    again.close()
    # The shared defaults were never written.
    assert store_mod._NO_ACKS == {} and store_mod._NO_SEGS == {}
    assert (PLACEHOLDER.fd, PLACEHOLDER.used, PLACEHOLDER.count, PLACEHOLDER.mm) == (-1, DATA_START, 0, None)
    with pytest.raises(AttributeError):
        PLACEHOLDER.used = 100


# ------------------------------------------------------------------------------------ unit: queue
def test_empty_queue_makes_its_consumer_list_and_unacked_map_on_first_use(tmp_path):
    path, _ = make_queue_dir(str(tmp_path), "/", "q")
    defn = SimpleNamespace(durable=True, auto_delete=False, arguments={})
    q = Queue(1, "/", "q", defn, QueueStore(path, empty_dir=True))
    other = Queue(2, "/", "other", defn, QueueStore(make_queue_dir(str(tmp_path), "/", "other")[0], empty_dir=True))
    assert q.consumers == () and q.unacked is NO_UNACKED and q.arguments is defn.arguments
    sent: list[list] = []
    q.deliver(lambda fe, item: sent.append(item))  # no consumers: nothing happens
    chan = ChannelRef(b"fe", 1, 1)
    c = Consumer(chan, "ctag", False, False, 10, {})
    q.add_consumer(c)
    assert q.consumers == [c]
    for i in range(3):
        q.store.append(0, 1, "", "k", b"", f"m{i}".encode())
    q.deliver(lambda fe, item: sent.append(item))
    assert [item[-1] for item in sent] == [b"m0", b"m1", b"m2"]
    assert q.unacked is not NO_UNACKED and len(q.unacked) == 3
    ids = [item[5] for item in sent]
    assert q.ack(ids[0], b"fe", 1, 1)
    assert q.nack(ids[1], b"fe", 1, 1, requeue=True)
    q.remove_consumer(c)
    assert q.consumers == [] and not q.remove_consumer(c)
    got = q.get(chan, no_ack=False)  # basic.get of the requeued one: redelivered
    assert got[1] == ids[1] and got[2] is True
    assert q.requeue_owned(lambda owner: owner.chan is chan) == 2
    assert q.store.ready == 2
    # The other queue still shares the untouched defaults.
    assert other.consumers == () and other.unacked is NO_UNACKED and NO_UNACKED == {}
    assert other.get(chan, no_ack=False) is None and other.unacked is NO_UNACKED
    q.store.close()
    other.store.close()


# ------------------------------------------------------------------------------------ node
def _declare(ch, name: str) -> dict[str, str]:
    """A plain queue, a TTL queue and a max-length queue (both dead-lettering) named after ``name``."""
    names = {k: f"{name}-{k}" for k in ("plain", "ttl", "maxlen", "dead")}
    ch.queue_declare(names["dead"], durable=True)
    ch.queue_declare(names["plain"], durable=True)
    ch.queue_declare(names["ttl"], durable=True, arguments={
        "x-message-ttl": 50, "x-dead-letter-exchange": "", "x-dead-letter-routing-key": names["dead"]})
    ch.queue_declare(names["maxlen"], durable=True, arguments={
        "x-max-length": 2, "x-dead-letter-exchange": "", "x-dead-letter-routing-key": names["dead"]})
    return names


def _get_body(ch, queue: str) -> bytes:
    """The next message of ``queue`` (acked), waiting for one up to WAIT seconds."""
    deadline = time.monotonic() + WAIT
    while True:
        method, _props, body = ch.basic_get(queue)
        if method is not None:
            ch.basic_ack(method.delivery_tag)
            return body
        assert time.monotonic() < deadline, f"nothing arrived in {queue}"
        time.sleep(0.02)


def _exercise(conn, names: dict[str, str]) -> None:
    """First use of empty queues: publish, consume with acks, requeue, get, TTL, max-length, DLX."""
    ch = conn.channel()
    ch.confirm_delivery()
    plain = names["plain"]
    # A per-message TTL on the plain queue turns it into a feature queue (shard/feature_queue.py upgrade).
    ch.basic_publish("", plain, b"expiring", pika.BasicProperties(delivery_mode=2, expiration="1"))
    for i in range(3):
        ch.basic_publish("", plain, f"m{i}".encode(), PERSISTENT)
    consumer = conn.channel()
    consumer.basic_qos(prefetch_count=10)
    got: list[tuple[int, bytes, bool]] = []
    tag = consumer.basic_consume(plain, lambda _c, m, _p, b: got.append((m.delivery_tag, b, m.redelivered)))
    deadline = time.monotonic() + WAIT
    while len(got) < 3:
        assert time.monotonic() < deadline, got
        conn.process_data_events(time_limit=0.05)
    assert [b for _t, b, _r in got] == [b"m0", b"m1", b"m2"]  # the expired one never came
    consumer.basic_ack(got[0][0])
    consumer.basic_nack(got[1][0], requeue=True)
    while len(got) < 4:
        assert time.monotonic() < deadline, got
        conn.process_data_events(time_limit=0.05)
    assert got[3][1:] == (b"m1", True)
    consumer.basic_ack(got[2][0])
    consumer.basic_ack(got[3][0])
    consumer.basic_cancel(tag)
    assert ch.queue_declare(plain, passive=True).method.message_count == 0
    ch.basic_publish("", plain, b"by-get", PERSISTENT)
    assert _get_body(ch, plain) == b"by-get"
    # TTL: the message is dead-lettered on expiry.
    ch.basic_publish("", names["ttl"], b"too-late", PERSISTENT)
    assert _get_body(ch, names["dead"]) == b"too-late"
    # max-length 2, drop-head: the oldest goes to the dead-letter queue.
    for i in range(3):
        ch.basic_publish("", names["maxlen"], f"x{i}".encode(), PERSISTENT)
    assert _get_body(ch, names["dead"]) == b"x0"
    assert [_get_body(ch, names["maxlen"]) for _ in range(2)] == [b"x1", b"x2"]
    ch.close()
    consumer.close()


def test_queues_created_empty_work_on_first_use_declared_and_recovered(node_factory):
    node = node_factory(name="node", frontends=1, shards=2)
    conn = node.connect()
    ch = conn.channel()
    now = _declare(ch, "now")
    later = _declare(ch, "later")  # stays empty until after the restart
    _exercise(conn, now)
    conn.close()
    assert node.stop() == 0
    node.start()
    conn = node.connect()
    _exercise(conn, later)  # recovered from (empty) directories
    _exercise(conn, now)  # recovered after use: emptied segments, ack files
    conn.close()
