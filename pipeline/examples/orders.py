"""The orders pipeline: a synthetic order stream through a stream queue, Structured Streaming and back.

1. `publish_orders`: N orders as JSON (order_id, region, sku, amount, event_time) to the stream
   queue `orders`; event times advance evenly over `minutes` minutes ending now, and one last
   "tick" order an hour later moves the watermark past every real window.
2. `run_streaming`: `readStream.format("shardmq")` with the body decoded as JSON, a 1-minute
   watermark, totals per minute and region; each micro-batch's closed windows are appended to
   Parquet and published as JSON to the fanout exchange `order-stats`, which the queue
   `order-stats` receives.
3. `read_stats_queue`: the consumer side: every window result from the `order-stats` queue.
4. `replay_last_hour`: a batch job that replays the stream from one hour ago by timestamp
   (`startingOffset` = an ISO time) and totals it per region.
5. `plot`: a PNG of amount per minute and region from the Parquet output.

Run it all with `shardmq-pipeline orders` (pipeline/cli.py); docs/pipeline.md walks through it.
"""

from __future__ import annotations

import datetime as dt
import json
import random
import time
from typing import Any

from pamqp import commands

from broker.amqp import encoder
from loadtest.amqp_client import AMQPClient

STREAM = "orders"
EXCHANGE = "order-stats"
STATS_QUEUE = "order-stats"
REGIONS = ("eu", "us", "apac")
SKUS = ("book", "lamp", "desk", "pen", "mug")
ORDER_SCHEMA = "order_id long, region string, sku string, amount double, event_time timestamp"
STATS_SCHEMA = "window_start timestamp, window_end timestamp, region string, orders long, amount double"


def declare(uri: str) -> None:
    """The stream queue, the results exchange and the queue its consumer reads (idempotent)."""
    with AMQPClient(uri).connect() as c:
        c.queue_declare(STREAM, durable=True, arguments={"x-queue-type": "stream"})
        c.exchange_declare(EXCHANGE, "fanout", durable=True)
        c.queue_declare(STATS_QUEUE, durable=True)
        c.queue_bind(STATS_QUEUE, EXCHANGE, "")


def make_orders(n: int, minutes: int, end: dt.datetime, seed: int = 7) -> list[dict[str, Any]]:
    """n orders with event times spread evenly over `minutes` minutes before `end` (deterministic)."""
    rnd = random.Random(seed)
    start = end - dt.timedelta(minutes=minutes)
    step = dt.timedelta(minutes=minutes) / n
    orders = []
    for i in range(n):
        orders.append({
            "order_id": i, "region": REGIONS[rnd.randrange(3)], "sku": SKUS[rnd.randrange(len(SKUS))],
            "amount": round(rnd.uniform(1, 200), 2), "event_time": (start + i * step).isoformat(),
        })
    return orders


def publish_orders(uri: str, orders: list[dict[str, Any]]) -> int:
    """Publish the orders (and the watermark tick) to the stream; returns once the stream holds them."""
    tick = {"order_id": -1, "region": "tick", "sku": "", "amount": 0.0,
            "event_time": (dt.datetime.fromisoformat(orders[-1]["event_time"]) + dt.timedelta(hours=1)).isoformat()}
    with AMQPClient(uri).connect() as c:
        before = c.queue_declare(STREAM, passive=True)[1]
        buf = []
        for o in [*orders, tick]:
            props = commands.Basic.Properties(content_type="application/json", delivery_mode=2,
                                              message_id=str(o["order_id"]),
                                              headers={"x-stream-filter-value": o["region"]}).marshal()
            buf.append(encoder.encode_publish(1, "", STREAM, False, props, json.dumps(o).encode(), c.frame_max))
            if len(buf) >= 500:
                c.send(b"".join(buf))
                buf = []
        c.send(b"".join(buf))
        want = before + len(orders) + 1
        deadline = time.monotonic() + 60
        while c.queue_declare(STREAM, passive=True)[1] < want:
            if time.monotonic() > deadline:
                raise TimeoutError(f"stream {STREAM} did not reach {want} messages")
            time.sleep(0.05)
    return len(orders)


