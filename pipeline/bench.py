"""`shardmq-pipeline bench`: read rates of both formats against plain client loops, and streaming lag.

On one node (the --uri one) it publishes --messages bodies of --size bytes to a fresh stream queue
and measures, each as records/s:

- `amqp plain`: one consumer of the project's own client reading the stream (no Spark);
- `amqp pika`: one pika consumer (a widely used client) on the first 200k messages;
- `spark shardmq batch`: `spark.read.format("shardmq")` on --master, count + sum(length(body));
- `spark shardmq stream`: a streaming query draining the same backlog (Trigger.AvailableNow);
- `segments plain`: `pipeline.segments.read_segment_batches` over the stream's files in one process;
- `spark shardmq-segments`: `spark.read.format("shardmq-segments")` on the same files;

then the end-to-end lag of a streaming query (publish time to the end of the micro-batch that
processed it) while a publisher sends --lag-rate msg/s for --lag-seconds.

Every read is measured --runs times (Spark's after one warm-up run that starts the JVM's work and
the Python workers) and printed with the load average and the CPU time per record of this process
and all its children (the JVM, Spark's Python workers), plus the broker's with --broker-pid: on a
shared machine the rate swings with the load, the CPU time per record much less.
"""

from __future__ import annotations

import os
import statistics
import sys
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


def _tree_cpu(root: int) -> float:
    """CPU seconds used so far by process `root` and its live descendants (and the children they reaped)."""
    children: dict[int, list[int]] = {}
    own: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid = int(name)
        children.setdefault(int(fields[1]), []).append(pid)
        own[pid] = sum(int(x) for x in fields[11:15]) / tick  # utime stime cutime cstime
    total = 0.0
    stack = [root]
    while stack:
        pid = stack.pop()
        total += own.get(pid, 0.0)
        stack.extend(children.get(pid, ()))
    return total


class Meter:
    """Times one measured read: records/s, and CPU µs per record of this process tree (+ the broker's)."""

    def __init__(self, broker_pid: int | None) -> None:
        self.broker_pid = broker_pid

    def _cpu(self) -> tuple[float, float]:
        return _tree_cpu(os.getpid()), (_tree_cpu(self.broker_pid) if self.broker_pid else 0.0)

    def run(self, fn: Any) -> dict[str, float]:
        c0, b0 = self._cpu()
        t = time.perf_counter()
        n = fn()
        secs = time.perf_counter() - t
        c1, b1 = self._cpu()
        return {"rate": _rate(n, secs), "cpu_us": (c1 - c0) / n * 1e6 if n else float("nan"),
                "broker_us": (b1 - b0) / n * 1e6 if n and self.broker_pid else float("nan"),
                "load": os.getloadavg()[0]}


def _plain_amqp(uri: str, queue: str, n: int) -> int:
    with AMQPClient(uri).connect() as c:
        return sum(1 for _ in read_range(c, queue, 0, n))


def _pika(uri: str, queue: str, n: int) -> int:
    import pika

    conn = pika.BlockingConnection(pika.URLParameters(uri))
    ch = conn.channel()
    ch.basic_qos(prefetch_count=2000)
    got = 0
    for method, _p, _b in ch.consume(queue, arguments={"x-stream-offset": "first"}, inactivity_timeout=5):
        if method is None:
            break
        got += 1
        if got % 1000 == 0:
            ch.basic_ack(method.delivery_tag, multiple=True)
        if got >= n:
            break
    conn.close()
    return got


def _spark_count(df: Any, n: int) -> int:
    count, _total = df.selectExpr("count(*)", "sum(length(body))").first()
    assert count == n, f"read {count} of {n}"
    return count


def _spark_stream(spark: Any, uri: str, queue: str, n: int, busy: list[float]) -> int:
    """Drain the stream with Trigger.AvailableNow; appends Spark's processedRowsPerSecond over its batches to `busy`."""
    d = tempfile.mkdtemp(prefix="shardmq-bench-")
    q = (spark.readStream.format("shardmq").option("uri", uri).option("queue", queue)
         .option("startingOffset", "first").load().selectExpr("length(body) AS n")
         .writeStream.format("noop").option("checkpointLocation", os.path.join(d, "ck"))
         .trigger(availableNow=True).start())
    q.awaitTermination()
    got = sum(p["numInputRows"] for p in q.recentProgress)
    assert got == n, f"streamed {got} of {n}"
    secs = sum(p["durationMs"].get("triggerExecution", 0) for p in q.recentProgress) / 1000
    busy.append(_rate(got, secs))
    return got


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


