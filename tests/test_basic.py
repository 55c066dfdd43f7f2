"""basic.* on a real node with pika: qos, consume, cancel, return, get, ack/nack/reject, recover, bodies.

Messages are published on a confirm-mode channel before the consumer starts, so
what the shard can deliver is fixed when consuming begins. Waits are bounded
polls of the client's event loop; "nothing more arrives" checks give the broker a
short grace period and can only miss a bug, never invent one.
"""

from __future__ import annotations

import datetime
import decimal
import time

import pika
import pytest
from pika.exceptions import ChannelClosedByBroker

from tests.harness import pumping, wait_until
from tests.helpers import WAIT, connections_on_two_frontends, names_on_different_shards, uid

# Queue names are picked per shard by their crc32 (tests/helpers.py): nodes place by name.
QUEUE_PLACEMENT = "hash"

GRACE = 0.3  # how long "no further delivery" is watched for


@pytest.fixture
def pub(conn):
    channel = conn.channel()
    channel.confirm_delivery()
    return channel


class Inbox:
    """A pika consumer callback that keeps (method, properties, body) in arrival order."""

    def __init__(self) -> None:
        self.items: list = []

    def __call__(self, _ch, method, props, body) -> None:
        self.items.append((method, props, body))

    @property
    def bodies(self) -> list[bytes]:
        return [body for _, _, body in self.items]

    def __len__(self) -> int:
        return len(self.items)


def wait_for(conn, predicate, what: str = "condition", timeout: float = WAIT) -> None:
    wait_until(predicate, timeout, what, pause=pumping(conn))


def settle(conn, seconds: float = GRACE) -> None:
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        conn.process_data_events(min(left, 0.05))


def fill(pub, queue: str, n: int, prefix: str = "m") -> list[bytes]:
    bodies = [f"{prefix}{i}".encode() for i in range(n)]
    for body in bodies:
        pub.basic_publish("", queue, body)
    return bodies


def new_queue(pub, name: str | None = None) -> str:
    return pub.queue_declare(name or uid(), exclusive=True).method.queue


def ready(pub, queue: str) -> int:
    return pub.queue_declare(queue, passive=True).method.message_count


# ------------------------------------------------------------------------ qos
def test_prefetch_per_consumer_bounds_unacked(conn, pub):
    q = new_queue(pub)
    fill(pub, q, 10)
    ch = conn.channel()
    ch.basic_qos(prefetch_count=3)
    inbox = Inbox()
    ch.basic_consume(q, inbox)
    wait_for(conn, lambda: len(inbox) >= 3, "3 deliveries")
    settle(conn)
    assert len(inbox) == 3
    assert ready(pub, q) == 7
    ch.basic_ack(inbox.items[0][0].delivery_tag)
    wait_for(conn, lambda: len(inbox) >= 4, "a 4th delivery after one ack")
    settle(conn)
    assert len(inbox) == 4
    ch.basic_ack(inbox.items[-1][0].delivery_tag, multiple=True)
    wait_for(conn, lambda: len(inbox) >= 7, "3 more after a multiple ack")
    settle(conn)
    assert len(inbox) == 7
    assert inbox.bodies == [f"m{i}".encode() for i in range(7)]


def test_prefetch_applies_per_consumer_not_per_channel(conn, pub):
    q1, q2 = new_queue(pub), new_queue(pub)
    fill(pub, q1, 5)
    fill(pub, q2, 5)
    ch = conn.channel()
    ch.basic_qos(prefetch_count=2)
    in1, in2 = Inbox(), Inbox()
    ch.basic_consume(q1, in1)
    ch.basic_consume(q2, in2)
    wait_for(conn, lambda: len(in1) >= 2 and len(in2) >= 2, "2 deliveries per consumer")
    settle(conn)
    assert (len(in1), len(in2)) == (2, 2)


