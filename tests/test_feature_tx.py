"""AMQP transactions (tx.select/commit/rollback) on a real node, with pika."""

from __future__ import annotations

import pika
import pytest

from tests.helpers import count, uid


def test_publishes_are_invisible_until_commit_and_dropped_on_rollback(conn):
    admin = conn.channel()
    q = admin.queue_declare(uid("txq"), durable=True).method.queue
    tx = conn.channel()
    tx.tx_select()
    for i in range(5):
        tx.basic_publish("", q, b"%d" % i, pika.BasicProperties(delivery_mode=2))
    assert count(admin, q) == 0
    tx.tx_commit()
    # commit-ok means the shards have the messages: visible right away.
    assert count(admin, q) == 5
    tx.basic_publish("", q, b"rolled back")
    tx.tx_rollback()
    tx.tx_commit()  # an empty commit is fine
    assert count(admin, q) == 5
    bodies = [admin.basic_get(q, auto_ack=True)[2] for _ in range(5)]
    assert bodies == [b"0", b"1", b"2", b"3", b"4"]
    admin.queue_delete(q)


def test_commit_over_queues_on_several_shards(conn):
    admin = conn.channel()
    qs = [admin.queue_declare(uid(f"txs{i}"), exclusive=True).method.queue for i in range(8)]
    tx = conn.channel()
    tx.tx_select()
    for round_ in range(3):
        for q in qs:
            tx.basic_publish("", q, b"r%d" % round_)
        tx.tx_commit()
        assert [count(admin, q) for q in qs] == [round_ + 1] * len(qs)


def test_acks_are_applied_on_commit_only(shared_node):
    c = shared_node.connect()
    admin = c.channel()
    q = admin.queue_declare(uid("txa"), durable=True).method.queue
    admin.confirm_delivery()
    for i in range(3):
        admin.basic_publish("", q, b"%d" % i)
    tx = c.channel()
    tx.tx_select()
    tags = [tx.basic_get(q)[0].delivery_tag for _ in range(3)]
    tx.basic_ack(tags[0])
    tx.tx_rollback()  # the ack of tags[0] is forgotten
    tx.basic_ack(tags[1])
    tx.tx_commit()  # only tags[1] is acked
    c.close()  # tags[0] and tags[2] go back to the queue
    c2 = shared_node.connect()
    ch = c2.channel()
    assert sorted(ch.basic_get(q, auto_ack=True)[2] for _ in range(2)) == [b"0", b"2"]
    assert ch.basic_get(q, auto_ack=True)[0] is None
    ch.queue_delete(q)
    c2.close()


def test_nack_and_reject_in_tx(conn):
    admin = conn.channel()
    q = admin.queue_declare(uid("txn"), exclusive=True).method.queue
    admin.confirm_delivery()
    admin.basic_publish("", q, b"a")
    admin.basic_publish("", q, b"b")
    tx = conn.channel()
    tx.tx_select()
    t1 = tx.basic_get(q)[0].delivery_tag
    t2 = tx.basic_get(q)[0].delivery_tag
    tx.basic_reject(t1, requeue=False)
    tx.basic_nack(t2, requeue=True)
    assert count(admin, q) == 0
    tx.tx_commit()
    assert admin.basic_get(q, auto_ack=True)[2] == b"b"
    assert admin.basic_get(q, auto_ack=True)[0] is None


def test_tx_and_confirm_are_mutually_exclusive(conn):
    ch = conn.channel()
    ch.tx_select()
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as err:
        ch.confirm_delivery()
    assert err.value.reply_code == 406
    ch2 = conn.channel()
    ch2.confirm_delivery()
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as err:
        ch2.tx_select()
    assert err.value.reply_code == 406


def test_commit_without_select_is_406(conn):
    ch = conn.channel()
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as err:
        ch.tx_commit()
    assert err.value.reply_code == 406


def test_unroutable_mandatory_publish_in_tx_is_returned_at_commit(conn):
    ch = conn.channel()
    returned = []
    ch.add_on_return_callback(lambda _ch, method, _p, body: returned.append((method.reply_code, body)))
    ch.tx_select()
    ch.basic_publish("", uid("nowhere"), b"lost", mandatory=True)
    ch.tx_commit()
    conn.process_data_events(time_limit=0.2)
    assert returned == [(312, b"lost")]
