"""Helpers of the pipeline tests: fast publishing to a stream queue, bounded polls.

Publishing goes through the perf tool's raw client (pre-encoded frames, no per-message confirm
round trip), independent of the code under test, then waits until the queue holds them all.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from pamqp import commands

from broker.amqp import encoder
from loadtest.amqp_client import AMQPClient
from tests.harness import wait_until

WAIT = 30.0


def declare_stream(url: str, queue: str, arguments: dict | None = None) -> None:
    with AMQPClient(url).connect() as c:
        c.queue_declare(queue, durable=True, arguments={"x-queue-type": "stream", **(arguments or {})})


def stream_count(url: str, queue: str) -> int:
    with AMQPClient(url).connect() as c:
        return c.queue_declare(queue, passive=True)[1]


def publish(url: str, queue: str, messages: Iterable[tuple[bytes, commands.Basic.Properties | None]],
            exchange: str = "", routing_key: str | None = None, wait: bool = True) -> int:
    """Publish (body, properties) pairs; with `wait`, return once the queue count grew by that many."""
    with AMQPClient(url).connect() as c:
        before = c.queue_declare(queue, passive=True)[1] if wait else 0
        plain = commands.Basic.Properties(delivery_mode=2).marshal()
        rk = queue if routing_key is None else routing_key
        buf: list[bytes] = []
        n = 0
        for body, props in messages:
            raw = plain if props is None else props.marshal()
            buf.append(encoder.encode_publish(1, exchange, rk, False, raw, body, c.frame_max))
            n += 1
            if len(buf) >= 500:
                c.send(b"".join(buf))
                buf = []
        if buf:
            c.send(b"".join(buf))
        if wait:
            deadline = time.monotonic() + WAIT
            while (have := c.queue_declare(queue, passive=True)[1]) < before + n:
                assert time.monotonic() < deadline, f"{queue} holds {have - before} of {n} published messages"
                time.sleep(0.05)
    return n


def wait_for(predicate, timeout: float = WAIT, interval: float = 0.2, what: str = "condition"):
    """Poll until predicate() returns a truthy value (returned); AssertionError naming `what` after `timeout`."""
    return wait_until(predicate, timeout, what, interval)