def test_global_prefetch_across_consumers_on_different_shards(conn, pub):
    limit, per_queue = 4, 10
    names = names_on_different_shards(uid("gq"))
    queues = [new_queue(pub, name) for name in names]
    for q in queues:
        fill(pub, q, per_queue, prefix=q + ":")
    ch = conn.channel()
    ch.basic_qos(prefetch_count=limit, global_qos=True)
    inbox = Inbox()
    for q in queues:
        ch.basic_consume(q, inbox)
    wait_for(conn, lambda: len(inbox) >= limit, f"{limit} deliveries")
    settle(conn)
    assert len(inbox) == limit

    acked = 0
    max_outstanding = 0
    deadline = time.monotonic() + WAIT
    while len(inbox) < len(queues) * per_queue or acked < len(inbox):
        assert time.monotonic() < deadline, f"stuck at {len(inbox)} delivered, {acked} acked"
        conn.process_data_events(0.02)
        max_outstanding = max(max_outstanding, len(inbox) - acked)
        if acked < len(inbox):
            ch.basic_ack(inbox.items[acked][0].delivery_tag)
            acked += 1
    assert max_outstanding <= limit
    for q in queues:  # each queue's own order is kept
        mine = [b for b in inbox.bodies if b.startswith(q.encode() + b":")]
        assert mine == [f"{q}:{i}".encode() for i in range(per_queue)]


def test_basic_get_ignores_prefetch(conn, pub):
    q = new_queue(pub)
    fill(pub, q, 3)
    ch = conn.channel()
    ch.basic_qos(prefetch_count=1)
    tags = [ch.basic_get(q)[0].delivery_tag for _ in range(3)]
    assert tags == [1, 2, 3]


# --------------------------------------------------------------------- consume
def test_no_ack_consumer_takes_messages_for_good(conn, pub):
    q = new_queue(pub)
    sent = fill(pub, q, 20)
    ch = conn.channel()
    inbox = Inbox()
    ch.basic_consume(q, inbox, auto_ack=True)
    wait_for(conn, lambda: len(inbox) >= 20, "20 deliveries")
    assert inbox.bodies == sent
    assert all(not m.redelivered for m, _, _ in inbox.items)
    ch.close()  # nothing was unacked, so nothing comes back
    assert ready(pub, q) == 0


def test_exclusive_consumer(shared_node, conn, pub):
    q = pub.queue_declare(uid(), auto_delete=False).method.queue
    ch = conn.channel()
    ch.basic_consume(q, lambda *a: None, exclusive=True)
    other = shared_node.connect()
    try:
        with pytest.raises(ChannelClosedByBroker) as info:
            other.channel().basic_consume(q, lambda *a: None)
        assert info.value.reply_code == 403
        assert info.value.reply_text == f"ACCESS_REFUSED - queue '{q}' in vhost '/' in exclusive use"
    finally:
        other.close()
    ch.close()
    # With the exclusive consumer gone, anyone may consume; an exclusive one now fails instead.
    ch = conn.channel()
    ch.basic_consume(q, lambda *a: None)
    with pytest.raises(ChannelClosedByBroker) as info:
        conn.channel().basic_consume(q, lambda *a: None, exclusive=True)
    assert info.value.reply_code == 403
    pub.queue_delete(q)


def test_consume_from_missing_queue_is_404(conn):
    with pytest.raises(ChannelClosedByBroker) as info:
        conn.channel().basic_consume(uid("missing"), lambda *a: None)
    assert info.value.reply_code == 404


def test_round_robin_between_consumers(conn, pub):
    q = new_queue(pub)
    ch = conn.channel()
    in1, in2 = Inbox(), Inbox()
    ch.basic_consume(q, in1, auto_ack=True)
    ch.basic_consume(q, in2, auto_ack=True)
    sent = fill(pub, q, 10)
    wait_for(conn, lambda: len(in1) + len(in2) >= 10, "10 deliveries")
    assert len(in1) == len(in2) == 5
    assert sorted(in1.bodies + in2.bodies) == sorted(sent)


def test_cancel_stops_deliveries_and_requeues_nothing_acked(conn, pub):
    q = new_queue(pub)
    ch = conn.channel()
    inbox = Inbox()
    tag = ch.basic_consume(q, inbox, auto_ack=True)
    fill(pub, q, 2)
    wait_for(conn, lambda: len(inbox) >= 2, "2 deliveries")
    ch.basic_cancel(tag)
    fill(pub, q, 3, prefix="after")
    settle(conn)
    assert len(inbox) == 2
    assert ready(pub, q) == 3


def test_cancel_keeps_unacked_with_the_channel(conn, pub):
    q = new_queue(pub)
    fill(pub, q, 2)
    ch = conn.channel()
    inbox = Inbox()
    tag = ch.basic_consume(q, inbox)
    wait_for(conn, lambda: len(inbox) >= 2, "2 deliveries")
    ch.basic_cancel(tag)
    # After cancel the deliveries are still owned by the channel: acking them is valid.
    ch.basic_ack(inbox.items[1][0].delivery_tag, multiple=True)
    ch.close()
    assert ready(pub, q) == 0


