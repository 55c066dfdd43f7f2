"""`spark.read.format("shardmq-segments").load(PATH)`: a node's segment files as a DataFrame.

One Spark partition per segment file (8 MiB by default), read by `pipeline.segments` with a
CRC32 check of every record. Options:

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
from pipeline.segments import MODES, ScanStats, SegmentFile, plan, read_segment

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
        seg = partition.seg
        builder = BatchBuilder(self.schema, self.body_format, segments=True)
        decode = PropsDecoder().decode
        stats = ScanStats()
        consts = (seg.vhost, seg.queue, seg.no)
        any_acked = False
        b_off, b_ts, b_rk, b_ex, b_idx, b_body, b_pos = (
            builder.offset, builder.ts, builder.rk, builder.ex, builder.pidx, builder.body, builder.position)
        pmap = builder.pmap
        for offset, ts, _flags, ex, rk, props, body, pos, acked in read_segment(
                seg, self.mode, self.include_acked, stats):
            i = pmap.get(props)
            if i is None:
                i = builder.new_props(props, decode(props))
            b_idx.append(i)
            b_off.append(offset)
            b_ts.append(ts)
            b_rk.append(rk)
            b_ex.append(ex)
            b_body.append(body)
            b_pos.append(pos)
            if acked and not any_acked:  # the acked column is built only for batches holding acked rows
                any_acked = True
                builder.acked.extend([False] * (len(b_idx) - 1))
            if any_acked:
                builder.acked.append(acked)
            if len(b_idx) >= BATCH_ROWS:
                yield builder.flush(*consts)
                any_acked = False
                b_off, b_ts, b_rk, b_ex, b_idx, b_body, b_pos = (
                    builder.offset, builder.ts, builder.rk, builder.ex, builder.pidx, builder.body,
                    builder.position)
                pmap = builder.pmap
        if len(builder):
            yield builder.flush(*consts)
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
