"""ShardMQ's Spark data sources (formats `shardmq` and `shardmq-segments`) and example pipelines.

    from pipeline import register
    register(spark)

See docs/pipeline.md. PySpark (>= 4.0, the Python Data Source API) and pyarrow are the
`spark` extra of the package (with numpy); nothing here imports them until `register` is called
(`pipeline.segments`, the Spark-free segment reader, needs numpy and pyarrow).
"""

from __future__ import annotations

from typing import Any


def register(spark: Any) -> None:
    """Register the `shardmq` (stream queues and exchanges) and `shardmq-segments` formats on a session."""
    from pipeline.segments_source import SegmentsDataSource
    from pipeline.stream_source import StreamDataSource

    spark.dataSource.register(StreamDataSource)
    spark.dataSource.register(SegmentsDataSource)
