"""Routing features on a real node: CC/BCC, consistent-hash exchange, server timestamp.

(Alternate exchanges by argument are covered in tests/test_exchanges.py; by policy in
tests/test_feature_policies.py.)
"""

from __future__ import annotations

import time

import pika
import pytest

from tests.helpers import connections_on_two_frontends, uid


@pytest.fixture
def ch(conn):
    return conn.channel()


def get_all(ch, queue: str, limit: int = 10_000) -> list:
    out = []
    while len(out) < limit:
        method, props, body = ch.basic_get(queue, auto_ack=True)
        if method is None:
            return out
        out.append((props, body))
    return out


def wait_count(ch, queue: str, n: int, timeout: float = 10.0) -> int:
    deadline = time.monotonic() + timeout
    while True:
        count = ch.queue_declare(queue, passive=True).method.message_count
        if count >= n or time.monotonic() > deadline:
            return count
        time.sleep(0.02)


# ------------------------------------------------------------------ CC / BCC
def test_cc_and_bcc_add_routing_keys_and_bcc_is_stripped(ch):
    x = uid("ccx")
    ch.exchange_declare(x, "direct", auto_delete=True)
    qs = {k: ch.queue_declare(uid(k), exclusive=True).method.queue for k in ("main", "cc1", "cc2", "bcc", "none")}
    for key, q in qs.items():
        ch.queue_bind(q, x, key)
    ch.confirm_delivery()
    headers = {"CC": ["cc1", "cc2", "main"], "BCC": ["bcc"], "other": "kept"}
    ch.basic_publish(x, "main", b"hello", pika.BasicProperties(headers=headers, message_id="m1"))
    for key in ("main", "cc1", "cc2", "bcc"):
        got = get_all(ch, qs[key])
        assert [b for _, b in got] == [b"hello"], key  # one copy each, also for "main" listed twice
        props = got[0][0]
        assert props.message_id == "m1"
        assert "BCC" not in props.headers
        assert props.headers["CC"] == ["cc1", "cc2", "main"]
        assert props.headers["other"] == "kept"
    assert get_all(ch, qs["none"]) == []


def test_cc_only_keeps_properties_byte_identical_and_topic_cc(ch):
    x = uid("cct")
    ch.exchange_declare(x, "topic", auto_delete=True)
    qa = ch.queue_declare(uid("a"), exclusive=True).method.queue
    qb = ch.queue_declare(uid("b"), exclusive=True).method.queue
    ch.queue_bind(qa, x, "a.#")
    ch.queue_bind(qb, x, "b.*")
    ch.confirm_delivery()
    ch.basic_publish(x, "a.x", b"1", pika.BasicProperties(headers={"CC": ["b.y"]}))
    ch.basic_publish(x, "a.x", b"2", pika.BasicProperties(headers={"CC": "not-an-array"}))
    assert [b for _, b in get_all(ch, qa)] == [b"1", b"2"]
    got = get_all(ch, qb)
    assert [b for _, b in got] == [b"1"]
    assert got[0][0].headers == {"CC": ["b.y"]}


def test_bcc_only_routes_to_default_exchange_queue(ch):
    q1 = ch.queue_declare(uid("d1"), exclusive=True).method.queue
    q2 = ch.queue_declare(uid("d2"), exclusive=True).method.queue
    ch.confirm_delivery()
    ch.basic_publish("", q1, b"x", pika.BasicProperties(headers={"BCC": [q2]}))
    for q in (q1, q2):
        got = get_all(ch, q)
        assert [b for _, b in got] == [b"x"]
        assert got[0][0].headers == {}


# ------------------------------------------------------------ consistent hash
def test_consistent_hash_weighted_distribution_and_stability(ch):
    x = uid("chx")
    ch.exchange_declare(x, "x-consistent-hash", auto_delete=True)
    weights = [1, 1, 2, 4]
    qs = []
    for w in weights:
        q = ch.queue_declare(uid(f"ch{w}"), exclusive=True).method.queue
        ch.queue_bind(q, x, str(w))
        qs.append(q)
    ch.confirm_delivery()
    n = 4000
    for i in range(n):
        ch.basic_publish(x, f"key-{i}", b"%d" % i)
    counts = [len(get_all(ch, q)) for q in qs]
    assert sum(counts) == n  # every message reaches exactly one queue
    total_w = sum(weights)
    for w, c in zip(weights, counts, strict=True):
        expected = n * w / total_w
        assert 0.6 * expected < c < 1.4 * expected, (weights, counts)
    # The same routing key always lands in the same queue.
    for _ in range(20):
        ch.basic_publish(x, "sticky-key", b"s")
    assert sorted(len(get_all(ch, q)) for q in qs) == [0, 0, 0, 20]


