"""Argument validation and value rendering shared by the planners (RabbitMQ's texts and codes)."""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from typing import Any

from broker.amqp.errors import AMQPChannelError
from broker.dedup import DEDUP_ARGS, dedup_args_error
from broker.definitions.entities import PRECONDITION_FAILED, QUEUE_DECLARE
from broker.policies import max_age_seconds
from broker.routing import _norm, amqp_type_name

# Queue arguments RabbitMQ compares on redeclare (rabbit_amqqueue:declare_args/0);
# any other argument may differ between declarations.
QUEUE_EQUIVALENCE_ARGS = (
    "x-expires",
    "x-message-ttl",
    "x-dead-letter-exchange",
    "x-dead-letter-routing-key",
    "x-max-length",
    "x-max-length-bytes",
    "x-max-in-memory-length",
    "x-max-in-memory-bytes",
    "x-max-priority",
    "x-overflow",
    "x-queue-mode",
    "x-single-active-consumer",
    "x-queue-type",
    "x-quorum-initial-group-size",
    "x-max-age",
    "x-max-segment-size",
    "x-initial-cluster-size",
    "x-queue-leader-locator",
    "x-delivery-limit",
    "x-stream-max-segment-size-bytes",
    *DEDUP_ARGS,  # LavinMQ compares all arguments; a live cache cannot change its settings silently
)
EXCHANGE_EQUIVALENCE_ARGS = ("alternate-exchange", *DEDUP_ARGS)

def plain(value: Any) -> Any:
    """Field-table values as msgpack/JSON-friendly plain types (text stays text)."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return raw
    if isinstance(value, Decimal):
        return float(value)
    if isinstance(value, datetime):
        return int(value.timestamp())
    return value


def _rs(kind: str, name: str, vhost: str) -> str:
    return f"{kind} '{name}' in vhost '{vhost}'"


def _val(value: Any) -> str:
    """Erlang-style rendering of a field value in 'inequivalent arg' texts."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def _arg_val(value: Any, present: bool) -> str:
    if not present:
        return "none"
    return f"the value '{_val(value)}' of type '{amqp_type_name(value)}'"


def _same_arg(a: Any, b: Any) -> bool:
    return _norm(a) == _norm(b)


def _channel(code: int, text: str, method: tuple[int, int]) -> AMQPChannelError:
    return AMQPChannelError(code, text, method[0], method[1])


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_queue_args(name: str, vhost: str, args: dict, durable: bool = True, exclusive: bool = False,
                      auto_delete: bool = False) -> None:
    """A subset of rabbit_amqqueue:check_declare_arguments/2 (406 on bad values)."""

    def fail(key: str, err: str) -> None:
        raise _channel(PRECONDITION_FAILED, f"invalid arg '{key}' for {_rs('queue', name, vhost)}: {err}",
                       QUEUE_DECLARE)

    for key in ("x-max-length", "x-max-length-bytes", "x-max-priority", "x-message-ttl", "x-expires",
                "x-delivery-limit", "x-consumer-timeout"):
        if key in args:
            v = args[key]
            if not _is_int(v):
                fail(key, '{unacceptable_type,"expected integer"}')
            if v < 0:
                fail(key, f"{{value_negative,{v}}}")
            if key == "x-expires" and v == 0:
                fail(key, f"{{value_zero,{v}}}")
            if key == "x-max-priority" and v > 255:
                fail(key, f"{{max_value_exceeded,{v}}}")
    for key in ("x-dead-letter-exchange", "x-dead-letter-routing-key"):
        if key in args and not isinstance(args[key], str):
            raise _channel(PRECONDITION_FAILED,
                           f"invalid type '{amqp_type_name(args[key])}' for arg '{key}' in "
                           f"{_rs('queue', name, vhost)}", QUEUE_DECLARE)
    if "x-dead-letter-routing-key" in args and "x-dead-letter-exchange" not in args:
        fail("x-dead-letter-routing-key", "routing_key_but_no_dlx_defined")
    if "x-overflow" in args and args["x-overflow"] not in ("drop-head", "reject-publish", "reject-publish-dlx"):
        fail("x-overflow", "invalid_overflow")
    if "x-single-active-consumer" in args and not isinstance(args["x-single-active-consumer"], bool):
        fail("x-single-active-consumer", f"{{unacceptable_type,{amqp_type_name(args['x-single-active-consumer'])}}}")
    dedup_err = dedup_args_error(args)
    if dedup_err is not None:
        fail(*dedup_err)
    qtype = args.get("x-queue-type", "classic")
    if qtype not in ("classic", "quorum", "stream"):
        fail("x-queue-type", f"unsupported queue type '{_val(qtype)}'")
    if qtype == "stream":
        _check_stream_args(name, vhost, args, fail)
    if qtype in ("quorum", "stream"):
        # A quorum queue here is a durable classic queue with delivery counting (shard/feature_queue.py);
        # the properties RabbitMQ refuses for quorum and stream queues are refused the same way.
        for prop, bad in (("exclusive-owner", exclusive), ("auto-delete", auto_delete), ("non-durable", not durable)):
            if bad:
                raise _channel(PRECONDITION_FAILED, f"invalid property '{prop}' for {_rs('queue', name, vhost)}",
                               QUEUE_DECLARE)


# Arguments RabbitMQ refuses on a stream ("invalid arg ... of queue type rabbit_stream_queue").
_NOT_FOR_STREAMS = ("x-message-ttl", "x-expires", "x-dead-letter-exchange", "x-dead-letter-routing-key",
                    "x-max-priority", "x-overflow", "x-delivery-limit", "x-single-active-consumer",
                    "x-consumer-timeout")


def _check_stream_args(name: str, vhost: str, args: dict, fail: Any) -> None:
    for key in _NOT_FOR_STREAMS:
        if key in args:
            raise _channel(PRECONDITION_FAILED, f"invalid arg '{key}' for {_rs('queue', name, vhost)} of queue "
                           "type rabbit_stream_queue", QUEUE_DECLARE)
    if "x-max-age" in args:
        try:
            max_age_seconds(args["x-max-age"])
        except ValueError:
            fail("x-max-age", f"{{invalid_max_age,{_val(args['x-max-age'])}}}")
    key = "x-stream-max-segment-size-bytes"
    if key in args:
        v = args[key]
        if not _is_int(v):
            fail(key, '{unacceptable_type,"expected integer"}')
        if v <= 0:
            fail(key, f"{{value_not_positive,{v}}}")
