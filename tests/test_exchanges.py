"""Exchanges on a real node with pika: declare/delete semantics and routing of every type.

Routing is checked by messages that actually arrive. The publishing channel is in
confirm mode: a confirm for a transient message is sent once every shard it was
routed to has appended it, so right after ``basic_publish`` returns, a queue holds
exactly what was routed to it and an empty ``basic_get`` proves nothing arrived.
"""

from __future__ import annotations

import time

import pika
import pytest

from tests.helpers import channel_error, connections_on_two_frontends, names_on_different_shards, uid

# Queue names are picked per shard by their crc32 (tests/helpers.py): nodes place by name.
QUEUE_PLACEMENT = "hash"


def drain(ch, queue: str) -> list[bytes]:
    bodies = []
    while True:
        method, _props, body = ch.basic_get(queue, auto_ack=True)
        if method is None:
            return bodies
        bodies.append(body)


def new_queue(ch, name: str | None = None) -> str:
    return ch.queue_declare(name or uid("q"), auto_delete=False, exclusive=True).method.queue


# ---------------------------------------------------------------- declare / delete
def test_declare_passive_finds_existing_and_404s_missing(conn, ch):
    name = uid("x")
    ch.exchange_declare(name, "direct")
    ch.exchange_declare(name, passive=True)
    code, text = channel_error(conn, lambda c: c.exchange_declare(uid("missing"), passive=True))
    assert code == 404 and text.startswith("NOT_FOUND - no exchange")
    ch.exchange_delete(name)


@pytest.mark.parametrize("change", [
    {"exchange_type": "fanout"},
    {"durable": True},
    {"auto_delete": True},
    {"internal": True},
    {"arguments": {"alternate-exchange": "elsewhere"}},
])
def test_redeclare_with_different_attributes_is_precondition_failed(conn, ch, change):
    name = uid("x")
    ch.exchange_declare(name, "direct")
    ch.exchange_declare(name, "direct")  # identical redeclare is fine
    params = {"exchange_type": "direct", **change}
    code, text = channel_error(conn, lambda c: c.exchange_declare(name, **params))
    assert code == 406 and text.startswith("PRECONDITION_FAILED - inequivalent arg"), text
    ch.exchange_delete(name)


def test_unknown_exchange_type_closes_connection(shared_node):
    connection = shared_node.connect()
    channel = connection.channel()
    with pytest.raises(pika.exceptions.ConnectionClosedByBroker) as info:
        channel.exchange_declare(uid("x"), "no-such-type")
    assert info.value.reply_code == 503


def test_durable_exchange_survives_restart(node):
    name = uid("durable-x")
    transient = uid("transient-x")
    connection = node.connect()
    channel = connection.channel()
    channel.exchange_declare(name, "topic", durable=True)
    channel.exchange_declare(transient, "topic", durable=False)
    connection.close()
    node.restart()
    connection = node.connect()
    connection.channel().exchange_declare(name, passive=True)
    code, _ = channel_error(connection, lambda c: c.exchange_declare(transient, passive=True))
    assert code == 404
    connection.close()


def test_auto_delete_exchange_goes_with_its_last_binding(conn, ch):
    name = uid("ad-x")
    ch.exchange_declare(name, "direct", auto_delete=True)
    q1, q2 = new_queue(ch), new_queue(ch)
    ch.queue_bind(q1, name, "a")
    ch.queue_bind(q2, name, "b")
    ch.queue_unbind(q1, name, "a")
    ch.exchange_declare(name, passive=True)  # one binding left
    ch.queue_unbind(q2, name, "b")
    code, _ = channel_error(conn, lambda c: c.exchange_declare(name, passive=True))
    assert code == 404


def test_auto_delete_exchange_without_bindings_stays(conn, ch):
    name = uid("ad-x")
    ch.exchange_declare(name, "fanout", auto_delete=True)
    ch.exchange_declare(name, passive=True)
    ch.exchange_delete(name)