def test_server_cancels_consumer_when_queue_is_deleted(conn, pub):
    q = pub.queue_declare(uid(), auto_delete=False).method.queue
    ch = conn.channel()
    cancelled = []
    ch.add_on_cancel_callback(lambda frame: cancelled.append(frame.method.consumer_tag))
    tag = ch.basic_consume(q, lambda *a: None)
    pub.queue_delete(q)
    wait_for(conn, lambda: cancelled, "basic.cancel from the server")
    assert cancelled == [tag]
    assert ch.is_open


# ------------------------------------------------------------------ publish/return
def test_mandatory_unroutable_is_returned(conn):
    ch = conn.channel()
    returned = []
    ch.add_on_return_callback(lambda _ch, method, props, body: returned.append((method, props, body)))
    key = uid("nowhere")
    props = pika.BasicProperties(content_type="text/plain", headers={"h": "v"}, message_id="id-1")
    ch.basic_publish("amq.direct", key, b"come back", props, mandatory=True)
    ch.basic_publish("amq.direct", key, b"dropped", props, mandatory=False)
    wait_for(conn, lambda: returned, "basic.return")
    settle(conn)
    assert len(returned) == 1
    method, rprops, body = returned[0]
    assert (method.reply_code, method.reply_text) == (312, "NO_ROUTE")
    assert (method.exchange, method.routing_key, body) == ("amq.direct", key, b"come back")
    assert (rprops.content_type, rprops.headers, rprops.message_id) == ("text/plain", {"h": "v"}, "id-1")


def test_mandatory_with_confirms_returns_then_acks(conn):
    ch = conn.channel()
    ch.confirm_delivery()
    with pytest.raises(pika.exceptions.UnroutableError):
        ch.basic_publish("amq.direct", uid("nowhere"), b"x", mandatory=True)


def test_mandatory_routed_is_not_returned(conn, pub):
    q = new_queue(pub)
    pub.basic_publish("", q, b"routed", mandatory=True)  # raises UnroutableError if returned
    assert ready(pub, q) == 1


# ------------------------------------------------------------------------- get
def test_get_and_get_empty(conn, pub):
    q = new_queue(pub)
    fill(pub, q, 3)
    ch = conn.channel()
    method, _, body = ch.basic_get(q)
    assert (body, method.message_count, method.redelivered, method.delivery_tag) == (b"m0", 2, False, 1)
    assert (method.exchange, method.routing_key) == ("", q)
    method, _, body = ch.basic_get(q, auto_ack=True)
    assert (body, method.message_count) == (b"m1", 1)
    assert ch.basic_get(q, auto_ack=True)[2] == b"m2"
    assert ch.basic_get(q) == (None, None, None)
    ch.close()  # tag 1 was never acked: it goes back
    assert ready(pub, q) == 1


def test_get_from_missing_queue_is_404(conn):
    with pytest.raises(ChannelClosedByBroker) as info:
        conn.channel().basic_get(uid("missing"))
    assert info.value.reply_code == 404


# -------------------------------------------------------------- ack/nack/reject
def consume_all(conn, ch, q: str, n: int) -> Inbox:
    inbox = Inbox()
    ch.basic_consume(q, inbox)
    wait_for(conn, lambda: len(inbox) >= n, f"{n} deliveries")
    return inbox


def test_nack_multiple_requeue_comes_back_redelivered(conn, pub):
    q = new_queue(pub)
    fill(pub, q, 5)
    ch = conn.channel()
    inbox = consume_all(conn, ch, q, 5)
    assert [m.delivery_tag for m, _, _ in inbox.items] == [1, 2, 3, 4, 5]
    ch.basic_nack(3, multiple=True, requeue=True)
    wait_for(conn, lambda: len(inbox) >= 8, "3 redeliveries")
    again = inbox.items[5:]
    assert [b for _, _, b in again] == [b"m0", b"m1", b"m2"]
    assert all(m.redelivered for m, _, _ in again)
    assert [m.delivery_tag for m, _, _ in again] == [6, 7, 8]
    ch.basic_ack(8, multiple=True)
    ch.close()
    assert ready(pub, q) == 0


