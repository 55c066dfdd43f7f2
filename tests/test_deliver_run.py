"""Delivery runs (issue #15): consecutive deliveries of one shard batch for one consumer are encoded
in one pass (encoder.encode_deliver_run) and credited once (Channel.deliver_run).

The encoder must give exactly the bytes of encode_deliver per message; on a real node a run must
keep tags, redelivered flags, properties, split bodies and ack tracking as per-message delivery did.
"""

from __future__ import annotations

import pika
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker.amqp.encoder import encode_deliver, encode_deliver_run
from tests.codec_strategies import bodies, channels, exchange_names, properties, routing_keys, shortstr, tags
from tests.harness import pumping, wait_until
from tests.helpers import WAIT, uid

DELIVER = 40
SETTINGS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _item(redelivered, exchange, rk, props_raw, body) -> list:
    # the contract's DELIVER layout: [DELIVER, conn, ch, tag, qid, mid, redelivered, ex, rk, props, body]
    return [DELIVER, 1, 1, "ctag", 7, 9, redelivered, exchange, rk, props_raw, body]


# A small pool per field so that runs repeat names, properties and sizes (the encoder's caches) and
# also change them from one message to the next.
_messages = st.tuples(st.booleans(), st.one_of(st.sampled_from(["", "ex", "amq.direct"]), exchange_names),
                      st.one_of(st.sampled_from(["", "rk", "a.b.c"]), routing_keys), st.integers(0, 3), bodies)


@SETTINGS
@given(channels, shortstr(), tags.filter(lambda t: t < 2**63 - 1000), properties, properties,
       st.lists(_messages, min_size=1, max_size=30), st.sampled_from([0, 17, 50, 128, 4096, 131072]),
       st.booleans())
def test_run_equals_per_message_encoding(channel, ctag, first, props_a, props_b, messages, frame_max, as_bytes):
    raw = [b"\x00\x00", props_a.marshal(), props_b.marshal(), b"\x10\x00\x02"]  # last: delivery_mode 2
    items = []
    for redelivered, ex, rk, p, body in messages:
        if as_bytes:
            ex, rk = ex.encode(), rk.encode()
        items.append(_item(redelivered, ex, rk, raw[p], body))
    expected = b"".join(
        encode_deliver(channel, ctag, first + k, it[6], it[7], it[8], it[9], it[10], frame_max)
        for k, it in enumerate(items))
    assert encode_deliver_run(channel, ctag, first, items, frame_max) == expected
    assert encode_deliver_run(channel, ctag.encode(), first, items, frame_max) == expected


def test_run_splits_large_bodies_like_encode_deliver():
    big = bytes(range(256)) * 40  # 10,240 B: three body frames at frame_max 4096
    items = [_item(False, "", "q", b"\x00\x00", b"a"), _item(True, "", "q", b"\x00\x00", big),
             _item(False, "", "q", b"\x00\x00", b""), _item(False, "", "q", b"\x00\x00", big)]
    run = encode_deliver_run(3, "c", 5, items, 4096)
    assert run == b"".join(encode_deliver(3, "c", 5 + k, *it[6:], 4096) for k, it in enumerate(items))
    assert run.count(b"\x03\x00\x03\x00\x00\x0f\xf8") == 4  # two full 4088 B body frames per big body


def test_run_refuses_what_encode_deliver_refuses():
    with pytest.raises(ValueError):
        encode_deliver_run(1, "t" * 256, 1, [_item(False, "", "rk", b"\x00\x00", b"x")] * 2)
    with pytest.raises(ValueError):
        encode_deliver_run(1, "t", 1, [_item(False, "", "r" * 256, b"\x00\x00", b"x")] * 2)
    with pytest.raises(ValueError):
        encode_deliver_run(1, "t", 1, [_item(False, "", "rk", b"\x00\x00", b"x")] * 2, 8)


# ----------------------------------------------------------------------------- on a real node
def _wait(conn, predicate, what: str) -> None:
    wait_until(predicate, WAIT, what, pause=pumping(conn))


def _body(i: int) -> bytes:
    # empty, small, and larger than the 4096 frame_max below (split into several body frames)
    return b"" if i % 7 == 3 else (b"%d-" % i) * (3000 if i % 5 == 0 else 1)


@pytest.mark.parametrize("no_ack", [False, True])
def test_runs_keep_tags_flags_properties_and_bodies(shared_node, no_ack):
    n = 120
    conn = shared_node.connect(frame_max=4096)
    try:
        pub = conn.channel()
        pub.confirm_delivery()
        q = pub.queue_declare(uid(), exclusive=True).method.queue
        for i in range(n):
            props = pika.BasicProperties(headers={"i": i}, message_id=f"m{i}" if i % 2 else None,
                                         delivery_mode=2 if i % 3 == 0 else None)
            pub.basic_publish("", q, _body(i), props)
        ch = conn.channel()
        got: list = []
        first_tag = None
        if not no_ack:  # a first pass that nacks every other message back: they return redelivered
            ch.basic_consume(q, lambda _c, m, p, b: got.append((m, p, b)))
            _wait(conn, lambda: len(got) >= n, f"{n} deliveries")
            assert [m.delivery_tag for m, _, _ in got] == list(range(1, n + 1))
            assert not any(m.redelivered for m, _, _ in got)
            for m, _, _ in got:
                if m.delivery_tag % 2:
                    ch.basic_nack(m.delivery_tag, requeue=True)
            got.clear()
            _wait(conn, lambda: len(got) >= n // 2, "redeliveries")
            first_tag = n + 1
            expected = [i for i in range(n) if i % 2 == 0]
            # the rest were never acked: ack them all (multiple) with the redeliveries' last tag
        else:
            ch.basic_consume(q, lambda _c, m, p, b: got.append((m, p, b)), auto_ack=True)
            _wait(conn, lambda: len(got) >= n, f"{n} deliveries")
            first_tag = 1
            expected = list(range(n))
        assert [m.delivery_tag for m, _, _ in got] == list(range(first_tag, first_tag + len(expected)))
        assert [b for _, _, b in got] == [_body(i) for i in expected]
        assert [p.headers for _, p, _ in got] == [{"i": i} for i in expected]
        assert [p.message_id for _, p, _ in got] == [f"m{i}" if i % 2 else None for i in expected]
        assert [p.delivery_mode for _, p, _ in got] == [2 if i % 3 == 0 else None for i in expected]
        assert all(m.redelivered is (not no_ack) for m, _, _ in got)
        assert all(m.consumer_tag == got[0][0].consumer_tag for m, _, _ in got)
        if not no_ack:
            ch.basic_ack(got[-1][0].delivery_tag, multiple=True)  # every unacked tag is still tracked
        ch.close()
        assert pub.queue_declare(q, passive=True).method.message_count == 0
    finally:
        if conn.is_open:
            conn.close()
