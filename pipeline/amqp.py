"""Blocking AMQP 0-9-1 pieces the data sources run in Spark's Python workers.

Built on the project's sans-IO codec (`broker.amqp`) through the perf tool's minimal client
(`loadtest.amqp_client.AMQPClient`: handshake and control RPCs); deliveries and confirms are
parsed in bulk from each `recv`, never a frame at a time. Pieces:

- `probe_offset`: the offset of the first message a consumer with a given `x-stream-offset`
  would get (`last` + 1 is the end of the stream; a timestamp gives point-in-time replay).
- `read_range`: every message of a stream queue with offset in [start, end), in order.
- `Publisher`: publishes with publisher confirms and raises on a nack or a missing confirm.
"""

from __future__ import annotations

import datetime as dt
import socket
import time
from collections.abc import Iterator
from typing import Any

from pamqp import commands

from broker.amqp import encoder, events
from loadtest.amqp_client import AMQPClient, AMQPClosed
from pipeline.props import OffsetSplitter, split_offset

PREFETCH = 4000
_Deliver = events.Deliver


class StreamError(Exception):
    """The stream is not readable as asked (not a stream queue, missing, truncated, no answer)."""


class DataLoss(StreamError):
    """Messages the reader must return were removed by retention before it got to them."""

    def __init__(self, queue: str, wanted: int, got: int) -> None:
        super().__init__(f"stream '{queue}': offsets {wanted}..{got - 1} were removed by retention before "
                         f"they were read (the oldest retained offset is {got}); set failOnDataLoss=false "
                         "to continue from the oldest retained message")
        self.wanted = wanted
        self.got = got


def connect(uri: str, timeout: float = 10.0, attempts: int = 1, backoff: float = 0.5) -> AMQPClient:
    """A connected client; retries a refused/broken connection with exponential back-off."""
    delay = backoff
    for attempt in range(attempts):
        try:
            return AMQPClient(uri, timeout=timeout).connect()
        except (OSError, AMQPClosed):
            if attempt == attempts - 1:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 10.0)
    raise AssertionError("unreachable")


def queue_count(client: AMQPClient, queue: str) -> int:
    """Messages retained (passive declare); StreamError if the queue does not exist."""
    try:
        return client.queue_declare(queue, passive=True)[1]
    except AMQPClosed as exc:
        if exc.code == 404:
            client.open_channel(1)
            raise StreamError(f"queue '{queue}' not found in vhost '{client.uri.vhost}'") from None
        raise


def _consume(client: AMQPClient, channel: int, queue: str, start: Any, prefetch: int) -> None:
    client.open_channel(channel)
    client.basic_qos(prefetch, channel=channel)
    try:
        client.rpc(commands.Basic.Consume(queue=queue, no_ack=False, arguments={"x-stream-offset": start}),
                   commands.Basic.ConsumeOk, channel)
    except AMQPClosed as exc:
        if exc.channel == channel and exc.code == 404:
            raise StreamError(f"queue '{queue}' not found in vhost '{client.uri.vhost}'") from None
        if exc.channel == channel and exc.code == 406:
            raise StreamError(f"queue '{queue}' refused a stream consumer: {exc.text}") from None
        raise


def _close_channel(client: AMQPClient, channel: int) -> None:
    try:
        client.rpc(commands.Channel.Close(reply_code=200, reply_text="done", class_id=0, method_id=0),
                   commands.Channel.CloseOk, channel)
    except AMQPClosed as exc:
        if exc.channel != channel:
            raise


def _amqp_start(spec: Any) -> Any:
    """An x-stream-offset value: ints and 'first'/'last'/'next' as given, a datetime as an AMQP timestamp."""
    if isinstance(spec, dt.datetime):
        return spec if spec.tzinfo else spec.replace(tzinfo=dt.UTC)
    return spec


def probe_offset(client: AMQPClient, queue: str, start: Any, wait: float, channel: int = 2) -> int | None:
    """Offset of the first message a consumer starting at `start` receives; None if none comes within `wait` s.

    StreamError if the delivery has no x-stream-offset header (not a stream queue: the probe never
    acks, so closing its channel gives the message back to a classic queue).
    """
    _consume(client, channel, queue, _amqp_start(start), 1)
    sock = client.sock
    assert sock is not None
    deadline = time.monotonic() + wait
    found: int | None = None
    try:
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            try:
                ev = client.next_event()
            except TimeoutError:
                break
            client._handle_close(ev)
            if ev.__class__ is _Deliver and ev.channel == channel:
                found, _ = split_offset(ev.props_raw)
                if found is None:
                    raise StreamError(f"queue '{queue}' is not a stream queue (its deliveries have no "
                                      "x-stream-offset header)")
                break
    finally:
        sock.settimeout(client.timeout)
        _close_channel(client, channel)
    return found