def test_consistent_hash_on_header_and_bad_weight(conn, ch):
    x = uid("chh")
    ch.exchange_declare(x, "x-consistent-hash", auto_delete=True, arguments={"hash-header": "user"})
    qs = [ch.queue_declare(uid("hh"), exclusive=True).method.queue for _ in range(3)]
    for q in qs:
        ch.queue_bind(q, x, "10")
    ch.confirm_delivery()
    for i in range(30):
        # Different routing keys, same header: one queue gets them all.
        ch.basic_publish(x, f"rk-{i}", b"u", pika.BasicProperties(headers={"user": "alice"}))
    ch.basic_publish(x, "rk", b"no header")  # unrouted without the header
    counts = sorted(len(get_all(ch, q)) for q in qs)
    assert counts == [0, 0, 30]
    ch2 = conn.channel()
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as err:
        ch2.queue_bind(qs[0], x, "heavy")
    assert err.value.reply_code == 406


# ------------------------------------------------------------ server timestamp
def test_set_timestamp_setting(node_factory):
    node = node_factory(name="ts", frontends=1, shards=1, extra_args=["--set-timestamp", "1"])
    c = node.connect()
    try:
        ch = c.channel()
        q = ch.queue_declare("", exclusive=True).method.queue
        ch.confirm_delivery()
        before = int(time.time())
        ch.basic_publish("", q, b"a", pika.BasicProperties(content_type="text/plain"))
        ch.basic_publish("", q, b"b", pika.BasicProperties(timestamp=12345))
        got = get_all(ch, q)
        after = int(time.time())
        assert before <= got[0][0].timestamp <= after
        assert got[0][0].content_type == "text/plain"
        assert got[1][0].timestamp == 12345  # a client's own timestamp is kept
    finally:
        c.close()


def test_no_timestamp_by_default(ch):
    q = ch.queue_declare("", exclusive=True).method.queue
    ch.confirm_delivery()
    ch.basic_publish("", q, b"a")
    assert get_all(ch, q)[0][0].timestamp is None


# ------------------------------------------------------------ direct reply-to
@pytest.mark.parametrize("cross_frontend", [False, True])
def test_direct_reply_to_rpc(shared_node, cross_frontend):
    if cross_frontend:
        client, server = connections_on_two_frontends(shared_node)
    else:
        client = shared_node.connect()
        server = client
    try:
        sch = server.channel()
        rpc_q = sch.queue_declare(uid("rpc"), exclusive=True).method.queue
        cch = client.channel()
        replies = []
        cch.basic_consume("amq.rabbitmq.reply-to", lambda _c, m, p, b: replies.append((m, p, b)),
                          auto_ack=True)
        for i in range(5):
            cch.basic_publish("", rpc_q, b"req%d" % i,
                              pika.BasicProperties(reply_to="amq.rabbitmq.reply-to", correlation_id=str(i)))
        reply_names = set()
        for _ in range(5):
            deadline = time.monotonic() + 5
            method = None
            while method is None and time.monotonic() < deadline:
                method, props, body = sch.basic_get(rpc_q, auto_ack=True)
            assert method is not None
            assert props.reply_to.startswith("amq.rabbitmq.reply-to.")
            reply_names.add(props.reply_to)
            sch.basic_publish("", props.reply_to, b"re:" + body,
                              pika.BasicProperties(correlation_id=props.correlation_id))
        assert len(reply_names) == 1
        deadline = time.monotonic() + 5
        while len(replies) < 5 and time.monotonic() < deadline:
            client.process_data_events(time_limit=0.05)
        assert [b for _, _, b in replies] == [b"re:req%d" % i for i in range(5)]
        assert [p.correlation_id for _, p, _ in replies] == [str(i) for i in range(5)]
        # The consumer goes away: a late reply is dropped without any error for the server.
        cch.close()
        sch.confirm_delivery()
        sch.basic_publish("", reply_names.pop(), b"too late")
        assert sch.is_open
    finally:
        client.close()
        if server is not client:
            server.close()


def test_direct_reply_to_errors(conn):
    ch = conn.channel()
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as err:
        ch.basic_publish("", "anything", b"x", pika.BasicProperties(reply_to="amq.rabbitmq.reply-to"))
        ch.queue_declare("", exclusive=True)  # the publish error arrives before this reply
    assert err.value.reply_code == 406
    assert "fast reply consumer does not exist" in err.value.reply_text
    ch2 = conn.channel()
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as err:
        ch2.basic_consume("amq.rabbitmq.reply-to", lambda *a: None, auto_ack=False)
    assert err.value.reply_code == 406


# ------------------------------------------------------------ delayed exchange (declare/route only)
def test_delayed_exchange_declare_and_undelayed_routing(conn, ch):
    x = uid("dx")
    ch.exchange_declare(x, "x-delayed-message", auto_delete=True, arguments={"x-delayed-type": "topic"})
    q = ch.queue_declare(uid("dq"), exclusive=True).method.queue
    ch.queue_bind(q, x, "a.*")
    ch.confirm_delivery()
    ch.basic_publish(x, "a.b", b"now", pika.BasicProperties(headers={"x-delay": 0}))
    ch.basic_publish(x, "z.b", b"unrouted")
    assert [b for _, b in get_all(ch, q)] == [b"now"]
    ch2 = conn.channel()
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as err:
        ch2.exchange_declare(uid("dbad"), "x-delayed-message", arguments={"x-delayed-type": "nope"})
    assert err.value.reply_code == 406