def test_auto_delete_exchange_goes_when_its_bound_queue_is_deleted(conn, ch):
    name = uid("ad-x")
    ch.exchange_declare(name, "fanout", auto_delete=True)
    q = new_queue(ch)
    ch.queue_bind(q, name)
    ch.queue_delete(q)
    code, _ = channel_error(conn, lambda c: c.exchange_declare(name, passive=True))
    assert code == 404


def test_internal_exchange_refuses_publish_but_routes_from_another_exchange(conn, ch):
    internal, front = uid("int-x"), uid("front-x")
    ch.exchange_declare(internal, "fanout", internal=True)
    ch.exchange_declare(front, "fanout")
    ch.exchange_bind(destination=internal, source=front)
    q = new_queue(ch)
    ch.queue_bind(q, internal)
    ch.basic_publish(front, "", b"via-front")
    assert drain(ch, q) == [b"via-front"]

    def publish_internal(c):
        c.basic_publish(internal, "", b"x")
        c.basic_get(q)  # the channel.close arrives before this get's answer

    code, text = channel_error(conn, publish_internal)
    assert code == 403 and "internal exchange" in text
    ch.exchange_delete(front)
    ch.exchange_delete(internal)


def test_alternate_exchange_argument_takes_unroutable_messages(conn, ch):
    alt, main = uid("alt-x"), uid("main-x")
    ch.exchange_declare(alt, "fanout")
    ch.exchange_declare(main, "direct", arguments={"alternate-exchange": alt})
    routed, fallback = new_queue(ch), new_queue(ch)
    ch.queue_bind(routed, main, "known")
    ch.queue_bind(fallback, alt)
    ch.basic_publish(main, "known", b"routed")
    ch.basic_publish(main, "unknown", b"fallback")
    assert drain(ch, routed) == [b"routed"]
    assert drain(ch, fallback) == [b"fallback"]
    ch.exchange_delete(main)
    ch.exchange_delete(alt)


def test_delete_if_unused(conn, ch):
    name = uid("x")
    ch.exchange_declare(name, "direct")
    q = new_queue(ch)
    ch.queue_bind(q, name, "k")
    code, text = channel_error(conn, lambda c: c.exchange_delete(name, if_unused=True))
    assert code == 406 and text.endswith("in use")
    ch.queue_unbind(q, name, "k")
    ch.exchange_delete(name, if_unused=True)
    code, _ = channel_error(conn, lambda c: c.exchange_declare(name, passive=True))
    assert code == 404


def test_delete_removes_bindings_and_missing_delete_is_ok(conn, ch):
    name = uid("x")
    ch.exchange_declare(name, "fanout")
    q = new_queue(ch)
    ch.queue_bind(q, name)
    ch.exchange_delete(name)
    ch.exchange_delete(name)  # RabbitMQ answers delete-ok for a missing exchange
    ch.exchange_declare(name, "fanout")  # same name again starts without the old binding
    ch.basic_publish(name, "", b"x")
    assert drain(ch, q) == []
    ch.exchange_delete(name)


# ------------------------------------------------------------------ reserved names
def test_amq_prefix_is_reserved(conn):
    code, text = channel_error(conn, lambda c: c.exchange_declare("amq.mine", "direct"))
    assert code == 403 and "reserved prefix 'amq.*'" in text
    code, text = channel_error(conn, lambda c: c.exchange_delete("amq.direct"))
    assert code == 403
    code, text = channel_error(conn, lambda c: c.exchange_delete(""))
    assert code == 403


def test_default_exchange_cannot_be_bound(conn, ch):
    q = new_queue(ch)
    code, text = channel_error(conn, lambda c: c.queue_bind(q, "", "k"))
    assert code == 403 and "default exchange" in text


