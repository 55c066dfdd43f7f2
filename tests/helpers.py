"""Helpers shared by the pika tests on a real node: names, counts and bounded polls.

The ``conn`` and ``ch`` fixtures that go with them live in tests/conftest.py.
"""

from __future__ import annotations

import threading
import time
import uuid
import zlib

import pytest
from pika.exceptions import ChannelClosedByBroker, UnroutableError

from tests.harness import wait_until

WAIT = 10.0


def uid(prefix: str = "q") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def names_on_different_shards(prefix: str, shards: int = 2) -> list[str]:
    """One queue name per shard under --queue-placement hash: crc32(vhost + NUL + name) % shards
    (docs/architecture.md); a module using it sets QUEUE_PLACEMENT = "hash" (tests/conftest.py)."""
    found: dict[int, str] = {}
    i = 0
    while len(found) < shards:
        name = f"{prefix}-{i}"
        found.setdefault(zlib.crc32(f"/\0{name}".encode()) % shards, name)
        i += 1
    return [found[s] for s in range(shards)]


def same_shard_name(queue: str, shards: int = 2, prefix: str = "barrier") -> str:
    """A fresh queue name placed on the same shard as ``queue`` (under QUEUE_PLACEMENT = "hash")."""
    want = zlib.crc32(f"/\0{queue}".encode()) % shards
    while True:
        name = uid(prefix)
        if zlib.crc32(f"/\0{name}".encode()) % shards == want:
            return name


def control_lane_barrier(conn, queue: str, shards: int = 2) -> None:
    """Return once the shard of ``queue`` has handled what ``conn`` sent it on the control lane.

    Acks, nacks and credit travel a frontend's control lane, publishes its publish lane; the shard
    handles a frontend's publish batch after the control items put before it (docs/architecture.md),
    but nothing orders the lanes of two frontends. A basic.consume travels the same ordered control lane and its
    consume-ok comes from the shard, so once it is answered every earlier ack of this connection
    to that shard has been handled. The barrier queue is empty and deleted again.
    """
    channel = conn.channel()
    name = same_shard_name(queue, shards)
    channel.queue_declare(name, auto_delete=True)
    tag = channel.basic_consume(name, lambda *_: None)
    channel.basic_cancel(tag)
    channel.close()


def count(ch, queue: str) -> int:
    return ch.queue_declare(queue, passive=True).method.message_count


def wait_count(ch, queue: str, want: int, timeout: float = WAIT) -> None:
    wait_until(lambda: count(ch, queue) == want, timeout, f"{queue} to hold {want} messages",
               context=lambda: f"it has {count(ch, queue)}")


def wait_queue_gone(ch, queue: str, timeout: float = WAIT) -> None:
    """Wait until `queue` is deleted, probing with mandatory publishes on the confirm-mode channel `ch`.

    Not with a passive queue.declare: like RabbitMQ, a declare counts as use and renews x-expires.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            ch.basic_publish("", queue, b"probe", mandatory=True)
        except UnroutableError:
            return
        assert time.monotonic() < deadline, f"{queue} is still there after {timeout}s"
        time.sleep(0.05)


def reject_all(conn, ch, queue: str, n: int, timeout: float = WAIT) -> None:
    """Consume `queue`'s n messages on ch (prefetch n) and reject each without requeue (dead-letters them)."""
    ch.basic_qos(prefetch_count=n)
    tags: list[int] = []
    ch.basic_consume(queue, lambda c, m, p, b: tags.append(m.delivery_tag))
    deadline = time.monotonic() + timeout
    while len(tags) < n:
        assert time.monotonic() < deadline, f"got {len(tags)} of {n}"
        conn.process_data_events(time_limit=0.05)
    for tag in tags:
        ch.basic_reject(tag, requeue=False)


def get_one(ch, queue: str, timeout: float = WAIT, auto_ack: bool = True):
    """basic.get until a message arrives (bounded); (method, properties, body)."""
    deadline = time.monotonic() + timeout
    while True:
        method, props, body = ch.basic_get(queue, auto_ack=auto_ack)
        if method is not None:
            return method, props, body
        assert time.monotonic() < deadline, f"nothing arrived in {queue} within {timeout}s"
        time.sleep(0.02)


def channel_error(conn, action) -> tuple[int, str]:
    """Run ``action(channel)`` on a fresh channel and return the channel.close code and text."""
    channel = conn.channel()
    with pytest.raises(ChannelClosedByBroker) as info:
        action(channel)
    return info.value.reply_code, info.value.reply_text


def connections_on_two_frontends(node, attempts: int = 40):
    """Two pika connections served by different frontend processes (SO_REUSEPORT spreads them)."""
    by_frontend = {}
    for _ in range(attempts):
        connection = node.connect()
        frontend = connection._impl.server_properties["shardmq_frontend"]
        if frontend in by_frontend:
            connection.close()
            continue
        by_frontend[frontend] = connection
        if len(by_frontend) == 2:
            return list(by_frontend.values())
    for connection in by_frontend.values():
        connection.close()
    pytest.fail(f"{attempts} connections all landed on frontend(s) {sorted(by_frontend)}")


def flood_thread(url: str, queue: str, body: bytes, chunk: int, stop, published: list, errors: list):
    """A daemon thread that publishes `body` to `queue` unconfirmed, `chunk` frames per send, until
    `stop` is set; it counts into published[0] and appends what it raised to `errors`."""
    import threading

    from broker.amqp import encoder
    from loadtest.amqp_client import AMQPClient

    def flood() -> None:
        try:
            with AMQPClient(url, timeout=30.0).connect() as pub:
                frames = encoder.encode_publish(1, "", queue, False, b"\x00\x00", body, pub.frame_max) * chunk
                while not stop.is_set():
                    pub.send(frames)
                    published[0] += chunk
        except Exception as exc:
            errors.append(exc)

    return threading.Thread(target=flood, daemon=True)


def ack_deliveries(con, want: int, timeout: float, published: list, errors: list) -> None:
    """Read `con`'s events and ack every delivery on channel 1 until `want` were delivered; fails when
    the flood thread (flood_thread) raised or `timeout` seconds pass first."""
    import time

    from broker.amqp import encoder, events

    got = 0
    deadline = time.monotonic() + timeout
    while got < want:
        assert time.monotonic() < deadline, f"{got} of {want} delivered while {published[0]} were published"
        assert not errors, errors
        ev = con.next_event()
        con._handle_close(ev)
        if isinstance(ev, events.Deliver):
            got += 1
            con.send(encoder.encode_ack(1, ev.delivery_tag, False))


def in_thread(fn) -> tuple[threading.Thread, list]:
    """Run ``fn`` in a daemon thread (a blocking client request the test must not wait on yet); its
    result, or the exception it raised, lands in the list (``thread_result``)."""
    out: list = []

    def run() -> None:
        try:
            out.append(fn())
        except Exception as exc:  # re-raised by thread_result
            out.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def thread_result(t: threading.Thread, out: list, timeout: float = 30.0):
    """What ``in_thread``'s ``fn`` returned (its exception raised here); fails if it got no answer in time."""
    t.join(timeout)
    assert not t.is_alive() and out, "a client request got no answer"
    if isinstance(out[0], Exception):
        raise out[0]
    return out[0]