def test_reject_requeue_and_discard(conn, pub):
    q = new_queue(pub)
    fill(pub, q, 2)
    ch = conn.channel()
    inbox = consume_all(conn, ch, q, 2)
    ch.basic_reject(1, requeue=False)
    ch.basic_reject(2, requeue=True)
    wait_for(conn, lambda: len(inbox) >= 3, "a redelivery")
    method, _, body = inbox.items[2]
    assert (body, method.redelivered) == (b"m1", True)
    settle(conn)
    assert len(inbox) == 3  # the discarded one never comes back
    ch.basic_ack(method.delivery_tag)
    ch.close()
    assert ready(pub, q) == 0


def test_nack_multiple_without_requeue_discards(conn, pub):
    q = new_queue(pub)
    fill(pub, q, 4)
    ch = conn.channel()
    consume_all(conn, ch, q, 4)
    ch.basic_nack(0, multiple=True, requeue=False)  # tag 0 + multiple = everything outstanding
    ch.close()
    assert ready(pub, q) == 0


def test_ack_multiple_only_up_to_tag(conn, pub):
    q = new_queue(pub)
    fill(pub, q, 5)
    ch = conn.channel()
    consume_all(conn, ch, q, 5)
    ch.basic_ack(3, multiple=True)
    ch.close()  # tags 4 and 5 go back
    assert ready(pub, q) == 2
    assert pub.basic_get(q, auto_ack=True)[2] == b"m3"


@pytest.mark.parametrize("settle_twice", [
    lambda ch: (ch.basic_ack(1), ch.basic_ack(1)),
    lambda ch: ch.basic_ack(99),
    lambda ch: ch.basic_reject(99),
    lambda ch: ch.basic_nack(99, multiple=True),
])
def test_unknown_delivery_tag_is_precondition_failed(conn, pub, settle_twice):
    q = new_queue(pub)
    fill(pub, q, 1)
    ch = conn.channel()
    consume_all(conn, ch, q, 1)
    settle_twice(ch)
    with pytest.raises(ChannelClosedByBroker) as info:
        ch.basic_get(q)  # the channel.close comes before any get-ok
    assert info.value.reply_code == 406
    assert info.value.reply_text.startswith("PRECONDITION_FAILED - unknown delivery tag")


def test_recover_redelivers_unacked(conn, pub):
    q = new_queue(pub)
    fill(pub, q, 3)
    ch = conn.channel()
    inbox = consume_all(conn, ch, q, 3)
    ch.basic_ack(2)
    ch.basic_recover(requeue=True)
    wait_for(conn, lambda: len(inbox) >= 5, "2 redeliveries after recover")
    again = inbox.items[3:]
    assert sorted(b for _, _, b in again) == [b"m0", b"m2"]
    assert all(m.redelivered for m, _, _ in again)
    ch.basic_ack(again[-1][0].delivery_tag, multiple=True)
    ch.close()
    assert ready(pub, q) == 0


def test_channel_close_requeues_unacked_in_order(conn, pub):
    q = new_queue(pub)
    sent = fill(pub, q, 5)
    ch = conn.channel()
    consume_all(conn, ch, q, 5)
    ch.close()
    got = [pub.basic_get(q, auto_ack=True) for _ in range(5)]
    assert [b for _, _, b in got] == sent
    assert all(m.redelivered for m, _, _ in got)


