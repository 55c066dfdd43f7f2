"""Writing a DataFrame to an exchange (`df.write.format("shardmq")` and `writeStream`).

Each task publishes its partition's rows on one connection with publisher confirms and succeeds
only once every publish is confirmed: a nack or a confirm missing after `confirmTimeout` seconds
fails the task (Spark retries it: at-least-once). Options: `uri`, `exchange` (required; `""` is the
default exchange), `routingKey` (used when a row has no `routing_key`), `deliveryMode` (2 =
persistent, the default; 1 = transient), `confirmTimeout` (default 30).

Columns: `body` (binary or string, required), and optionally `routing_key` (string), `headers`
(map of string to string) and `properties` (a struct with any of the `properties` fields the
readers return: content_type, message_id, correlation_id, ...). Other columns are ignored.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from typing import Any

from pamqp import commands
from pyspark.sql.datasource import DataSourceStreamWriter, DataSourceWriter, WriterCommitMessage

from pipeline.amqp import Publisher, connect
from pipeline.props import PROPERTY_FIELDS
from pipeline.schema import OptionError

_PAMQP_NAMES = {"type": "message_type"}


class PublishedCount(WriterCommitMessage):
    def __init__(self, count: int) -> None:
        self.count = count


class WriteOptions:
    def __init__(self, options: Any, schema: Any) -> None:
        self.uri = options.get("uri")
        if not self.uri:
            raise OptionError("option uri is required (amqp://user:pass@host:port/vhost)")
        if options.get("exchange") is None:
            raise OptionError("option exchange is required (\"\" publishes through the default exchange)")
        self.exchange = str(options.get("exchange"))
        self.routing_key = str(options.get("routingKey", ""))
        try:
            self.delivery_mode = int(options.get("deliveryMode", 2))
            self.confirm_timeout = float(options.get("confirmTimeout", 30))
        except ValueError:
            raise OptionError("options deliveryMode and confirmTimeout must be numbers") from None
        if self.delivery_mode not in (1, 2):
            raise OptionError(f"option deliveryMode must be 1 or 2, not {self.delivery_mode}")
        names = set(schema.fieldNames())
        if "body" not in names:
            raise OptionError("the DataFrame written to shardmq needs a body column (binary or string)")
        self.has_rk = "routing_key" in names
        self.has_headers = "headers" in names
        self.has_props = "properties" in names


def _props(opts: WriteOptions, headers: Any, props: Any) -> bytes:
    kw: dict[str, Any] = {"delivery_mode": opts.delivery_mode}
    if props is not None:
        d = props.asDict() if hasattr(props, "asDict") else dict(props)
        for name in PROPERTY_FIELDS:
            v = d.get(name)
            if v is None:
                continue
            if name == "timestamp" and isinstance(v, dt.datetime) and v.tzinfo is None:
                v = v.replace(tzinfo=dt.UTC)
            kw[_PAMQP_NAMES.get(name, name)] = v
    if headers:
        kw["headers"] = dict(headers)
    return commands.Basic.Properties(**kw).marshal()


def publish_rows(opts: WriteOptions, rows: Iterator[Any]) -> int:
    """Publish every row, wait for all confirms; returns how many were published."""
    client = connect(opts.uri, attempts=4)
    try:
        pub = Publisher(client, opts.exchange, confirm_timeout=opts.confirm_timeout)
        plain = _props(opts, None, None)
        for row in rows:
            body = row["body"]
            if body is None:
                body = b""
            elif isinstance(body, str):
                body = body.encode()
            else:
                body = bytes(body)
            rk = row["routing_key"] if opts.has_rk else None
            headers = row["headers"] if opts.has_headers else None
            props = row["properties"] if opts.has_props else None
            raw = plain if not headers and props is None else _props(opts, headers, props)
            pub.publish(rk if rk is not None else opts.routing_key, raw, body)
        pub.flush()
        return pub.published
    finally:
        client.close()


class ExchangeWriter(DataSourceWriter):
    def __init__(self, options: Any, schema: Any) -> None:
        self.opts = WriteOptions(options, schema)

    def write(self, iterator: Iterator[Any]) -> PublishedCount:
        return PublishedCount(publish_rows(self.opts, iterator))


class ExchangeStreamWriter(DataSourceStreamWriter):
    def __init__(self, options: Any, schema: Any) -> None:
        self.opts = WriteOptions(options, schema)

    def write(self, iterator: Iterator[Any]) -> PublishedCount:
        return PublishedCount(publish_rows(self.opts, iterator))

    def commit(self, messages: list, batchId: int) -> None:
        pass  # every row of the batch is confirmed by the broker before its task succeeded

    def abort(self, messages: list, batchId: int) -> None:
        pass  # published rows stay published (at-least-once: the retried batch publishes them again)
