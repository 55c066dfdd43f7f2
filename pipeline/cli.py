"""`shardmq-pipeline`: run the example orders pipeline or the data source benchmark.

    shardmq-pipeline orders --uri amqp://guest:guest@127.0.0.1:5672/ --out /tmp/orders --plot orders.png
    shardmq-pipeline bench --uri amqp://guest:guest@127.0.0.1:5672/ --data-dir DATA --messages 1000000

(`python -m pipeline.cli ...` is the same.) docs/pipeline.md explains both.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys


def _orders(args: argparse.Namespace) -> int:
    from pipeline.examples import orders as ex
    from pipeline.session import local_session

    ex.declare(args.uri)
    now = dt.datetime.now(dt.UTC).replace(second=0, microsecond=0)
    batch = ex.make_orders(args.orders, args.minutes, now)
    print(f"publishing {len(batch)} orders over {args.minutes} minutes of event time to stream '{ex.STREAM}'")
    ex.publish_orders(args.uri, batch)
    spark = local_session(master=args.master, app="shardmq-orders")
    results = os.path.join(args.out, "windows")
    query = ex.run_streaming(spark, args.uri, results, os.path.join(args.out, "checkpoint"), starting=args.start)
    query.awaitTermination()  # Trigger.AvailableNow: stops once everything stored now is processed
    windows = spark.read.schema(ex.STATS_SCHEMA).parquet(results)
    n = windows.count()
    print(f"streaming query wrote {n} closed windows to {results} (Parquet) and to exchange '{ex.EXCHANGE}'")
    windows.orderBy("window_start", "region").show(12, truncate=False)
    got = ex.read_stats_queue(args.uri, n)
    print(f"consumer of queue '{ex.STATS_QUEUE}' received {len(got)} window results, e.g. {got[0] if got else None}")
    print("batch replay of the past hour by timestamp, per region:")
    for r in ex.replay_last_hour(spark, args.uri):
        print(f"  {r.region:5} orders={r.orders:7d} amount={r.amount:12.2f}")
    if args.plot:
        ex.plot(spark, results, args.plot)
        print(f"plot written to {args.plot}")
    spark.stop()
    return 0


def _bench(args: argparse.Namespace) -> int:
    from pipeline import bench

    return bench.main(args)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="shardmq-pipeline", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    o = sub.add_parser("orders", help="the example: orders stream -> windowed totals -> Parquet + exchange")
    o.add_argument("--uri", default="amqp://guest:guest@127.0.0.1:5672/", help="broker URI")
    o.add_argument("--out", required=True, help="directory for the Parquet results and the checkpoint")
    o.add_argument("--orders", type=int, default=20000, help="synthetic orders to publish (default 20000)")
    o.add_argument("--minutes", type=int, default=15, help="event-time span of the orders (default 15)")
    o.add_argument("--start", default="first", help="startingOffset of the streaming query (default first)")
    o.add_argument("--plot", help="write a PNG of amount per minute and region here")
    o.add_argument("--master", default="local[2]", help="Spark master (default local[2])")
    o.set_defaults(fn=_orders)
    b = sub.add_parser("bench", help="read rates of both formats vs a plain client loop; streaming lag")
    b.add_argument("--uri", default="amqp://guest:guest@127.0.0.1:5672/", help="broker URI")
    b.add_argument("--data-dir", help="the node's data dir (for the segment-file read); skipped if absent")
    b.add_argument("--messages", type=int, default=1_000_000, help="messages in the benchmark stream")
    b.add_argument("--size", type=int, default=100, help="body bytes (default 100)")
    b.add_argument("--lag-rate", type=int, default=2000, help="publish rate (msg/s) of the lag test; 0 skips it")
    b.add_argument("--lag-seconds", type=int, default=30, help="duration of the lag test")
    b.add_argument("--master", default="local[2]", help="Spark master (default local[2])")
    b.add_argument("--runs", type=int, default=3, help="measured runs of each read (default 3)")
    b.add_argument("--only", help="comma-separated parts to run: plain,pika,batch,stream,segments,write,lag")
    b.add_argument("--broker-pid", type=int, help="the node's pid: also report the broker's CPU time per record")
    b.set_defaults(fn=_bench)
    args = p.parse_args(argv)
    try:
        return args.fn(args)
    except KeyboardInterrupt:
        return 130
    except (OSError, ValueError) as exc:
        print(f"shardmq-pipeline: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