@pytest.mark.parametrize("name,kind", [
    ("amq.direct", "direct"), ("amq.fanout", "fanout"), ("amq.topic", "topic"),
    ("amq.headers", "headers"), ("amq.match", "headers"),
])
def test_predeclared_exchanges_exist_and_route(ch, name, kind):
    ch.exchange_declare(name, passive=True)
    ch.exchange_declare(name, kind, durable=True)  # redeclaring with the same attributes is allowed
    q = new_queue(ch)
    args = {"x-match": "all", "k": "v"} if kind == "headers" else None
    ch.queue_bind(q, name, "rk" if kind != "fanout" else "", arguments=args)
    props = pika.BasicProperties(headers={"k": "v"})
    ch.basic_publish(name, "rk", b"hello", props)
    assert drain(ch, q) == [b"hello"]
    ch.queue_unbind(q, name, "rk" if kind != "fanout" else "", arguments=args)


def test_default_exchange_routes_by_queue_name(ch):
    q = new_queue(ch)
    ch.basic_publish("", q, b"direct-to-queue")
    ch.basic_publish("", q + "-nope", b"lost")
    assert drain(ch, q) == [b"direct-to-queue"]


# ------------------------------------------------------------------------- routing
def test_direct_routing(ch):
    x = uid("direct-x")
    ch.exchange_declare(x, "direct")
    qa, qb, qab = new_queue(ch), new_queue(ch), new_queue(ch)
    ch.queue_bind(qa, x, "a")
    ch.queue_bind(qb, x, "b")
    ch.queue_bind(qab, x, "a")
    ch.queue_bind(qab, x, "b")
    for key in ("a", "b", "c"):
        ch.basic_publish(x, key, key.encode())
    assert drain(ch, qa) == [b"a"]
    assert drain(ch, qb) == [b"b"]
    assert drain(ch, qab) == [b"a", b"b"]
    ch.exchange_delete(x)


def test_fanout_routing_ignores_key(ch):
    x = uid("fanout-x")
    ch.exchange_declare(x, "fanout")
    queues = [new_queue(ch) for _ in range(3)]
    for q in queues:
        ch.queue_bind(q, x, "whatever")
    ch.basic_publish(x, "any-key", b"all")
    for q in queues:
        assert drain(ch, q) == [b"all"]
    ch.exchange_delete(x)


TOPIC_CASES = [
    ("stock.*.nyse", {"stock.ibm.nyse"}),
    ("stock.#", {"stock", "stock.ibm", "stock.ibm.nyse", "stock.ibm.nyse.x"}),
    ("#", {"stock", "stock.ibm", "stock.ibm.nyse", "stock.ibm.nyse.x", "weather.eu", ""}),
    ("*.ibm.*", {"stock.ibm.nyse"}),
    ("#.nyse", {"stock.ibm.nyse"}),
    ("*", {"stock"}),  # RabbitMQ splits "" into zero words, so only "#" matches it
    ("stock.*", {"stock.ibm"}),
    ("#.ibm.#", {"stock.ibm", "stock.ibm.nyse", "stock.ibm.nyse.x"}),
    ("weather.eu", {"weather.eu"}),
]
TOPIC_KEYS = ["stock", "stock.ibm", "stock.ibm.nyse", "stock.ibm.nyse.x", "weather.eu", ""]


def test_topic_routing_with_star_and_hash(ch):
    x = uid("topic-x")
    ch.exchange_declare(x, "topic")
    queues = {}
    for pattern, _ in TOPIC_CASES:
        queues[pattern] = new_queue(ch)
        ch.queue_bind(queues[pattern], x, pattern)
    for key in TOPIC_KEYS:
        ch.basic_publish(x, key, key.encode() or b"<empty>")
    for pattern, expected in TOPIC_CASES:
        got = {b.decode() for b in drain(ch, queues[pattern])}
        want = {k or "<empty>" for k in expected}
        assert got == want, pattern
    ch.exchange_delete(x)


def test_topic_unbind_stops_routing(ch):
    x = uid("topic-x")
    ch.exchange_declare(x, "topic")
    q = new_queue(ch)
    ch.queue_bind(q, x, "a.#")
    ch.basic_publish(x, "a.b", b"1")
    ch.queue_unbind(q, x, "a.#")
    ch.basic_publish(x, "a.b", b"2")
    assert drain(ch, q) == [b"1"]
    ch.exchange_delete(x)