def _segments_plain(files: list) -> int:
    return sum(len(b) for f in files for b in segments.read_segment_batches(f))


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


PARTS = ("plain", "pika", "batch", "stream", "segments", "write", "lag")


def _print(name: str, results: list[dict[str, float]]) -> None:
    for i, r in enumerate(results):
        broker = f"  broker {r['broker_us']:6.2f} us/rec" if r["broker_us"] == r["broker_us"] else ""
        print(f"  {name if i == 0 else '':48} {r['rate']:10,.0f} /s  cpu {r['cpu_us']:6.2f} us/rec{broker}"
              f"  load {r['load']:5.1f}")
    if len(results) > 1:
        print(f"  {'':48} {statistics.median(r['rate'] for r in results):10,.0f} /s median, cpu "
              f"{statistics.median(r['cpu_us'] for r in results):.2f} us/rec median")
    sys.stdout.flush()


def main(args: Any) -> int:
    from pipeline.session import local_session

    uri, n, size = args.uri, args.messages, args.size
    only = set(args.only.split(",")) if args.only else set(PARTS)
    if only - set(PARTS):
        raise ValueError(f"--only takes a comma-separated list of {', '.join(PARTS)}, not {args.only!r}")
    meter = Meter(args.broker_pid)
    runs = max(1, args.runs)
    queue = f"bench-{int(time.time())}"
    with AMQPClient(uri).connect() as c:
        c.queue_declare(queue, durable=True, arguments={"x-queue-type": "stream"})
    t = time.perf_counter()
    _publish(uri, queue, n, size)
    print(f"published {n} x {size} B to stream '{queue}' in {time.perf_counter() - t:.1f}s; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"read rates, {n} records of {size} B, {runs} run(s) each (CPU: this process tree incl. "
          "Spark's JVM and Python workers):")
    if "plain" in only:
        _print("amqp plain (1 consumer, project client)", [meter.run(lambda: _plain_amqp(uri, queue, n))
                                                           for _ in range(runs)])
    if "pika" in only:
        _print("amqp pika (1 consumer)", [meter.run(lambda: _pika(uri, queue, min(n, 200_000))) for _ in range(runs)])
    spark = None
    if only & {"batch", "stream", "segments", "write", "lag"}:
        spark = local_session(master=args.master, app="shardmq-bench")
    if "batch" in only:
        df = spark.read.format("shardmq").option("uri", uri).option("queue", queue).load()
        _spark_count(df, n)  # warm-up
        _print(f"spark shardmq batch ({args.master})", [meter.run(lambda: _spark_count(df, n)) for _ in range(runs)])
    if "stream" in only:
        busy: list[float] = []
        _spark_stream(spark, uri, queue, n, busy)  # warm-up
        busy.clear()
        _print(f"spark shardmq stream ({args.master}, AvailableNow, wall)",
               [meter.run(lambda: _spark_stream(spark, uri, queue, n, busy)) for _ in range(runs)])
        print(f"  {'  ... Spark rate over its batches':48} " + ", ".join(f"{b:,.0f}" for b in busy))
    if "segments" in only and args.data_dir:
        files = segments.plan(args.data_dir, queue=queue)
        _print("segments plain (read_segment_batches, 1 process)",
               [meter.run(lambda: _segments_plain(files)) for _ in range(runs)])
        sdf = spark.read.format("shardmq-segments").option("queue", queue).load(args.data_dir)
        _spark_count(sdf, n)  # warm-up
        _print(f"spark shardmq-segments ({args.master})", [meter.run(lambda: _spark_count(sdf, n))
                                                           for _ in range(runs)])
    if "write" in only:
        w_plain, w_spark = _writes(spark, uri, min(n, 200_000), size)
        print(f"\nwrite rates, {min(n, 200_000)} records of {size} B with confirms (records/s):")
        print(f"  {'plain Publisher loop (1 connection)':48} {w_plain:12,.0f}")
        print(f"  {'spark df.write.format(shardmq) (' + args.master + ', 2 partitions)':48} {w_spark:12,.0f}")
    if "lag" in only and args.lag_rate:
        lag_q = f"{queue}-lag"
        with AMQPClient(uri).connect() as c:
            c.queue_declare(lag_q, durable=True, arguments={"x-queue-type": "stream"})
        lag = _lag(spark, uri, lag_q, args.lag_rate, args.lag_seconds)
        print(f"\nstreaming lag at {args.lag_rate} msg/s for {args.lag_seconds}s (publish -> end of its micro-batch):")
        for k, v in lag.items():
            print(f"  {k:24} {v:10.0f}")
    if spark is not None:
        spark.stop()
    return 0
