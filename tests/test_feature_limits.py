"""Queue length limits on a real node with pika: x-max-length, x-max-length-bytes, x-overflow.

(tests/test_queues.py covers the plain drop-head and reject-publish counts; these cover
dead-lettering of what overflow removes, reject-publish-dlx, and publishes without confirms.)
"""

from __future__ import annotations

import pika
import pytest
from pika.exceptions import NackError

from tests.helpers import count, uid, wait_count


def drain(ch, queue: str) -> list[tuple[bytes, dict]]:
    out = []
    while True:
        method, props, body = ch.basic_get(queue, auto_ack=True)
        if method is None:
            return out
        out.append((body, props.headers or {}))


def with_dlq(ch, **args) -> tuple[str, str]:
    dlq = uid("dlq")
    ch.queue_declare(dlq)
    q = uid()
    ch.queue_declare(q, arguments={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": dlq, **args})
    return q, dlq


def test_drop_head_dead_letters_with_reason_maxlen(ch):
    q, dlq = with_dlq(ch, **{"x-max-length": 2})
    for i in range(5):
        ch.basic_publish("", q, b"m%d" % i)
    assert [b for b, _ in drain(ch, q)] == [b"m3", b"m4"]
    wait_count(ch, dlq, 3)
    dead = drain(ch, dlq)
    assert [b for b, _ in dead] == [b"m0", b"m1", b"m2"]
    assert all(h["x-death"][0]["reason"] == "maxlen" and h["x-death"][0]["queue"] == q for _, h in dead)


def test_max_length_bytes_drop_head(ch):
    q, dlq = with_dlq(ch, **{"x-max-length-bytes": 10})
    for body in (b"aaaa", b"bbbb", b"cccc"):  # 12 bytes > 10: the oldest goes
        ch.basic_publish("", q, body)
    assert [b for b, _ in drain(ch, q)] == [b"bbbb", b"cccc"]
    wait_count(ch, dlq, 1)


def test_reject_publish_nacks_under_confirms_and_does_not_dead_letter(ch):
    q, dlq = with_dlq(ch, **{"x-max-length": 1, "x-overflow": "reject-publish"})
    ch.basic_publish("", q, b"first")
    with pytest.raises(NackError):
        ch.basic_publish("", q, b"second")
    assert [b for b, _ in drain(ch, q)] == [b"first"]
    assert count(ch, dlq) == 0
    ch.basic_publish("", q, b"room-again")  # space again: accepted
    assert count(ch, q) == 1


def test_reject_publish_without_confirms_drops(conn, ch):
    q = uid()
    ch.queue_declare(q, arguments={"x-max-length": 2, "x-overflow": "reject-publish"})
    plain = conn.channel()
    for i in range(5):
        plain.basic_publish("", q, b"p%d" % i)
    ch.basic_publish("", uid("unroutable"), b"")  # a confirmed publish after them: they are all handled
    assert [b for b, _ in drain(ch, q)] == [b"p0", b"p1"]


def test_reject_publish_dlx_dead_letters_the_refused_message(ch):
    q, dlq = with_dlq(ch, **{"x-max-length": 1, "x-overflow": "reject-publish-dlx"})
    ch.basic_publish("", q, b"kept")
    with pytest.raises(NackError):
        ch.basic_publish("", q, b"refused", pika.BasicProperties(message_id="r"))
    wait_count(ch, dlq, 1)
    (body, headers), = drain(ch, dlq)
    assert body == b"refused" and headers["x-death"][0]["reason"] == "maxlen"
    assert [b for b, _ in drain(ch, q)] == [b"kept"]


def test_limit_counts_ready_messages_only(ch):
    q, dlq = with_dlq(ch, **{"x-max-length": 1})
    ch.basic_publish("", q, b"a")
    method, _p, _b = ch.basic_get(q, auto_ack=False)  # unacked: not counted
    ch.basic_publish("", q, b"b")
    assert count(ch, dlq) == 0
    ch.basic_ack(method.delivery_tag)
    assert [b for b, _ in drain(ch, q)] == [b"b"]


def test_limits_apply_after_restart(node):
    conn = node.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    q = uid()
    ch.queue_declare(q, durable=True, arguments={"x-max-length": 2, "x-overflow": "reject-publish"})
    for i in range(2):
        ch.basic_publish("", q, b"d%d" % i, pika.BasicProperties(delivery_mode=2))
    conn.close()
    node.restart()
    conn = node.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    with pytest.raises(NackError):
        ch.basic_publish("", q, b"over", pika.BasicProperties(delivery_mode=2))
    assert [b for b, _ in drain(ch, q)] == [b"d0", b"d1"]
    conn.close()
