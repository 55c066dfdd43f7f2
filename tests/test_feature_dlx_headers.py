"""Per-message dead-letter headers (LavinMQ): a message's own x-dead-letter-exchange /
x-dead-letter-routing-key headers, on queues with and without a DLX argument, and across a restart."""

from __future__ import annotations

import pika

from tests.helpers import count, get_one, uid, wait_count


def target(ch, key: str = "dead", durable: bool = False) -> tuple[str, str]:
    """A direct exchange with a queue bound under `key`."""
    ex = uid("mdlx")
    ch.exchange_declare(ex, "direct", durable=durable)
    q = uid("mdlq")
    ch.queue_declare(q, durable=durable)
    ch.queue_bind(q, ex, routing_key=key)
    return ex, q


def pub(ch, q: str, body: bytes, headers: dict | None = None, **props) -> None:
    ch.basic_publish("", q, body, pika.BasicProperties(headers=headers, delivery_mode=2, **props))


def reject_one(ch, q: str) -> None:
    m, _p, _b = get_one(ch, q, auto_ack=False)
    ch.basic_reject(m.delivery_tag, requeue=False)


def assert_dead(ch, dlq: str, body: bytes, reason: str, src: str, exchange: str, rk: str) -> dict:
    method, props, got = get_one(ch, dlq)
    assert got == body
    assert method.exchange == exchange and method.routing_key == rk
    h = props.headers
    assert h["x-death"][0]["reason"] == reason and h["x-death"][0]["queue"] == src
    assert h["x-first-death-reason"] == reason
    # LavinMQ takes the per-message headers out of the dead-lettered message.
    assert "x-dead-letter-exchange" not in h and "x-dead-letter-routing-key" not in h
    return h


def test_reject_on_a_plain_queue_goes_to_the_message_dlx(ch):
    ex, dlq = target(ch)
    src = uid("src")
    ch.queue_declare(src)  # no DLX argument: a plain queue
    pub(ch, src, b"m", {"x-dead-letter-exchange": ex, "x-dead-letter-routing-key": "dead", "app": 1})
    pub(ch, src, b"plain", {"app": 2})
    reject_one(ch, src)
    h = assert_dead(ch, dlq, b"m", "rejected", src, ex, "dead")
    assert h["app"] == 1
    reject_one(ch, src)  # no header: dropped, as before
    assert count(ch, src) == 0
    # A fence on the same path: a dead letter of "plain" would reach the DLQ ahead of this one.
    pub(ch, src, b"fence", {"x-dead-letter-exchange": ex, "x-dead-letter-routing-key": "dead"})
    reject_one(ch, src)
    assert_dead(ch, dlq, b"fence", "rejected", src, ex, "dead")
    assert count(ch, dlq) == 0


def test_consumer_reject_on_a_plain_queue(ch):
    ex, dlq = target(ch, key="orig-src")
    src = uid("src")
    ch.queue_declare(src)
    ch.queue_bind(src, "amq.direct", routing_key="orig-src")
    # Without x-dead-letter-routing-key the message keeps its routing key.
    ch.basic_publish("amq.direct", "orig-src", b"c", pika.BasicProperties(headers={"x-dead-letter-exchange": ex}))
    for method, _props, body in ch.consume(src, inactivity_timeout=5):
        assert body == b"c"
        ch.basic_nack(method.delivery_tag, requeue=False)
        break
    ch.cancel()
    h = assert_dead(ch, dlq, b"c", "rejected", src, ex, "orig-src")
    assert h["x-death"][0]["exchange"] == "amq.direct"


def test_ttl_expiry_goes_to_the_message_dlx(ch):
    ex, dlq = target(ch)
    src = uid("src")
    ch.queue_declare(src)
    pub(ch, src, b"t", {"x-dead-letter-exchange": ex, "x-dead-letter-routing-key": "dead"}, expiration="30")
    h = assert_dead(ch, dlq, b"t", "expired", src, ex, "dead")
    assert h["x-death"][0]["original-expiration"] == "30"
    src2 = uid("src")
    ch.queue_declare(src2, arguments={"x-message-ttl": 30})  # queue TTL, no DLX argument
    pub(ch, src2, b"t2", {"x-dead-letter-exchange": ex, "x-dead-letter-routing-key": "dead"})
    assert_dead(ch, dlq, b"t2", "expired", src2, ex, "dead")


def test_max_length_drop_goes_to_the_message_dlx(ch):
    ex, dlq = target(ch)
    src = uid("src")
    ch.queue_declare(src, arguments={"x-max-length": 1})
    pub(ch, src, b"first", {"x-dead-letter-exchange": ex, "x-dead-letter-routing-key": "dead"})
    pub(ch, src, b"second")
    assert_dead(ch, dlq, b"first", "maxlen", src, ex, "dead")
    assert get_one(ch, src)[2] == b"second"