def read_range(client: AMQPClient, queue: str, start: int, end: int, *, idle_timeout: float = 30.0,
               fail_on_data_loss: bool = True, channel: int = 3,
               prefetch: int = PREFETCH) -> Iterator[tuple[int, str, str, bytes, bytes]]:
    """(offset, exchange, routing_key, props_raw without x-stream-offset, body) for start <= offset < end."""
    if end <= start:
        return
    _consume(client, channel, queue, start, prefetch)
    sock = client.sock
    assert sock is not None
    parser = client._parser
    ack_every = max(1, prefetch // 2)
    unacked = 0
    last_tag = 0
    expect = start
    split = OffsetSplitter().split
    pending = list(client._events)
    client._events.clear()
    data = bytes(client.take_pending())
    if data:
        pending.extend(parser.feed(data))
    sock.settimeout(idle_timeout)
    try:
        while True:
            for ev in pending:
                if ev.__class__ is not _Deliver:
                    client._handle_close(ev)
                    if isinstance(ev, events.MethodFrame) and isinstance(ev.method, commands.Basic.Cancel):
                        raise StreamError(f"stream '{queue}': the broker cancelled the consumer (queue deleted?)")
                    continue
                offset, props = split(ev.props_raw)
                if offset is None:
                    raise StreamError(f"queue '{queue}' is not a stream queue (its deliveries have no "
                                      "x-stream-offset header)")
                if offset != expect:
                    if offset < expect:
                        continue  # cannot happen with one cursor; never return a message twice
                    if fail_on_data_loss:
                        raise DataLoss(queue, expect, offset)
                if offset >= end:
                    return
                expect = offset + 1
                last_tag = ev.delivery_tag
                unacked += 1
                yield offset, ev.exchange, ev.routing_key, props, ev.body
                if expect >= end:
                    return
            if unacked >= ack_every:
                client.send(encoder.encode_ack(channel, last_tag, True))
                unacked = 0
            try:
                data = sock.recv(1 << 20)
            except TimeoutError:
                raise StreamError(f"stream '{queue}': no delivery for {idle_timeout:.0f}s while reading offsets "
                                  f"{expect}..{end - 1}") from None
            if not data:
                raise AMQPClosed(320, "socket closed by broker")
            pending = parser.feed(data)
    finally:
        sock.settimeout(client.timeout)


class Publisher:
    """Publishes to one exchange on a confirm-mode channel, `window` unconfirmed at most.

    `flush()` returns once every publish is confirmed; a nack raises `PublishError` at once and a
    confirm missing after `confirm_timeout` seconds raises it too (at-least-once: Spark retries the task).
    """

    def __init__(self, client: AMQPClient, exchange: str, *, window: int = 2000, confirm_timeout: float = 30.0,
                 batch: int = 256) -> None:
        self.client = client
        self.exchange = exchange
        self.window = window
        self.confirm_timeout = confirm_timeout
        self.batch = batch
        client.confirm_select(1)
        self.published = 0
        self.confirmed = 0  # every tag <= confirmed is acked
        self._singles: set[int] = set()
        self._buf: list[bytes] = []
        self._frame_max = client.frame_max

    def publish(self, routing_key: str, props_raw: bytes, body: bytes) -> None:
        self._buf.append(encoder.encode_publish(1, self.exchange, routing_key, False, props_raw, body,
                                                self._frame_max))
        self.published += 1
        if len(self._buf) >= self.batch:
            self._send()
            self._poll(block=self.published - self.confirmed > self.window)

    def _send(self) -> None:
        if self._buf:
            self.client.send(b"".join(self._buf))
            self._buf = []

    def flush(self) -> None:
        self._send()
        deadline = time.monotonic() + self.confirm_timeout
        while self.confirmed < self.published:
            if time.monotonic() > deadline:
                raise PublishError(f"{self.published - self.confirmed} of {self.published} publishes to exchange "
                                   f"'{self.exchange}' not confirmed within {self.confirm_timeout:.0f}s")
            self._poll(block=True, timeout=max(0.0, deadline - time.monotonic()))

    def _poll(self, block: bool, timeout: float | None = None) -> None:
        sock = self.client.sock
        assert sock is not None
        while True:
            try:
                if block:
                    sock.settimeout(self.confirm_timeout if timeout is None else max(timeout, 0.001))
                    data = sock.recv(1 << 16)
                else:
                    data = sock.recv(1 << 16, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return
            except TimeoutError:
                return
            finally:
                if block:
                    sock.settimeout(self.client.timeout)
            if not data:
                raise AMQPClosed(320, "socket closed by broker")
            for ev in self.client._parser.feed(data):
                cls = ev.__class__
                if cls is events.Nack:
                    raise PublishError(f"the broker nacked publish {ev.delivery_tag} to exchange '{self.exchange}'"
                                       " (a queue refused it, e.g. x-overflow=reject-publish)")
                if cls is events.Ack:
                    self._ack(ev.delivery_tag, ev.multiple)
                else:
                    self.client._handle_close(ev)
            if not block or self.published - self.confirmed <= self.window:
                return

    def _ack(self, tag: int, multiple: bool) -> None:
        if multiple:
            if tag > self.confirmed:
                self.confirmed = tag
                if self._singles:
                    self._singles = {t for t in self._singles if t > tag}
        elif tag > self.confirmed:
            self._singles.add(tag)
        while self.confirmed + 1 in self._singles:
            self.confirmed += 1
            self._singles.discard(self.confirmed)


class PublishError(Exception):
    """A publish was nacked or not confirmed in time."""