def test_headers_routing_all_and_any(ch):
    x = uid("headers-x")
    ch.exchange_declare(x, "headers")
    q_all, q_any, q_default = new_queue(ch), new_queue(ch), new_queue(ch)
    ch.queue_bind(q_all, x, arguments={"x-match": "all", "format": "pdf", "type": "report"})
    ch.queue_bind(q_any, x, arguments={"x-match": "any", "format": "pdf", "type": "report"})
    ch.queue_bind(q_default, x, arguments={"format": "pdf", "type": "report"})  # x-match defaults to all
    messages = {
        b"both": {"format": "pdf", "type": "report"},
        b"both+extra": {"format": "pdf", "type": "report", "extra": 1},
        b"format": {"format": "pdf"},
        b"wrong": {"format": "zip", "type": "log"},
        b"none": None,
    }
    for body, headers in messages.items():
        ch.basic_publish(x, "", body, pika.BasicProperties(headers=headers))
    assert drain(ch, q_all) == [b"both", b"both+extra"]
    assert drain(ch, q_default) == [b"both", b"both+extra"]
    assert drain(ch, q_any) == [b"both", b"both+extra", b"format"]
    ch.exchange_delete(x)


def test_headers_binding_with_typed_values(ch):
    x = uid("headers-x")
    ch.exchange_declare(x, "headers")
    q = new_queue(ch)
    ch.queue_bind(q, x, arguments={"x-match": "all", "n": 42, "flag": True})
    ch.basic_publish(x, "", b"match", pika.BasicProperties(headers={"n": 42, "flag": True}))
    ch.basic_publish(x, "", b"other-int", pika.BasicProperties(headers={"n": 43, "flag": True}))
    assert drain(ch, q) == [b"match"]
    ch.exchange_delete(x)


def test_exchange_to_exchange_bind_and_unbind(ch):
    src, dst = uid("src-x"), uid("dst-x")
    ch.exchange_declare(src, "topic")
    ch.exchange_declare(dst, "direct")
    ch.exchange_bind(destination=dst, source=src, routing_key="orders.*")
    q = new_queue(ch)
    ch.queue_bind(q, dst, "orders.new")
    ch.basic_publish(src, "orders.new", b"1")  # src topic match, then dst direct match
    ch.basic_publish(src, "orders.old", b"2")  # reaches dst, no queue bound for it there
    ch.basic_publish(src, "other", b"3")  # stops at src
    assert drain(ch, q) == [b"1"]
    ch.exchange_unbind(destination=dst, source=src, routing_key="orders.*")
    ch.basic_publish(src, "orders.new", b"4")
    assert drain(ch, q) == []
    ch.exchange_delete(src)
    ch.exchange_delete(dst)


def test_exchange_bindings_deliver_once_per_queue(ch):
    # Two paths to the same queue (direct + via another exchange) still put one copy in it.
    a, b = uid("a-x"), uid("b-x")
    ch.exchange_declare(a, "fanout")
    ch.exchange_declare(b, "fanout")
    ch.exchange_bind(destination=b, source=a)
    q = new_queue(ch)
    ch.queue_bind(q, a)
    ch.queue_bind(q, b)
    ch.basic_publish(a, "", b"once")
    assert drain(ch, q) == [b"once"]
    ch.exchange_delete(a)
    ch.exchange_delete(b)


def test_exchange_bind_to_missing_exchange_is_404(conn, ch):
    src = uid("src-x")
    ch.exchange_declare(src, "fanout")
    code, _ = channel_error(conn, lambda c: c.exchange_bind(destination=uid("nope"), source=src))
    assert code == 404
    ch.exchange_delete(src)


