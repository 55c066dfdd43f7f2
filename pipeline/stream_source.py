"""Format `shardmq`: read a stream queue (batch and streaming) and write to an exchange.

Reading (options): `uri` (amqp://user:pass@host:port/vhost), `queue`, `startingOffset`,
`endingOffset` (pipeline/offsets.py), `filter` (comma-separated `x-stream-filter-value`s; with
`matchUnfiltered=true` messages without that header pass too), `maxRecordsPerPartition`
(default 100000), `bodyFormat`/`bodySchema` (pipeline/schema.py), and for streaming
`maxRecordsPerTrigger` and `failOnDataLoss` (default true).

The driver turns the offsets into numbers with short probe consumers and cuts [start, end) into
partitions; each task opens its own connection and consumer at `x-stream-offset` = its start and
stops at its end. A stream filter is applied by the task with the broker's rule (the header
`x-stream-filter-value`, comma-separated values), not by the broker: a broker-side filtered
consumer cannot tell a reader that the rest of its range held nothing that matched.

Streaming offsets are `{"offset": next offset to read}` in Spark's checkpoint; nothing is stored
on the broker, so a restarted query (after a stop or a kill) resumes from its checkpoint and a
file sink holds every message once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    InputPartition,
)

from loadtest.amqp_client import AMQPClient, AMQPClosed
from pipeline import offsets
from pipeline.amqp import DataLoss, StreamError, connect, read_range
from pipeline.props import PropsDecoder
from pipeline.schema import BatchBuilder, OptionError, body_options, schema_ddl

try:
    from pyspark.sql.streaming.datasource import SupportsTriggerAvailableNow
except ImportError:  # pyspark < 4.2: no Trigger.AvailableNow for Python sources

    class SupportsTriggerAvailableNow:  # type: ignore[no-redef]
        pass


log = logging.getLogger(__name__)
BATCH_ROWS = 8192
DEFAULT_PER_PARTITION = 100_000
CONNECT_ATTEMPTS = 6  # back-off 0.5, 1, 2, 4, 8 s between them


def _int_option(options: Any, key: str, default: int | None, minimum: int = 1) -> int | None:
    v = options.get(key)
    if v is None:
        return default
    try:
        n = int(str(v))
    except ValueError:
        raise OptionError(f"option {key} must be an integer >= {minimum}, not {v!r}") from None
    if n < minimum:
        raise OptionError(f"option {key} must be an integer >= {minimum}, not {v!r}")
    return n


def _bool_option(options: Any, key: str, default: bool) -> bool:
    v = str(options.get(key, default)).strip().lower()
    if v not in ("true", "false"):
        raise OptionError(f"option {key} must be true or false, not {options.get(key)!r}")
    return v == "true"


class ReadOptions:
    """The checked read options (picklable: shipped to every task)."""

    def __init__(self, options: Any, streaming: bool) -> None:
        self.uri = options.get("uri")
        self.queue = options.get("queue")
        if not self.uri:
            raise OptionError("option uri is required (amqp://user:pass@host:port/vhost)")
        if not self.queue:
            raise OptionError("option queue is required (the name of a stream queue)")
        default_start = "next" if streaming else "first"
        self.start = offsets.parse(options.get("startingOffset", default_start), "startingOffset")
        self.end = offsets.parse(options.get("endingOffset", "next"), "endingOffset")
        if streaming and options.get("endingOffset") is not None:
            raise OptionError("option endingOffset is for batch reads only")
        self.per_partition = _int_option(options, "maxRecordsPerPartition", DEFAULT_PER_PARTITION)
        self.per_trigger = _int_option(options, "maxRecordsPerTrigger", None)
        self.fail_on_data_loss = _bool_option(options, "failOnDataLoss", True)
        flt = options.get("filter")
        self.filters = frozenset(v.strip() for v in str(flt).split(",") if v.strip()) if flt else None
        self.match_unfiltered = _bool_option(options, "matchUnfiltered", False)
        self.body_format, _ = body_options(options)


class RangePartition(InputPartition):
    def __init__(self, start: int, end: int) -> None:
        super().__init__((start, end))
        self.start = start
        self.end = end


def _passes(filters: frozenset[str], match_unfiltered: bool, headers: list | None) -> bool:
    """The broker's stream filter rule (shard.stream_queue.Reader.matches) on decoded headers."""
    if headers:
        for k, v in headers:
            if k == "x-stream-filter-value":
                if v is None:
                    return match_unfiltered
                return any(x.strip() in filters for x in v.split(","))
    return match_unfiltered


