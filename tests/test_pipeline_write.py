"""`df.write.format("shardmq")` and `writeStream`: publishing rows with publisher confirms (pipeline/writer.py)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.helpers import uid, wait_count
from tests.pipeline_helpers import declare_stream, publish, wait_for


def _drain(ch, queue: str, n: int) -> list:
    got = []
    deadline = time.monotonic() + 30
    for method, props, body in ch.consume(queue, auto_ack=True, inactivity_timeout=1.0):
        if method is not None:
            got.append((method.routing_key, props, body))
        if len(got) >= n:
            break
        assert time.monotonic() < deadline, f"got {len(got)} of {n} messages from {queue}"
    ch.cancel()
    return got


def test_batch_write_publishes_every_row_with_its_fields(spark, shared_node):
    ex, q = uid("ex"), uid("sink")
    conn = shared_node.connect()
    ch = conn.channel()
    ch.exchange_declare(ex, "topic")
    ch.queue_declare(q)
    ch.queue_bind(q, ex, "orders.#")
    try:
        df = spark.range(3000, numPartitions=3).selectExpr(
            "CAST(id AS STRING) AS body",
            "CASE WHEN id % 2 = 0 THEN 'orders.even' ELSE 'orders.odd' END AS routing_key",
            "map('n', CAST(id AS STRING)) AS headers",
            "named_struct('message_id', concat('m', id), 'content_type', 'text/plain') AS properties")
        (df.write.format("shardmq").option("uri", shared_node.url).option("exchange", ex).mode("append").save())
        wait_count(ch, q, 3000)
        got = _drain(ch, q, 3000)
        ids = sorted(int(body) for _rk, _p, body in got)
        assert ids == list(range(3000))
        for rk, props, body in got[:50]:
            i = int(body)
            assert rk == ("orders.even" if i % 2 == 0 else "orders.odd")
            assert props.message_id == f"m{i}" and props.content_type == "text/plain"
            assert props.headers == {"n": str(i)} and props.delivery_mode == 2
    finally:
        conn.close()


def test_nacked_publish_fails_the_job(spark, shared_node):
    ex, q = uid("ex"), uid("full")
    conn = shared_node.connect()
    ch = conn.channel()
    ch.exchange_declare(ex, "fanout")
    ch.queue_declare(q, arguments={"x-max-length": 10, "x-overflow": "reject-publish"})
    ch.queue_bind(q, ex)
    try:
        df = spark.range(50, numPartitions=1).selectExpr("CAST(id AS STRING) AS body")
        with pytest.raises(Exception, match="nacked publish"):
            df.write.format("shardmq").option("uri", shared_node.url).option("exchange", ex).mode("append").save()
    finally:
        conn.close()


def test_missing_confirm_fails_the_task(spark, node_factory):
    # --colocate off: the shard is stopped (SIGSTOP) while the frontend must answer the writer.
    node = node_factory(name="stalled", frontends=1, shards=1, extra_args=["--colocate", "off"])
    conn = node.connect()
    ch = conn.channel()
    ch.queue_declare("target", durable=True)
    conn.close()
    shard = node.worker_pid("shard", 0)
    os.kill(shard, signal.SIGSTOP)  # the shard stores nothing and confirms nothing
    try:
        df = spark.range(20, numPartitions=1).selectExpr("CAST(id AS STRING) AS body")
        with pytest.raises(Exception, match="not confirmed within 2s"):
            (df.write.format("shardmq").option("uri", node.url).option("exchange", "")
             .option("routingKey", "target").option("confirmTimeout", "2").mode("append").save())
    finally:
        os.kill(shard, signal.SIGCONT)


def test_write_without_body_or_exchange_is_a_clear_error(spark, shared_node):
    df = spark.range(1).selectExpr("id")
    with pytest.raises(Exception, match="needs a body column"):
        df.write.format("shardmq").option("uri", shared_node.url).option("exchange", "").mode("append").save()
    with pytest.raises(Exception, match="option exchange is required"):
        df.selectExpr("'x' AS body").write.format("shardmq").option("uri", shared_node.url).mode("append").save()


def test_streaming_write_copies_a_stream_to_an_exchange(spark, shared_node, tmp_path):
    src, dst = uid("src"), uid("dst")
    declare_stream(shared_node.url, src)
    conn = shared_node.connect()
    ch = conn.channel()
    ch.queue_declare(dst)
    try:
        publish(shared_node.url, src, ((b"e%d" % i, None) for i in range(700)))
        query = (spark.readStream.format("shardmq").option("uri", shared_node.url).option("queue", src)
                 .option("startingOffset", "first").option("maxRecordsPerTrigger", 300).load()
                 .selectExpr("body", "concat('copy.', CAST(offset AS STRING)) AS message_id")
                 .selectExpr("body", "named_struct('message_id', message_id) AS properties")
                 .writeStream.format("shardmq").option("uri", shared_node.url).option("exchange", "")
                 .option("routingKey", dst).option("checkpointLocation", str(tmp_path / "ck")).start())
        try:
            query.processAllAvailable()
        finally:
            query.stop()
        wait_for(lambda: ch.queue_declare(dst, passive=True).method.message_count == 700,
                 what="700 copied messages")
        got = _drain(ch, dst, 700)
        assert sorted(body for _rk, _p, body in got) == sorted(b"e%d" % i for i in range(700))
        assert {p.message_id for _rk, p, _b in got} == {f"copy.{i}" for i in range(700)}
    finally:
        conn.close()
