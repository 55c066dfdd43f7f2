"""basic.consume arguments RabbitMQ checks before it registers a consumer (406 on a bad value).

``x-priority`` must be an integer (rabbit_amqqueue:consume_args/0); ``x-consumer-timeout``
(RabbitMQ 3.12+) a non-negative integer of milliseconds, 0 meaning no timeout for that consumer.
"""

from __future__ import annotations

from broker.amqp.constants import PRECONDITION_FAILED
from broker.amqp.errors import AMQPChannelError
from broker.routing import amqp_type_name


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_consume_arguments(queue: str, vhost: str, args: dict | None) -> None:
    """Raise AMQPChannelError (406, basic.consume) with RabbitMQ's text for a bad consumer argument."""
    if not args:
        return
    for key, non_negative in (("x-priority", False), ("x-consumer-timeout", True)):
        if key not in args:
            continue
        v = args[key]
        if not _is_int(v):
            err = f"{{unacceptable_type,{amqp_type_name(v)}}}"
        elif non_negative and v < 0:
            err = f"{{value_negative,{v}}}"
        else:
            continue
        raise AMQPChannelError(PRECONDITION_FAILED,
                               f"invalid arg '{key}' for queue '{queue}' in vhost '{vhost}': {err}", 60, 20)