# ----------------------------------------------------------------------- bodies
@pytest.mark.parametrize("size", [0, 1, 131072 - 8, 131072, 1 << 20, 5 << 20])
def test_body_sizes_round_trip(conn, pub, size):
    q = new_queue(pub)
    body = bytes(range(256)) * (size // 256) + bytes(size % 256)
    pub.basic_publish("", q, body)
    ch = conn.channel()
    inbox = consume_all(conn, ch, q, 1)
    assert inbox.bodies[0] == body


def test_body_over_max_message_size_is_406(node_factory):
    node = node_factory(frontends=1, shards=1, extra_args=["--max-message-size", "1000"])
    connection = node.connect()
    ch = connection.channel()
    q = ch.queue_declare("", exclusive=True).method.queue
    ch.basic_publish("", q, b"x" * 1000)  # at the limit: fine
    with pytest.raises(ChannelClosedByBroker) as info:
        ch.basic_publish("", q, b"x" * 1001)
        ch.basic_get(q)
    assert info.value.reply_code == 406
    assert "message size 1001 is larger than configured max size 1000" in info.value.reply_text
    ch = connection.channel()  # the connection lives on; the accepted message is there
    method, _, body = ch.basic_get(q, auto_ack=True)
    assert body == b"x" * 1000 and method.message_count == 0
    connection.close()


def test_properties_and_headers_round_trip(conn, pub):
    q = new_queue(pub)
    stamp = datetime.datetime(2024, 5, 6, 7, 8, 9, tzinfo=datetime.UTC)
    headers = {
        "str": "text é", "int": 42, "neg": -7, "big": 2**40, "bool": True, "false": False,
        "decimal": decimal.Decimal("3.14"), "bytes": b"\x00\xff", "none": None,
        "list": [1, "two", [3]], "table": {"nested": {"deep": 1}}, "ts": stamp,
    }
    props = pika.BasicProperties(
        content_type="application/json", content_encoding="gzip", headers=headers, delivery_mode=2,
        priority=5, correlation_id="corr", reply_to="replies", expiration="60000", message_id="mid",
        timestamp=1700000000, type="kind", user_id="guest", app_id="tests", cluster_id="cl",
    )
    pub.basic_publish("", q, b"{}", props)
    ch = conn.channel()
    inbox = consume_all(conn, ch, q, 1)
    got = inbox.items[0][1]
    for field in ("content_type", "content_encoding", "delivery_mode", "priority", "correlation_id",
                  "reply_to", "expiration", "message_id", "timestamp", "type", "user_id", "app_id",
                  "cluster_id"):
        assert getattr(got, field) == getattr(props, field), field
    want = dict(headers, str="text é")
    assert got.headers == want


def test_user_id_must_match_the_connection_user(conn):
    ch = conn.channel()
    with pytest.raises(ChannelClosedByBroker) as info:
        ch.basic_publish("amq.direct", "x", b"x", pika.BasicProperties(user_id="someone-else"))
        ch.basic_get(uid("missing"))
    assert info.value.reply_code == 406
    assert info.value.reply_text == (
        "PRECONDITION_FAILED - user_id property set to 'someone-else' but authenticated user was 'guest'")
    ch = conn.channel()
    q = ch.queue_declare("", exclusive=True).method.queue
    ch.basic_publish("", q, b"own", pika.BasicProperties(user_id="guest"))
    assert ch.basic_get(q, auto_ack=True)[1].user_id == "guest"


# --------------------------------------------------------------------- ordering
def test_order_of_10000_messages_with_manual_acks(conn, pub):
    n = 10_000
    q = new_queue(pub)
    raw = conn.channel()  # no confirms: a fast pipeline of publishes
    for i in range(n):
        raw.basic_publish("", q, i.to_bytes(4, "big"))
    raw.basic_publish("", q, b"end")
    ch = conn.channel()
    ch.basic_qos(prefetch_count=200)
    got: list[int] = []
    done = []

    def on_message(channel, method, _props, body):
        if body == b"end":
            done.append(True)
        else:
            got.append(int.from_bytes(body, "big"))
        channel.basic_ack(method.delivery_tag)

    ch.basic_consume(q, on_message)
    wait_for(conn, lambda: done, "all 10,000 messages", timeout=60)
    assert got == list(range(n))
    ch.close()
    assert ready(pub, q) == 0


def test_order_of_10000_messages_no_ack_unlimited_prefetch(conn, pub):
    # No prefetch limit: only the shard->frontend credit window paces the deliveries.
    n = 10_000
    q = new_queue(pub)
    raw = conn.channel()
    for i in range(n):
        raw.basic_publish("", q, i.to_bytes(4, "big"))
    ch = conn.channel()
    inbox = Inbox()
    ch.basic_consume(q, inbox, auto_ack=True)
    wait_for(conn, lambda: len(inbox) >= n, "all 10,000 messages", timeout=60)
    assert [int.from_bytes(b, "big") for b in inbox.bodies] == list(range(n))


def test_recover_without_requeue_is_not_implemented(shared_node):
    connection = shared_node.connect()
    ch = connection.channel()
    with pytest.raises(pika.exceptions.ConnectionClosedByBroker) as info:
        ch.basic_recover(requeue=False)
    assert info.value.reply_code == 540
    assert info.value.reply_text == "NOT_IMPLEMENTED - requeue=false"


def test_bodies_split_into_small_frames(shared_node):
    # frame_max 4096: a 300 KB body is ~75 frames each way.
    connection = shared_node.connect(frame_max=4096)
    try:
        ch = connection.channel()
        q = ch.queue_declare("", exclusive=True).method.queue
        body = bytes(range(256)) * 1200
        ch.basic_publish("", q, body, pika.BasicProperties(headers={"pad": "x" * 1000}))
        inbox = Inbox()
        ch.basic_consume(q, inbox, auto_ack=True)
        wait_for(connection, lambda: inbox.items, "the delivery")
        assert inbox.bodies == [body]
        assert inbox.items[0][1].headers == {"pad": "x" * 1000}
    finally:
        connection.close()


def test_ack_after_the_queue_was_deleted_is_fine(conn, pub):
    q = pub.queue_declare(uid(), auto_delete=False).method.queue
    fill(pub, q, 3)
    ch = conn.channel()
    inbox = consume_all(conn, ch, q, 3)
    pub.queue_delete(q)
    ch.basic_ack(inbox.items[0][0].delivery_tag)
    ch.basic_nack(inbox.items[2][0].delivery_tag, multiple=True, requeue=True)
    # The tags were valid when delivered; the channel stays open (a 406 would close it here).
    assert ch.basic_get(new_queue(pub)) == (None, None, None)


def test_cancel_returns_deliveries_held_back_by_global_prefetch(conn, pub):
    """With a channel-wide limit over two shards the frontend holds back what a shard sent beyond
    it; cancelling a consumer must hand its held-back messages back to the queue at once."""
    limit = 2
    q1, q2 = (new_queue(pub, name) for name in names_on_different_shards(uid("held")))
    fill(pub, q1, 5, prefix="a")
    fill(pub, q2, 5, prefix="b")
    ch = conn.channel()
    ch.basic_qos(prefetch_count=limit, global_qos=True)
    inbox = Inbox()
    ch.basic_consume(q1, inbox)
    tag2 = ch.basic_consume(q2, inbox)
    wait_for(conn, lambda: len(inbox) >= limit, f"{limit} deliveries")
    settle(conn)
    ch.basic_cancel(tag2)
    from_q2 = sum(1 for b in inbox.bodies if b.startswith(b"b"))
    # Nothing is acked: the held-back q2 messages must become ready without any further ack.
    deadline = time.monotonic() + WAIT
    while ready(pub, q2) != 5 - from_q2:
        assert time.monotonic() < deadline, f"q2 has {ready(pub, q2)} ready, want {5 - from_q2}"
        conn.process_data_events(0.05)
    other = conn.channel()
    assert other.basic_get(q2, auto_ack=True)[0] is not None


def test_queue_deleted_from_another_frontend_cancels_the_consumer(shared_node):
    consumer_conn, deleter_conn = connections_on_two_frontends(shared_node)
    try:
        ch = consumer_conn.channel()
        q = ch.queue_declare(uid(), auto_delete=False).method.queue
        ch.basic_publish("", q, b"unacked")
        cancelled = []
        ch.add_on_cancel_callback(lambda frame: cancelled.append(frame.method.consumer_tag))
        inbox = Inbox()
        tag = ch.basic_consume(q, inbox)
        wait_for(consumer_conn, lambda: inbox.items, "the delivery")
        assert deleter_conn.channel().queue_delete(q).method.message_count == 0  # 1 unacked, 0 ready
        wait_for(consumer_conn, lambda: cancelled, "basic.cancel from the server")
        assert cancelled == [tag]
        ch.basic_ack(inbox.items[0][0].delivery_tag)  # still a valid tag on this channel
        assert ch.basic_get(ch.queue_declare("", exclusive=True).method.queue) == (None, None, None)
    finally:
        consumer_conn.close()
        deleter_conn.close()


def test_exclusive_queue_locked_across_frontends(shared_node):
    owner, other = connections_on_two_frontends(shared_node)
    try:
        q = owner.channel().queue_declare(uid("excl"), exclusive=True).method.queue
        with pytest.raises(ChannelClosedByBroker) as info:
            other.channel().basic_consume(q, lambda *a: None)
        assert info.value.reply_code == 405
        assert (owner._impl.server_properties["shardmq_frontend"]
                != other._impl.server_properties["shardmq_frontend"])
    finally:
        owner.close()
        other.close()