def window_totals(spark: Any, uri: str, starting: str = "first", per_trigger: int | None = None) -> Any:
    """The streaming DataFrame of closed 1-minute windows per region (watermark 1 minute)."""
    from pyspark.sql import functions as F

    reader = (spark.readStream.format("shardmq").option("uri", uri).option("queue", STREAM)
              .option("startingOffset", starting).option("bodyFormat", "json").option("bodySchema", ORDER_SCHEMA))
    if per_trigger:
        reader = reader.option("maxRecordsPerTrigger", str(per_trigger))
    # The tick is not filtered out: Spark would push the filter below the watermark, which then
    # never sees it. Its own window is an hour ahead of every other, so the watermark never closes it.
    orders = reader.load().withWatermark("event_time", "1 minute")
    return (orders
            .groupBy(F.window("event_time", "1 minute"), "region")
            .agg(F.count("*").alias("orders"), F.round(F.sum("amount"), 2).alias("amount"))
            .select(F.col("window.start").alias("window_start"), F.col("window.end").alias("window_end"),
                    "region", "orders", "amount"))


def run_streaming(spark: Any, uri: str, out_dir: str, checkpoint: str, starting: str = "first",
                  per_trigger: int | None = 2000, available_now: bool = True) -> Any:
    """Start the query: closed windows go to Parquet (out_dir) and, as JSON, to the exchange. Returns it.

    With `available_now` it processes what the stream holds now (in batches of `per_trigger`),
    runs the batch that emits the windows the final watermark closed, and stops by itself.
    """
    def sink(batch: Any, batch_id: int) -> None:
        batch = batch.persist()
        try:
            batch.write.mode("append").parquet(out_dir)
            (batch.selectExpr("to_json(struct(*)) AS body", "region AS routing_key")
             .write.format("shardmq").option("uri", uri).option("exchange", EXCHANGE).mode("append").save())
        finally:
            batch.unpersist()

    writer = (window_totals(spark, uri, starting, per_trigger).writeStream.outputMode("append")
              .option("checkpointLocation", checkpoint).foreachBatch(sink))
    if available_now:
        writer = writer.trigger(availableNow=True)
    return writer.start()


def read_stats_queue(uri: str, expect: int, timeout: float = 60.0) -> list[dict[str, Any]]:
    """The consumer of the results: take `expect` window results from the `order-stats` queue."""
    import pika

    params = pika.URLParameters(uri)
    conn = pika.BlockingConnection(params)
    try:
        ch = conn.channel()
        got: list[dict[str, Any]] = []
        deadline = time.monotonic() + timeout
        for method, _props, body in ch.consume(STATS_QUEUE, auto_ack=True, inactivity_timeout=1.0):
            if method is not None:
                got.append(json.loads(body))
            if len(got) >= expect or time.monotonic() > deadline:
                break
        ch.cancel()
        return got
    finally:
        conn.close()


def replay_last_hour(spark: Any, uri: str, now: dt.datetime | None = None) -> list[Any]:
    """Batch: replay what the stream stored in the past hour (by timestamp) and total it per region."""
    since = ((now or dt.datetime.now(dt.UTC)) - dt.timedelta(hours=1)).replace(microsecond=0)
    df = (spark.read.format("shardmq").option("uri", uri).option("queue", STREAM)
          .option("startingOffset", since.isoformat()).option("bodyFormat", "json")
          .option("bodySchema", ORDER_SCHEMA).load().where("region != 'tick'"))
    return (df.groupBy("region").agg({"*": "count", "amount": "sum"})
            .withColumnRenamed("count(1)", "orders").withColumnRenamed("sum(amount)", "amount")
            .orderBy("region").collect())


def plot(spark: Any, out_dir: str, png: str) -> None:
    """Amount per minute and region from the Parquet results (matplotlib, headless)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = spark.read.schema(STATS_SCHEMA).parquet(out_dir).orderBy("window_start").collect()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for region in REGIONS:
        pts = [(r.window_start, r.amount) for r in rows if r.region == region]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=region)
    ax.set_title("Orders pipeline: amount per 1-minute window and region (Structured Streaming over ShardMQ)")
    ax.set_xlabel("event time (UTC)")
    ax.set_ylabel("amount")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.autofmt_xdate()
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)