def read_partition(opts: ReadOptions, schema: Any, start: int, end: int) -> Iterator[Any]:
    """Arrow batches of the messages with start <= offset < end (one consumer at a time, see resilient_range)."""
    builder = BatchBuilder(schema, opts.body_format)
    decode = PropsDecoder().decode
    filters = opts.filters
    unfiltered = opts.match_unfiltered
    b_off, b_rk, b_ex, b_idx, b_body = builder.offset, builder.rk, builder.ex, builder.pidx, builder.body
    pmap = builder.pmap
    for offset, ex, rk, props, body in resilient_range(opts, start, end):
        i = pmap.get(props)
        if i is None:
            decoded = decode(props)
            if filters is not None and not _passes(filters, unfiltered, decoded[0]):
                continue
            i = builder.new_props(props, decoded)
        elif filters is not None and not _passes(filters, unfiltered, builder.distinct[i][0]):
            continue
        b_idx.append(i)
        b_off.append(offset)
        b_rk.append(rk)
        b_ex.append(ex)
        b_body.append(body)
        if len(b_idx) >= BATCH_ROWS:
            yield builder.flush()
            b_off, b_rk, b_ex, b_idx, b_body = (builder.offset, builder.rk, builder.ex, builder.pidx,
                                                builder.body)
            pmap = builder.pmap
    if len(builder):
        yield builder.flush()


def resilient_range(opts: ReadOptions, start: int, end: int) -> Iterator[tuple[int, str, str, bytes, bytes]]:
    """read_range over a connection that is re-opened, with back-off, when the broker connection is lost.

    A new consumer resumes at the offset after the last message returned, so nothing is returned
    twice or skipped. Channel errors (a deleted queue) and data loss are not retried.
    """
    cur = start
    failures = 0
    delay = 0.5
    while cur < end:
        client = None
        try:
            client = connect(opts.uri, attempts=CONNECT_ATTEMPTS)
            for item in read_range(client, opts.queue, cur, end, fail_on_data_loss=opts.fail_on_data_loss):
                cur = item[0] + 1
                failures = 0
                yield item
            return
        except (OSError, AMQPClosed) as exc:
            if isinstance(exc, AMQPClosed) and exc.channel:
                raise
            failures += 1
            if failures >= CONNECT_ATTEMPTS:
                raise
            log.warning("shardmq: connection lost at offset %d (%s); resuming in %.1fs", cur, exc, delay)
            time.sleep(delay)
            delay = min(delay * 2, 8.0)
        finally:
            if client is not None:
                try:
                    client.close(timeout=0.5)
                except Exception:
                    pass


class StreamBatchReader(DataSourceReader):
    def __init__(self, options: Any, schema: Any) -> None:
        self.opts = ReadOptions(options, streaming=False)
        self.schema = schema

    def partitions(self) -> list[RangePartition]:
        o = self.opts
        client = connect(o.uri, attempts=CONNECT_ATTEMPTS)
        try:
            b = offsets.bounds(client, o.queue)
            start = offsets.resolve(client, o.queue, o.start, b, as_end=False)
            end = offsets.resolve(client, o.queue, o.end, b, as_end=True)
        finally:
            client.close()
        assert o.per_partition is not None
        return [RangePartition(s, e) for s, e in offsets.split(start, end, o.per_partition)]

    def read(self, partition: RangePartition) -> Iterator[Any]:
        if not isinstance(partition, RangePartition):
            return iter(())  # Spark plans one placeholder partition when partitions() is empty
        return read_partition(self.opts, self.schema, partition.start, partition.end)


class StreamStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Micro-batches over a stream queue; offsets live in Spark's checkpoint only."""

    def __init__(self, options: Any, schema: Any) -> None:
        self.opts = ReadOptions(options, streaming=True)
        self.schema = schema
        self._client: AMQPClient | None = None
        self._last_end: int | None = None  # for Spark versions that call latestOffset() without start
        self._target: int | None = None  # Trigger.AvailableNow: never read past this offset

    def _call(self, fn: Any) -> Any:
        """Run fn(client), reconnecting with back-off when the connection is lost."""
        delay = 0.5
        for attempt in range(CONNECT_ATTEMPTS):
            try:
                if self._client is None:
                    self._client = connect(self.opts.uri)
                return fn(self._client)
            except (OSError, AMQPClosed) as exc:
                if self._client is not None:
                    try:
                        self._client.close(timeout=0.5)
                    except Exception:
                        pass
                    self._client = None
                if attempt == CONNECT_ATTEMPTS - 1:
                    raise StreamError(f"broker at {self.opts.uri.rsplit('@', 1)[-1]} unreachable: {exc}") from exc
                log.warning("shardmq: connection lost (%s); retrying in %.1fs", exc, delay)
                time.sleep(delay)
                delay = min(delay * 2, 10.0)
        raise AssertionError("unreachable")

    def initialOffset(self) -> dict:
        o = self.opts

        def first(client: AMQPClient) -> int:
            b = offsets.bounds(client, o.queue)
            return offsets.resolve(client, o.queue, o.start, b, as_end=False)

        return {"offset": self._call(first)}

    def prepareForTriggerAvailableNow(self) -> None:
        o = self.opts
        self._target = self._call(lambda client: offsets.bounds(client, o.queue)).next

    def getDefaultReadLimit(self) -> Any:
        from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows

        n = self.opts.per_trigger
        return ReadMaxRows(n) if n else ReadAllAvailable()

    def latestOffset(self, start: dict | None = None, limit: Any = None) -> dict:
        o = self.opts
        b = self._call(lambda client: offsets.bounds(client, o.queue))
        begin = start["offset"] if start is not None else self._last_end
        if begin is not None and begin < b.first:
            if o.fail_on_data_loss:
                raise DataLoss(o.queue, begin, b.first)
            log.warning("shardmq: stream '%s': offsets %d..%d removed by retention before they were read; "
                        "continuing at %d (failOnDataLoss=false)", o.queue, begin, b.first - 1, b.first)
        end = b.next if self._target is None else min(b.next, self._target)
        max_rows = getattr(limit, "max_rows", None) if limit is not None else o.per_trigger
        if max_rows is not None and begin is not None:
            end = min(end, max(begin, b.first) + int(max_rows))
        if begin is not None:
            end = max(end, begin)
        self._last_end = end
        return {"offset": end}

    def partitions(self, start: dict, end: dict) -> list[RangePartition]:
        s, e = int(start["offset"]), int(end["offset"])
        assert self.opts.per_partition is not None
        return [RangePartition(a, b) for a, b in offsets.split(s, e, self.opts.per_partition)]

    def read(self, partition: RangePartition) -> Iterator[Any]:
        if not isinstance(partition, RangePartition):
            return iter(())  # Spark plans one placeholder partition when partitions() is empty
        return read_partition(self.opts, self.schema, partition.start, partition.end)

    def commit(self, end: dict) -> None:
        pass  # the checkpoint is the only offset store; the broker keeps the log by retention

    def stop(self) -> None:
        if self._client is not None:
            self._client.close(timeout=0.5)
            self._client = None


class StreamDataSource(DataSource):
    """Format `shardmq`."""

    @classmethod
    def name(cls) -> str:
        return "shardmq"

    def schema(self) -> str:
        return schema_ddl(self.options)

    def reader(self, schema: Any) -> StreamBatchReader:
        return StreamBatchReader(self.options, schema)

    def streamReader(self, schema: Any) -> StreamStreamReader:
        return StreamStreamReader(self.options, schema)

    def writer(self, schema: Any, overwrite: bool) -> Any:
        from pipeline.writer import ExchangeWriter

        return ExchangeWriter(self.options, schema)

    def streamWriter(self, schema: Any, overwrite: bool) -> Any:
        from pipeline.writer import ExchangeStreamWriter

        return ExchangeStreamWriter(self.options, schema)


__all__ = ["StreamDataSource", "DataLoss"]