def test_publish_to_missing_exchange_is_404(conn):
    def publish(c):
        c.basic_publish(uid("nope"), "", b"x")
        c.basic_get("amq.gen-unused")

    code, text = channel_error(conn, publish)
    assert code == 404 and text.startswith("NOT_FOUND - no exchange")


# ----------------------------------------------------------- across processes
def test_publish_on_another_frontend_right_after_bind_ok_is_routed(shared_node):
    binder, publisher = connections_on_two_frontends(shared_node)
    try:
        assert (binder._impl.server_properties["shardmq_frontend"]
                != publisher._impl.server_properties["shardmq_frontend"])
        bch = binder.channel()
        pch = publisher.channel()
        pch.confirm_delivery()
        x = uid("xfe")
        bch.exchange_declare(x, "direct")
        for i in range(50):
            q = bch.queue_declare(uid(f"xfe{i}"), exclusive=True).method.queue
            bch.queue_bind(q, x, f"k{i}")
            # mandatory + confirms: an unroutable publish raises UnroutableError here.
            pch.basic_publish(x, f"k{i}", b"%d" % i, mandatory=True)
            assert bch.basic_get(q, auto_ack=True)[2] == b"%d" % i
            bch.queue_unbind(q, x, f"k{i}")
            with pytest.raises(pika.exceptions.UnroutableError):
                pch.basic_publish(x, f"k{i}", b"after unbind", mandatory=True)
            bch.queue_delete(q)
        bch.exchange_delete(x)
        for i in range(20):
            # A declare is visible on the other frontend once its -ok is seen, too.
            q = bch.queue_declare(uid(f"xfd{i}"), exclusive=True).method.queue
            pch.basic_publish("", q, b"default", mandatory=True)
            fresh = uid(f"xfe{i}")
            bch.exchange_declare(fresh, "fanout")
            bch.queue_bind(q, fresh)
            pch.basic_publish(fresh, "", b"fresh", mandatory=True)  # 404 if the exchange were unknown there
            assert [bch.basic_get(q, auto_ack=True)[2] for _ in range(2)] == [b"default", b"fresh"]
            bch.exchange_delete(fresh)
            bch.queue_delete(q)
    finally:
        binder.close()
        publisher.close()


def test_fanout_over_queues_on_different_shards(conn, ch):
    x = uid("fan2")
    ch.exchange_declare(x, "fanout", auto_delete=True)
    queues = names_on_different_shards(uid("fs")) + names_on_different_shards(uid("ft"))
    for q in queues:
        new_queue(ch, q)
        ch.queue_bind(q, x)
    sent = [b"f%d" % i for i in range(200)]
    for body in sent:
        ch.basic_publish(x, "", body)
    consumer = conn.channel()
    got: dict[str, list[bytes]] = {q: [] for q in queues}
    for q in queues:
        consumer.basic_consume(q, lambda _c, m, _p, b, q=q: got[q].append(b), auto_ack=True)
    deadline = time.monotonic() + 10
    while any(len(v) < len(sent) for v in got.values()):
        assert time.monotonic() < deadline, {q: len(v) for q, v in got.items()}
        conn.process_data_events(0.02)
    assert all(v == sent for v in got.values())


def test_auto_delete_counts_only_bindings_from_the_exchange(conn, ch):
    # RabbitMQ deletes an auto-delete exchange when its last binding *as source* goes;
    # a binding that has it as destination does not keep it alive and goes with it.
    upstream, ad = uid("up-x"), uid("ad-x")
    ch.exchange_declare(upstream, "fanout")
    ch.exchange_declare(ad, "fanout", auto_delete=True)
    ch.exchange_bind(destination=ad, source=upstream)
    q = new_queue(ch)
    ch.queue_bind(q, ad)
    ch.basic_publish(upstream, "", b"through")
    assert drain(ch, q) == [b"through"]
    ch.queue_unbind(q, ad)
    code, _ = channel_error(conn, lambda c: c.exchange_declare(ad, passive=True))
    assert code == 404
    ch.exchange_delete(upstream, if_unused=True)  # the upstream->ad binding went with ad
