"""`spark.read.format("shardmq-segments").load(PATH)`: a node's segment files as a DataFrame.

One Spark partition per segment file (8 MiB by default), read by `pipeline.segments` with a
CRC32 check of every record, in Arrow batches of up to BATCH_ROWS records built from whole columns
(`pipeline.segment_columns`), never a Python object per record. Options:

- `vhost`, `queue`: only that vhost / queue (names, as in the `.vhost` / `.queue` files).
- `mode`: `PERMISSIVE` (default: a corrupt record is counted, skipped and logged at WARNING) or
  `FAILFAST` (the first corrupt record fails the job, naming the file and position).
- `includeAcked`: `true` to also return records of classic queues that were acked (removed);
  the `acked` column tells them apart. Default `false`: what a consumer would still get.
- `bodyFormat` / `bodySchema`: as for the `shardmq` format (pipeline/schema.py).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

from pipeline.props import PropsDecoder
from pipeline.schema import BatchBuilder, OptionError, body_options, schema_ddl
from pipeline.segments import MODES, ScanStats, SegmentFile, plan, read_segment_batches

log = logging.getLogger(__name__)
BATCH_ROWS = 8192


def _bool(options: Any, key: str, default: bool) -> bool:
    v = str(options.get(key, default)).strip().lower()
    if v not in ("true", "false"):
        raise OptionError(f"option {key} must be true or false, not {options.get(key)!r}")
    return v == "true"


class SegmentPartition(InputPartition):
    def __init__(self, seg: SegmentFile) -> None:
        super().__init__(seg.path)
        self.seg = seg


class SegmentsReader(DataSourceReader):
    def __init__(self, options: Any, schema: Any) -> None:
        path = options.get("path")
        if not path:
            raise OptionError("shardmq-segments needs a path: .load(DATA_DIR_OR_QUEUE_DIR)")
        self.path = path
        self.vhost = options.get("vhost")
        self.queue = options.get("queue")
        self.mode = str(options.get("mode", "PERMISSIVE")).upper()
        if self.mode not in MODES:
            raise OptionError(f"option mode must be PERMISSIVE or FAILFAST, not {options.get('mode')!r}")
        self.include_acked = _bool(options, "includeAcked", False)
        self.body_format, _ = body_options(options)
        self.schema = schema

    def partitions(self) -> list[SegmentPartition]:
        return [SegmentPartition(s) for s in plan(self.path, self.vhost, self.queue)]

    def read(self, partition: SegmentPartition) -> Iterator[Any]:
        if not isinstance(partition, SegmentPartition):
            return  # Spark plans one placeholder partition when partitions() is empty
        import pyarrow as pa

        seg = partition.seg
        builder = BatchBuilder(self.schema, self.body_format, segments=True)
        offset_type = builder.arrow_schema.field(0).type
        decode = PropsDecoder().decode
        stats = ScanStats()
        for batch in read_segment_batches(seg, self.mode, self.include_acked, stats, BATCH_ROWS):
            run = batch.run
            # Properties: a stream usually holds a few distinct blobs; each is decoded once per batch.
            props = run.props.dictionary_encode()
            distinct = [decode(p) for p in props.dictionary.to_pylist()]
            offset = (pa.array(batch.offset, offset_type) if batch.offset is not None
                      else pa.nulls(len(run), offset_type))
            yield builder.assemble(
                offset, pa.array(run.ts), run.routing_key, run.exchange, distinct, props.indices, run.body,
                (seg.vhost, seg.queue, seg.no, pa.array(run.position),
                 pa.array(batch.acked) if batch.acked is not None else None))
        if stats.corrupt:
            log.warning("shardmq-segments: %s: %d corrupt record(s) skipped (mode PERMISSIVE): %s",
                        seg.path, stats.corrupt, "; ".join(stats.problems[:5]))


class SegmentsDataSource(DataSource):
    """Format `shardmq-segments` (batch only)."""

    @classmethod
    def name(cls) -> str:
        return "shardmq-segments"

    def schema(self) -> str:
        return schema_ddl(self.options, segments=True)

    def reader(self, schema: Any) -> SegmentsReader:
        return SegmentsReader(self.options, schema)