def test_message_headers_win_over_queue_arguments(ch):
    q_ex, q_dlq = target(ch, key="qkey")
    m_ex, m_dlq = target(ch, key="mkey")
    ch.queue_bind(m_dlq, m_ex, routing_key="qkey")
    ch.queue_bind(q_dlq, q_ex, routing_key="mkey")
    src = uid("src")
    ch.queue_declare(src, arguments={"x-dead-letter-exchange": q_ex, "x-dead-letter-routing-key": "qkey"})
    # Both headers: the message's exchange and key.
    pub(ch, src, b"both", {"x-dead-letter-exchange": m_ex, "x-dead-letter-routing-key": "mkey"})
    reject_one(ch, src)
    assert_dead(ch, m_dlq, b"both", "rejected", src, m_ex, "mkey")
    # Exchange header only: the message's exchange, the queue's routing key.
    pub(ch, src, b"ex-only", {"x-dead-letter-exchange": m_ex})
    reject_one(ch, src)
    assert_dead(ch, m_dlq, b"ex-only", "rejected", src, m_ex, "qkey")
    # Routing-key header only: the queue's exchange, the message's key.
    pub(ch, src, b"rk-only", {"x-dead-letter-routing-key": "mkey"})
    reject_one(ch, src)
    assert_dead(ch, q_dlq, b"rk-only", "rejected", src, q_ex, "mkey")
    # No headers: the queue's settings.
    pub(ch, src, b"none")
    reject_one(ch, src)
    assert_dead(ch, q_dlq, b"none", "rejected", src, q_ex, "qkey")
    assert count(ch, m_dlq) == 0 and count(ch, q_dlq) == 0


def test_routing_key_header_alone_on_a_queue_without_dlx_drops(ch):
    src = uid("src")
    ch.queue_declare(src)
    pub(ch, src, b"x", {"x-dead-letter-routing-key": src})
    reject_one(ch, src)
    # A fence: the shard handles the reject before this later publish, so a copy of "x" routed back
    # into the queue would come first.
    pub(ch, src, b"fence")
    assert get_one(ch, src)[2] == b"fence"
    assert count(ch, src) == 0


def test_header_to_a_missing_exchange_drops(ch):
    src = uid("src")
    ch.queue_declare(src)
    pub(ch, src, b"x", {"x-dead-letter-exchange": uid("nope")})
    reject_one(ch, src)
    assert count(ch, src) == 0


def test_recovered_message_with_header_is_dead_lettered_after_restart(node):
    conn = node.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    ex, dlq = target(ch, durable=True)
    src = uid("src")
    ch.queue_declare(src, durable=True)
    pub(ch, src, b"plain")
    pub(ch, src, b"later", {"x-dead-letter-exchange": ex, "x-dead-letter-routing-key": "dead"})
    conn.close()
    node.restart()
    conn = node.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    m1, _p, b1 = get_one(ch, src, auto_ack=False)
    m2, _p, b2 = get_one(ch, src, auto_ack=False)
    assert (b1, b2) == (b"plain", b"later")
    ch.basic_nack(m2.delivery_tag, multiple=True, requeue=False)
    wait_count(ch, dlq, 1)
    assert_dead(ch, dlq, b"later", "rejected", src, ex, "dead")
    assert count(ch, src) == 0
    conn.close()


def test_rewrites_keep_a_header_that_is_not_utf8(shared_node, conn, ch):
    """BCC stripping (frontend) and dead-lettering (shard) re-encode the properties; a long-string
    ('S') header that is not UTF-8 comes out as it went in (pamqp alone raised TypeError)."""
    import struct

    from pamqp import commands as C
    from pamqp import frame as pframe

    from tests.raw_amqp import FrameClient

    src, dlq, bcc = uid("src"), uid("dlq"), uid("bcc")
    ch.queue_declare(dlq)
    ch.queue_declare(bcc)
    ch.queue_declare(src, arguments={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": dlq})
    # Built by hand: pamqp itself cannot encode the value.
    bcc_value = b"A" + struct.pack(">I", 5 + len(bcc)) + b"S" + struct.pack(">I", len(bcc)) + bcc.encode()
    table = b"\x03raw" + b"S" + struct.pack(">I", 2) + b"\xff\xfe" + b"\x03BCC" + bcc_value
    props_raw = struct.pack(">HI", 0x2000, len(table)) + table
    header = struct.pack(">HHQ", 60, 0, 1) + props_raw
    raw = FrameClient(shared_node.port)
    try:
        raw.open_channel(1)
        raw.send(1, C.Confirm.Select())
        raw.expect(1, C.Confirm.SelectOk)
        raw.sock.sendall(pframe.marshal(C.Basic.Publish(exchange="", routing_key=src), 1)
                         + struct.pack(">BHI", 2, 1, len(header)) + header + b"\xce"
                         + struct.pack(">BHI", 3, 1, 1) + b"m" + b"\xce")
        raw.expect(1, C.Basic.Ack)
    finally:
        raw.close()
    _m, props, _b = get_one(ch, bcc)
    assert props.headers == {"raw": b"\xff\xfe"}  # BCC stripped, the rest kept
    method, _p, _b = ch.basic_get(src, auto_ack=False)
    ch.basic_reject(method.delivery_tag, requeue=False)
    wait_count(ch, dlq, 1)
    _m, props, _b = get_one(ch, dlq)
    assert props.headers["raw"] == b"\xff\xfe" and props.headers["x-death"][0]["reason"] == "rejected"
