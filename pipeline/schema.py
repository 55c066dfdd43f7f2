"""The DataFrame schema of both formats, and turning decoded records into Arrow record batches.

Readers yield `pyarrow.RecordBatch`es (not tuples): Spark then moves whole columns to the JVM,
which is what makes hundreds of thousands of records per second possible from Python.

Columns (see docs/pipeline.md): `offset`, `timestamp`, `routing_key`, `exchange`, `headers`
(map of string to string), `properties` (struct), `body` (binary), and for `shardmq-segments`
also `vhost`, `queue`, `segment`, `position`, `acked`. With `bodyFormat=text` the body is a
string; with `bodyFormat=json` and `bodySchema` (a DDL string) the body's JSON fields replace
`body` as top-level columns.
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

from pipeline.props import PROPERTY_FIELDS

PROPERTIES_DDL = (
    "struct<content_type: string, content_encoding: string, delivery_mode: int, priority: int, "
    "correlation_id: string, reply_to: string, expiration: string, message_id: string, "
    "timestamp: timestamp, type: string, user_id: string, app_id: string>"
)
_HEAD_DDL = ("offset long, timestamp timestamp, routing_key string, exchange string, "
             f"headers map<string, string>, properties {PROPERTIES_DDL}")
SEGMENT_EXTRA_DDL = "vhost string, queue string, segment int, position long, acked boolean"
BODY_FORMATS = ("binary", "text", "json")

assert PROPERTY_FIELDS[0] == "content_type"


class OptionError(ValueError):
    """A bad option value; the message names the option."""


def body_options(options: Any) -> tuple[str, str | None]:
    """(bodyFormat, bodySchema) checked."""
    fmt = str(options.get("bodyFormat", "binary")).lower()
    if fmt not in BODY_FORMATS:
        raise OptionError(f"option bodyFormat must be one of {', '.join(BODY_FORMATS)}, not {fmt!r}")
    body_schema = options.get("bodySchema")
    if fmt == "json" and not body_schema:
        raise OptionError("option bodyFormat=json needs option bodySchema (a DDL string, e.g. 'id long, name string')")
    return fmt, body_schema


def schema_ddl(options: Any, segments: bool = False) -> str:
    """The output schema as DDL, for DataSource.schema() (Spark parses it)."""
    fmt, body_schema = body_options(options)
    if fmt == "binary":
        body = "body binary"
    elif fmt == "text":
        body = "body string"
    else:
        body = str(body_schema)
    ddl = f"{_HEAD_DDL}, {body}"
    return f"{ddl}, {SEGMENT_EXTRA_DDL}" if segments else ddl


def _to_micros(value: Any) -> Any:
    if isinstance(value, str):
        try:
            d = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            return None
        if d.tzinfo is None:
            d = d.replace(tzinfo=dt.UTC)
        return d
    if isinstance(value, int | float) and not isinstance(value, bool):
        return dt.datetime.fromtimestamp(value, dt.UTC)
    return value


class BatchBuilder:
    """Collects decoded records column by column and emits them as Arrow record batches.

    `schema` is the Spark StructType Spark handed to reader(); the Arrow types come from it
    (pyspark's own mapping), so the batches always match what Spark expects.
    """

    def __init__(self, schema: Any, body_format: str, segments: bool = False) -> None:
        import pyarrow as pa
        import pyarrow.compute  # noqa: F401  (pa.compute)
        from pyspark.sql.pandas.types import to_arrow_schema

        self._pa = pa
        self.arrow_schema = to_arrow_schema(schema, timezone="UTC")
        self.body_format = body_format
        self.segments = segments
        self.bad_json = 0
        names = schema.fieldNames()
        if body_format == "json":
            head = 6
            tail = 5 if segments else 0
            self._json_fields = [schema.fields[i] for i in range(head, len(names) - tail)]
            self._json_ts = {f.name for f in self._json_fields
                             if f.dataType.typeName() in ("timestamp", "timestamp_ntz", "date")}
            self._json_type = pa.struct([self.arrow_schema.field(i) for i in range(head, len(names) - tail)])
        self._reset()

    def _reset(self) -> None:
        self.offset: list = []
        self.ts: list = []  # ms since the epoch (segments); unused over AMQP (the timestamp property)
        self.rk: list = []
        self.ex: list = []
        self.pidx: list = []  # per row: index of its properties blob in `self.distinct`
        self.body: list = []
        self.position: list = []
        self.acked: list = []  # segments: empty while no row is acked
        # Distinct properties blobs of this batch and their decoded values: headers, properties and
        # the AMQP timestamp are built once per blob and gathered with `take`, not converted per row.
        self.pmap: dict[bytes, int] = {}
        self.distinct: list = []

    def new_props(self, props: bytes, decoded: Any) -> int:
        """Index of a properties blob not seen in this batch yet (`decoded` = PropsDecoder.decode(props))."""
        i = len(self.distinct)
        self.pmap[props] = i
        self.distinct.append(decoded)
        return i

    def __len__(self) -> int:
        return len(self.pidx)

    def flush(self, vhost: str | None = None, queue: str | None = None, segment: int | None = None) -> Any:
        """The collected rows as one RecordBatch (and start over); the arguments fill the segment columns."""
        pa = self._pa
        sch = self.arrow_schema
        idx = pa.array(self.pidx, pa.int32())
        if self.segments:
            ts = pa.array(self.ts, pa.int64())
        else:
            ts = pa.array([d[1]["timestamp"] for d in self.distinct], pa.int64()).take(idx)
            ts = ts.cast(sch.field(1).type)
        batch = self.assemble(
            pa.array(self.offset, sch.field(0).type), ts, pa.array(self.rk, sch.field(2).type),
            pa.array(self.ex, sch.field(3).type), self.distinct, idx, self.body,
            (vhost, queue, segment, pa.array(self.position, sch.field(len(sch.names) - 2).type),
             pa.array(self.acked, pa.bool_()) if self.acked else None) if self.segments else None)
        self._reset()
        return batch

    def assemble(self, offset: Any, ts: Any, rk: Any, ex: Any, distinct: list, pidx: Any, body: Any,
                 segment: tuple | None = None) -> Any:
        """One RecordBatch from whole columns: Arrow arrays, `distinct` decoded properties blobs (PropsDecoder)
        gathered by the int32 array `pidx`, `body` a binary array or a list of bytes. For segments, `ts` is in
        ms and `segment` = (vhost, queue, segment no, position array, acked array or None)."""
        pa = self._pa
        sch = self.arrow_schema
        n = len(pidx)
        headers = pa.array([d[0] for d in distinct], sch.field(4).type).take(pidx)
        props = pa.array([d[1] for d in distinct], sch.field(5).type).take(pidx)
        if segment is not None:
            ts = pa.compute.multiply(ts, 1000).cast(sch.field(1).type)
        cols = [offset, ts, rk, ex, headers, props]
        if self.body_format == "binary":
            cols.append(body if isinstance(body, pa.Array) else pa.array(body, pa.binary()))
        else:
            bodies = body.to_pylist() if isinstance(body, pa.Array) else body
            if self.body_format == "text":
                cols.append(pa.array([b.decode("utf-8", "replace") for b in bodies], pa.string()))
            else:
                cols.extend(self._json_columns(bodies))
        if segment is not None:
            vhost, queue, no, position, acked = segment
            base = len(cols)
            cols.append(pa.repeat(pa.scalar(vhost, sch.field(base).type), n))
            cols.append(pa.repeat(pa.scalar(queue, sch.field(base + 1).type), n))
            cols.append(pa.repeat(pa.scalar(no, sch.field(base + 2).type), n))
            cols.append(position)
            cols.append(acked if acked is not None else pa.repeat(pa.scalar(False, sch.field(base + 4).type), n))
        return pa.RecordBatch.from_arrays(cols, schema=sch)

    def _json_columns(self, bodies: list) -> list:
        pa = self._pa
        rows = []
        ts_fields = self._json_ts
        for b in bodies:
            try:
                v = json.loads(b)
            except ValueError:
                v = None
            if not isinstance(v, dict):
                self.bad_json += 1
                rows.append(None)
                continue
            if ts_fields:
                for name in ts_fields:
                    if name in v:
                        v[name] = _to_micros(v[name])
            rows.append(v)
        try:
            arr = pa.array(rows, self._json_type)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError):
            arr = pa.array([self._one(r) for r in rows], self._json_type)
        return arr.flatten()  # children with the parent's nulls applied

    def _one(self, row: Any) -> Any:
        """A row that does not convert (a field of the wrong type) becomes null rather than failing the batch."""
        try:
            self._pa.array([row], self._json_type)
            return row
        except Exception:
            self.bad_json += 1
            return None
