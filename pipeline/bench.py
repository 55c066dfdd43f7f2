"""`shardmq-pipeline bench`: read rates of both formats against plain client loops, and streaming lag.

On one node (the --uri one) it publishes --messages bodies of --size bytes to a fresh stream queue
and measures, each as records/s:

- `amqp plain`: one consumer of the project's own client reading the stream (no Spark);
- `amqp pika`: one pika consumer (a widely used client) on the first 200k messages;
- `spark shardmq batch`: `spark.read.format("shardmq")` on --master, count + sum(length(body));
- `spark shardmq stream`: a streaming query draining the same backlog (Trigger.AvailableNow);
- `segments plain`: `pipeline.segments.read_segment` over the stream's files in one process;
- `spark shardmq-segments`: `spark.read.format("shardmq-segments")` on the same files;

then the end-to-end lag of a streaming query (publish time to the end of the micro-batch that
processed it) while a publisher sends --lag-rate msg/s for --lag-seconds.
Spark figures are the second of two runs (the first warms the JVM and the Python workers).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import threading
import time
from typing import Any

from pamqp import commands

from broker.amqp import encoder
from loadtest.amqp_client import AMQPClient
from pipeline import segments
from pipeline.amqp import read_range


def _publish(uri: str, queue: str, n: int, size: int) -> None:
    pad = b"x" * max(0, size - 13)
    props = commands.Basic.Properties(delivery_mode=2).marshal()
    with AMQPClient(uri).connect() as c:
        before = c.queue_declare(queue, passive=True)[1]
        buf = []
        for _ in range(n):
            body = (b"%013d" % int(time.time() * 1000) + pad)[:size]
            buf.append(encoder.encode_publish(1, "", queue, False, props, body, c.frame_max))
            if len(buf) >= 1000:
                c.send(b"".join(buf))
                buf = []
        if buf:
            c.send(b"".join(buf))
        while c.queue_declare(queue, passive=True)[1] < before + n:
            time.sleep(0.1)


def _rate(n: int, seconds: float) -> float:
    return n / seconds if seconds > 0 else float("inf")


def _plain_amqp(uri: str, queue: str, n: int) -> float:
    with AMQPClient(uri).connect() as c:
        t = time.perf_counter()
        got = sum(1 for _ in read_range(c, queue, 0, n))
        return _rate(got, time.perf_counter() - t)


def _pika(uri: str, queue: str, n: int) -> float:
    import pika

    conn = pika.BlockingConnection(pika.URLParameters(uri))
    ch = conn.channel()
    ch.basic_qos(prefetch_count=2000)
    got = 0
    t = time.perf_counter()
    for method, _p, _b in ch.consume(queue, arguments={"x-stream-offset": "first"}, inactivity_timeout=5):
        if method is None:
            break
        got += 1
        if got % 1000 == 0:
            ch.basic_ack(method.delivery_tag, multiple=True)
        if got >= n:
            break
    secs = time.perf_counter() - t
    conn.close()
    return _rate(got, secs)


def _spark_count(df: Any, n: int) -> tuple[float, float]:
    rates = []
    for _ in range(2):
        t = time.perf_counter()
        count, _total = df.selectExpr("count(*)", "sum(length(body))").first()
        rates.append(_rate(count, time.perf_counter() - t))
        assert count == n, f"read {count} of {n}"
    return rates[0], rates[1]


def _spark_stream(spark: Any, uri: str, queue: str, n: int) -> tuple[float, float]:
    """(rate over the query's wall time including its start, Spark's processedRowsPerSecond over its batches)."""
    rates = []
    processed = 0.0
    for _ in range(2):
        d = tempfile.mkdtemp(prefix="shardmq-bench-")
        q = (spark.readStream.format("shardmq").option("uri", uri).option("queue", queue)
             .option("startingOffset", "first").load().selectExpr("length(body) AS n")
             .writeStream.format("noop").option("checkpointLocation", os.path.join(d, "ck"))
             .trigger(availableNow=True).start())
        t = time.perf_counter()
        q.awaitTermination()
        secs = time.perf_counter() - t
        got = sum(p["numInputRows"] for p in q.recentProgress)
        assert got == n, f"streamed {got} of {n}"
        rates.append(_rate(got, secs))
        busy = sum(p["durationMs"].get("triggerExecution", 0) for p in q.recentProgress) / 1000
        processed = _rate(got, busy)
    return rates[1], processed


def _writes(spark: Any, uri: str, n: int, size: int) -> tuple[float, float]:
    """(plain confirming Publisher loop, spark df.write.format("shardmq")) publish rates to a classic queue."""
    from pipeline.amqp import Publisher

    queue = f"bench-write-{int(time.time())}"
    with AMQPClient(uri).connect() as c:
        c.queue_declare(queue, durable=True)
    props = commands.Basic.Properties(delivery_mode=2).marshal()
    body = b"x" * size
    with AMQPClient(uri).connect() as c:
        pub = Publisher(c, "")
        t = time.perf_counter()
        for _ in range(n):
            pub.publish(queue, props, body)
        pub.flush()
        plain = _rate(n, time.perf_counter() - t)
    df = spark.range(n, numPartitions=2).selectExpr(f"repeat('x', {size}) AS body")
    rates = []
    for _ in range(2):
        t = time.perf_counter()
        df.write.format("shardmq").option("uri", uri).option("exchange", "").option("routingKey", queue) \
            .mode("append").save()
        rates.append(_rate(n, time.perf_counter() - t))
    with AMQPClient(uri).connect() as c:
        c.queue_delete(queue)
    return plain, rates[1]


def _segments_plain(files: list) -> float:
    t = time.perf_counter()
    got = 0
    for f in files:
        for _ in segments.read_segment(f):
            got += 1
    return _rate(got, time.perf_counter() - t)


def _lag(spark: Any, uri: str, queue: str, rate: int, seconds: int) -> dict[str, float]:
    lags: list[float] = []
    batch_max: list[float] = []

    def sink(batch: Any, _batch_id: int) -> None:
        row = batch.selectExpr("min(CAST(substring(CAST(body AS STRING), 1, 13) AS LONG)) AS lo",
                               "max(CAST(substring(CAST(body AS STRING), 1, 13) AS LONG)) AS hi",
                               "count(*) AS n").first()
        now = time.time() * 1000
        if row.n:
            batch_max.append(now - row.lo)
            lags.extend((now - row.lo, now - row.hi))

    d = tempfile.mkdtemp(prefix="shardmq-lag-")
    q = (spark.readStream.format("shardmq").option("uri", uri).option("queue", queue).load()
         .writeStream.foreachBatch(sink).option("checkpointLocation", os.path.join(d, "ck"))
         .trigger(processingTime="0 seconds").start())
    stop = threading.Event()

    def publisher() -> None:
        props = commands.Basic.Properties(delivery_mode=2).marshal()
        with AMQPClient(uri).connect() as c:
            t0 = time.perf_counter()
            sent = 0
            while not stop.is_set():
                due = int((time.perf_counter() - t0) * rate) - sent
                if due <= 0:
                    time.sleep(0.002)
                    continue
                now = b"%013d" % int(time.time() * 1000)
                c.send(b"".join(encoder.encode_publish(1, "", queue, False, props, now + b"x" * 87, c.frame_max)
                                for _ in range(due)))
                sent += due

    time.sleep(3)  # let the query start and run its first (empty) batches
    th = threading.Thread(target=publisher, daemon=True)
    th.start()
    time.sleep(seconds)
    stop.set()
    th.join()
    time.sleep(3)
    q.stop()
    warm = batch_max[2:] if len(batch_max) > 4 else batch_max
    return {"batches": len(batch_max), "median_batch_max_ms": statistics.median(warm) if warm else float("nan"),
            "p95_batch_max_ms": sorted(warm)[int(len(warm) * 0.95)] if warm else float("nan"),
            "max_ms": max(warm) if warm else float("nan")}


def main(args: Any) -> int:
    from pipeline.session import local_session

    uri, n, size = args.uri, args.messages, args.size
    queue = f"bench-{int(time.time())}"
    with AMQPClient(uri).connect() as c:
        c.queue_declare(queue, durable=True, arguments={"x-queue-type": "stream"})
    t = time.perf_counter()
    _publish(uri, queue, n, size)
    print(f"published {n} x {size} B to stream '{queue}' in {time.perf_counter() - t:.1f}s")
    results: dict[str, float] = {}
    results["amqp plain (1 consumer, project client)"] = _plain_amqp(uri, queue, n)
    results["amqp pika (1 consumer)"] = _pika(uri, queue, min(n, 200_000))
    spark = local_session(master=args.master, app="shardmq-bench")
    df = spark.read.format("shardmq").option("uri", uri).option("queue", queue).load()
    first, second = _spark_count(df, n)
    results[f"spark shardmq batch ({args.master}, cold)"] = first
    results[f"spark shardmq batch ({args.master})"] = second
    wall, busy = _spark_stream(spark, uri, queue, n)
    results[f"spark shardmq stream ({args.master}, AvailableNow, wall)"] = wall
    results[f"spark shardmq stream ({args.master}, in its batches)"] = busy
    if args.data_dir:
        files = segments.plan(args.data_dir, queue=queue)
        results["segments plain (1 process)"] = _segments_plain(files)
        sdf = spark.read.format("shardmq-segments").option("queue", queue).load(args.data_dir)
        first, second = _spark_count(sdf, n)
        results[f"spark shardmq-segments ({args.master}, cold)"] = first
        results[f"spark shardmq-segments ({args.master})"] = second
    w_plain, w_spark = _writes(spark, uri, min(n, 200_000), size)
    print(f"\nread rates, {n} records of {size} B (records/s):")
    for k, v in results.items():
        print(f"  {k:48} {v:12,.0f}")
    print(f"\nwrite rates, {min(n, 200_000)} records of {size} B with confirms (records/s):")
    print(f"  {'plain Publisher loop (1 connection)':48} {w_plain:12,.0f}")
    print(f"  {'spark df.write.format(shardmq) (' + args.master + ', 2 partitions)':48} {w_spark:12,.0f}")
    if args.lag_rate:
        lag_q = f"{queue}-lag"
        with AMQPClient(uri).connect() as c:
            c.queue_declare(lag_q, durable=True, arguments={"x-queue-type": "stream"})
        lag = _lag(spark, uri, lag_q, args.lag_rate, args.lag_seconds)
        print(f"\nstreaming lag at {args.lag_rate} msg/s for {args.lag_seconds}s (publish -> end of its micro-batch):")
        for k, v in lag.items():
            print(f"  {k:24} {v:10.0f}")
    spark.stop()
    return 0
