"""`spark.read.format("shardmq")`: batch reads of a stream queue over AMQP (pipeline/stream_source.py).

A real node (module-shared) and the run's one Spark session; messages are published with the perf
tool's raw client, so the reader is checked against what went in, not against itself.
"""

from __future__ import annotations

import datetime as dt
import time

import pytest
from pamqp import commands

from tests.helpers import uid
from tests.pipeline_helpers import declare_stream, publish


def _read(spark, node, queue, **options):
    r = spark.read.format("shardmq").option("uri", node.url).option("queue", queue)
    for k, v in options.items():
        r = r.option(k, str(v))
    return r.load()


def test_100k_messages_in_several_partitions_equal_what_was_published(spark, shared_node):
    q = uid("big")
    declare_stream(shared_node.url, q)
    n = 100_000
    publish(shared_node.url, q, ((b"payload-%06d" % i, None) for i in range(n)))
    df = _read(spark, shared_node, q, maxRecordsPerPartition=30_000)
    assert df.rdd.getNumPartitions() == 4
    rows = df.select("offset", "body").collect()  # partition order = offset order
    assert len(rows) == n
    assert [r.offset for r in rows] == list(range(n))
    assert all(r.body == b"payload-%06d" % r.offset for r in rows)


def test_columns_properties_headers_and_offset_range(spark, shared_node):
    q = uid("cols")
    declare_stream(shared_node.url, q)
    stamp = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC)
    publish(shared_node.url, q, [(b"x%d" % i, commands.Basic.Properties(
        content_type="text/plain", message_id=f"id-{i}", correlation_id="c", timestamp=stamp, priority=3,
        delivery_mode=2, app_id="test", headers={"n": i, "flag": True, "name": "a"})) for i in range(20)])
    rows = _read(spark, shared_node, q, startingOffset=5, endingOffset=15).orderBy("offset").collect()
    assert [r.offset for r in rows] == list(range(5, 15))
    r = rows[0]
    assert r.body == b"x5" and r.routing_key == q and r.exchange == ""
    assert r.headers == {"n": "5", "flag": "true", "name": "a"}  # x-stream-offset is the offset column
    p = r.properties
    assert (p.content_type, p.message_id, p.correlation_id, p.priority, p.delivery_mode, p.app_id) == (
        "text/plain", "id-5", "c", 3, 2, "test")
    assert p.timestamp.replace(tzinfo=dt.UTC) == stamp and r.timestamp == p.timestamp
    text = _read(spark, shared_node, q, bodyFormat="text", startingOffset="last").collect()
    assert [(t.offset, t.body) for t in text] == [(19, "x19")]


def test_timestamp_start_replays_from_that_second(spark, shared_node):
    q = uid("ts")
    declare_stream(shared_node.url, q)
    publish(shared_node.url, q, ((b"before-%d" % i, None) for i in range(50)))
    mark = int(time.time()) + 1  # every "before" message is stored before this second
    while time.time() < mark:
        time.sleep(0.02)
    publish(shared_node.url, q, ((b"after-%d" % i, None) for i in range(30)))
    iso = dt.datetime.fromtimestamp(mark, dt.UTC).isoformat()
    rows = _read(spark, shared_node, q, startingOffset=iso).orderBy("offset").collect()
    assert [r.body for r in rows] == [b"after-%d" % i for i in range(30)]
    assert rows[0].offset == 50
    before = _read(spark, shared_node, q, endingOffset=iso).count()
    assert before == 50
    future = dt.datetime.fromtimestamp(mark + 3600, dt.UTC).isoformat()
    assert _read(spark, shared_node, q, startingOffset=future).count() == 0


def test_filters(spark, shared_node):
    q = uid("flt")
    declare_stream(shared_node.url, q)
    values = ["eu", "us", None, "eu,apac"]
    publish(shared_node.url, q, [(b"%d" % i, commands.Basic.Properties(
        headers={"x-stream-filter-value": values[i % 4]} if values[i % 4] else {"other": 1}))
        for i in range(400)])
    eu = _read(spark, shared_node, q, filter="eu", maxRecordsPerPartition=70).orderBy("offset").collect()
    assert [r.offset for r in eu] == [i for i in range(400) if i % 4 in (0, 3)]
    assert _read(spark, shared_node, q, filter="us,apac").count() == 200
    assert _read(spark, shared_node, q, filter="us", matchUnfiltered="true").count() == 200


def test_bad_options_and_missing_queue_are_clear_errors(spark, shared_node):
    with pytest.raises(Exception, match="option startingOffset must be first, last, next"):
        _read(spark, shared_node, "x", startingOffset="yesterday").count()
    with pytest.raises(Exception, match="option queue is required"):
        spark.read.format("shardmq").option("uri", shared_node.url).load().count()
    with pytest.raises(Exception, match="queue 'no-such-stream' not found"):
        _read(spark, shared_node, "no-such-stream").count()
    classic = uid("classic")
    conn = shared_node.connect()
    ch = conn.channel()
    ch.queue_declare(classic)
    ch.basic_publish("", classic, b"hello")
    try:
        with pytest.raises(Exception, match="is not a stream queue"):
            _read(spark, shared_node, classic).count()
    finally:
        conn.close()


def test_a_lost_connection_resumes_at_the_next_offset(node_factory, caplog):
    from pipeline.stream_source import ReadOptions, resilient_range

    node = node_factory(name="flaky", frontends=1, shards=1)
    q = uid("flaky")
    declare_stream(node.url, q)
    publish(node.url, q, ((b"%d" % i, None) for i in range(30_000)))
    opts = ReadOptions({"uri": node.url, "queue": q}, streaming=False)
    got = []
    old = None
    for item in resilient_range(opts, 0, 30_000):
        got.append(item[0])
        if len(got) == 5000:
            old = node.kill_worker("frontend", 0)  # the node restarts it; the reader reconnects
    assert old is not None and node.wait_worker_restarted("frontend", 0, old)
    assert got == list(range(30_000))
    assert any("connection lost at offset" in r.getMessage() for r in caplog.records)
