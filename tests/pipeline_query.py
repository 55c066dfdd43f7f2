"""A streaming query in its own process, for the kill -9 resume test (tests/test_pipeline_stream.py).

    python -m tests.pipeline_query URI QUEUE OUT_DIR CHECKPOINT_DIR MAX_PER_TRIGGER

Copies the stream's (offset, body) into Parquet files under OUT_DIR until killed.
"""

from __future__ import annotations

import sys

from pipeline.session import local_session


def main(argv: list[str]) -> None:
    uri, queue, out, checkpoint, per_trigger = argv
    spark = local_session(app="shardmq-test-query")
    df = (spark.readStream.format("shardmq").option("uri", uri).option("queue", queue)
          .option("startingOffset", "first").option("maxRecordsPerTrigger", per_trigger).load())
    query = (df.selectExpr("offset", "CAST(body AS STRING) AS body").writeStream.format("parquet")
             .option("path", out).option("checkpointLocation", checkpoint)
             .trigger(processingTime="100 milliseconds").start())
    print("query started", flush=True)
    query.awaitTermination()


if __name__ == "__main__":
    main(sys.argv[1:])
