"""One AMQP channel of a client connection: its methods, consumers, delivery tags, confirms.

Events reach a channel through its ``Backlog`` so they are handled strictly in
order; a handler that needs the node or a shard blocks the backlog until the
reply arrives. Channel-level errors (AMQPChannelError) close only this
channel; AMQPConnectionError propagates to the connection.
"""

from __future__ import annotations

import secrets
from collections import deque
from typing import TYPE_CHECKING, Any, Protocol

from pamqp import commands as C

from broker import contract
from broker.amqp import events as E
from broker.amqp.constants import (
    ACCESS_REFUSED,
    COMMAND_INVALID,
    CONNECTION_LEVEL_CODES,
    NO_ROUTE,
    NOT_ALLOWED,
    NOT_FOUND,
    NOT_IMPLEMENTED,
    PRECONDITION_FAILED,
    RESOURCE_LOCKED,
    SYNTAX_ERROR,
)
from broker.amqp.encoder import (
    encode_ack,
    encode_content,
    encode_deliver,
    encode_deliver_run,
    encode_nack,
)
from broker.amqp.errors import AMQPChannelError, AMQPConnectionError, AMQPError
from broker.amqp.properties import decode_properties, delivery_mode
from broker.consumer_args import check_consume_arguments
from broker.permissions import READ
from broker.routing import delay_store_shard, may_have_cc, sender_routes
from frontend.amqp.backlog import Backlog
from frontend.amqp.dedup_publish import publish_dedup
from frontend.amqp.delivery_tags import DeliveryTags, group_by_shard
from frontend.amqp.direct_reply import PREFIX as REPLY_PREFIX
from frontend.amqp.direct_reply import PSEUDO_QUEUE, new_reply_name, route_reply
from frontend.amqp.pipeline import MAX_IN_FLIGHT, PIPELINED, Pending, Pipeline
from frontend.amqp.publish_extras import (
    MAX_DELAY_MS,
    delay_ms,
    may_reply_to_pseudo_queue,
    reply_to_of,
    with_delay,
    with_reply_to,
    with_timestamp,
)
from frontend.amqp.replies import consume_arguments, error_from_reply, method_args
from frontend.confirms import ConfirmTracker
from frontend.publish import put_publish, put_publish_run, queues_by_shard

if TYPE_CHECKING:
    from collections.abc import Callable

    from broker.amqp.parser import FrameParser
    from broker.permissions import Access
    from frontend.worker import FrontendWorker

# A client that keeps sending while its channel waits for a reply is paused past this many events.
BACKLOG_PAUSE = 10_000
# channel.close-ok waits at most this long for the shards' answers to CHANNEL_CLOSED.
CLOSE_ANSWER_TIMEOUT = 5.0

OPEN = 1
CLOSING = 2  # we sent channel.close and wait for close-ok
CLOSED = 3

_DELAYED_PUBLISH = contract.DELAYED_PUBLISH
_QUEUE_INFO = contract.QUEUE_INFO
_NO_PROPS = b"\x00\x00"  # property flags: none
_MODE_ONLY = b"\x10\x00"  # property flags: delivery-mode only
_ACK = contract.ACK
_NACK = contract.NACK
_CREDIT_SHIFT = contract.CREDIT_BYTES_SHIFT


def _each_publish(run: E.PublishRun) -> list[E.Publish]:
    """The Publish events a PublishRun stands for."""
    head = run[:6]
    return [E.Publish(*head, body) for body in run.bodies]


def _ids(method: Any) -> tuple[int, int]:
    index = method.index
    return index >> 16, index & 0xFFFF


class Consumer:
    """One instance of a consumer tag on a channel (a tag cancelled with nowait can be consumed again
    at once, as RabbitMQ allows: each time a new instance, whose credit is its own)."""

    __slots__ = ("tag", "queue", "shard", "no_ack", "ready", "early", "answered", "cancelled")

    def __init__(self, tag: str, queue: str, shard: int, no_ack: bool) -> None:
        self.tag = tag
        self.queue = queue
        self.shard = shard
        self.no_ack = no_ack
        # Its deliveries are written as they come: the shard's reply is through and no earlier
        # instance of its tag is still cancelling (see Channel.cancelling).
        self.ready = False
        self.answered = False  # the shard's reply to its CONSUME is through (consume-ok sent)
        self.cancelled = False  # its CANCEL is sent (basic.cancel nowait): the tag may be consumed again
        self.early: list = []  # deliveries that wait for ``ready``


class ChannelConnection(Protocol):
    """What a channel uses of its connection (frontend/amqp/connection.py AMQPConnection)."""

    worker: FrontendWorker
    conn_id: int
    vhost: str
    user: str
    access: Access
    frame_max: int
    parser: FrameParser
    channels: dict[int, Channel]
    confirm_shards: set[int]  # shards this connection published to with confirms
    publisher: bool
    had_exclusive: bool

    @property
    def cancel_notify(self) -> bool: ...

    def write(self, data: bytes) -> None: ...

    def send_method(self, channel: int, method: Any) -> None: ...

    @staticmethod
    def reply_text(code: int, text: str) -> str: ...

    def on_reply(self, ch: Channel, ok: bool, result: Any, on_ok: Callable | None, class_id: int,
                 method_id: int) -> None: ...

    def confirm_dirty(self, channel: Channel) -> None: ...

    def add_credit(self, shard: int, channel: int, tag: str, n: int = 1) -> None: ...

    def drop_credit(self, channel: int, tag: str | None = None) -> None: ...

    def consumer_started(self, shard: int, channel: int, tag: str) -> None: ...

    def became_publisher(self) -> None: ...

    def backlog_grew(self) -> None: ...

    def forget_channel(self, ch: Channel) -> None: ...


class Channel:
    __slots__ = (
        "conn", "number", "key", "state", "backlog", "confirm", "tags", "consumers", "prefetch_count",
        "global_prefetch", "held", "shards", "last_queue", "tx", "tx_commit", "extras", "reply_consumer",
        "deleting", "deferred_cancels", "_handlers", "pipeline", "cancelling",
    )

    def __init__(self, conn: ChannelConnection, number: int, generation: int = 0) -> None:
        self.conn = conn
        self.number = number
        # What shards know this opening of the channel number by: number + 65536 * generation. A
        # late DELIVER/CONFIRM/CANCEL_NOTIFY for an earlier opening of the same number (closed,
        # then reopened by the client) carries the old key and is dropped, never misdelivered.
        self.key = number | (generation << 16)
        self.state = OPEN
        self.backlog = Backlog(self.handle)
        # Declares/binds/deletes in flight at once (frontend/amqp/pipeline.py); while it holds any,
        # backlog.busy is set so that every other event waits behind them.
        self.pipeline = Pipeline()
        self.confirm: ConfirmTracker | None = None
        self.tags = DeliveryTags()
        self.consumers: dict[str, Consumer] = {}
        # Instances of a consumer tag cancelled with nowait and consumed again before the shard
        # answered the CANCEL, oldest first. A shard delivers in order, so a DELIVER for the tag from
        # such an instance's shard is that instance's until its cancel reply comes: it is written
        # with that instance's ack mode and returns no credit (that consumer is gone from the shard,
        # and a CREDIT for the tag would go to the new instance: more than a window in flight).
        # The new instance's own deliveries wait (early) until every older instance is done.
        self.cancelling: dict[str, list[Consumer]] | None = None
        self.prefetch_count = 0
        self.global_prefetch = 0
        # Deliveries beyond the global prefetch when this channel consumes from several shards
        # (each shard enforces the limit only for its own messages).
        self.held: deque | tuple = ()  # a deque once something is held (an empty deque is 624 bytes)
        self.shards: set[int] = set()
        self.last_queue: str | None = None
        self.tx: list | None = None  # events buffered in tx mode
        self.tx_commit: ConfirmTracker | None = None  # publishes of a tx.commit not yet confirmed
        # Publishes need the slow path (server timestamp on, direct reply-to consumer on this channel).
        self.extras = bool(conn.worker.settings.get("set_timestamp"))
        self.reply_consumer: tuple[str, str] | None = None  # (consumer tag, direct reply-to name)
        # The queue this channel's pending queue.delete removes: the shard's basic.cancel for our own
        # consumers of it waits until delete-ok is written (RabbitMQ's order; py-amqp and amqplib
        # break on a cancel that overtakes the reply they wait for).
        self.deleting: str | None = None
        self.deferred_cancels: list[str] = []
        self._handlers = _HANDLERS

    # ------------------------------------------------------------------ dispatch
    def submit(self, event: Any) -> None:
        if self.state == OPEN:
            backlog = self.backlog
            if backlog.busy or backlog.events:
                if self.pipeline and not backlog.events and self.may_pipeline(event):
                    self.handle(event)  # one more declare/bind/delete in flight
                    return
                backlog.append(event)
                if len(backlog.events) > BACKLOG_PAUSE:
                    self.conn.backlog_grew()
            else:
                self.handle(event)
        elif self.state == CLOSING and event.__class__ is E.MethodFrame:
            # After our channel.close only close/close-ok matter (spec 2.2.2 / RabbitMQ).
            method = event.method
            if isinstance(method, C.Channel.CloseOk):
                self.conn.forget_channel(self)
            elif isinstance(method, C.Channel.Close):
                self.conn.send_method(self.number, C.Channel.CloseOk())

    def handle(self, event: Any) -> None:
        if self.state != OPEN:
            return
        try:
            cls = event.__class__
            if cls is E.Publish:
                if self.tx is not None:
                    self.tx.append(event)
                else:
                    self.publish(event)
            elif cls is E.PublishRun:
                if self.tx is not None:
                    self.tx.extend(_each_publish(event))
                else:
                    self.publish_run(event)
            elif cls is E.Ack:
                if self.tx is not None:
                    self.tx.append(event)
                else:
                    self.ack(event.delivery_tag, event.multiple)
            elif cls is E.MethodFrame:
                handler = self._handlers.get(event.method.__class__)
                if handler is None:
                    # rabbit_channel's catch-all for methods a client may not send (basic.deliver, *-ok)
                    cid, mid = _ids(event.method)
                    raise AMQPConnectionError(COMMAND_INVALID, "unimplemented method", cid, mid)
                handler(self, event.method)
            elif cls is E.Nack:
                if self.tx is not None:
                    self.tx.append(event)
                else:
                    self.nack(event.delivery_tag, event.multiple, event.requeue, 60, 120)
            elif cls is E.Reject:
                if self.tx is not None:
                    self.tx.append(event)
                else:
                    self.nack(event.delivery_tag, False, event.requeue, 60, 90)
            elif cls is E.ChannelProtocolError:
                raise AMQPChannelError(event.code, event.text, event.class_id, event.method_id)
            elif cls is E.Heartbeat:
                pass
            else:  # content the client may not send (deliver, get-ok, return)
                method = getattr(event, "method", None)
                cid, mid = _ids(method) if method is not None else (60, 60)
                raise AMQPConnectionError(COMMAND_INVALID, "unimplemented method", cid, mid)
        except AMQPChannelError as exc:
            if exc.code in CONNECTION_LEVEL_CODES:
                raise AMQPConnectionError(exc.code, exc.text, exc.class_id, exc.method_id) from None
            self.fail(exc)

    def fail(self, exc: AMQPError) -> None:
        """Close this channel with an error (server-initiated channel.close)."""
        if self.state != OPEN:
            return
        self.state = CLOSING
        self.backlog.clear()
        self.pipeline.clear()
        # Content in progress on this channel is dropped and its frames ignored until close-ok.
        self.conn.parser.channel_closing(self.number)
        self.conn.send_method(
            self.number, C.Channel.Close(exc.code, self.conn.reply_text(exc.code, exc.text),
                                         exc.class_id, exc.method_id))
        self.release_resources()

    def release_resources(self, on_done: Any = None) -> None:
        """Tell every shard this channel touched that it is gone (consumers off, unacked requeued).

        With on_done, each shard answers once it has done so, and on_done() runs after the last
        answer (at once when no shard was touched).
        """
        conn = self.conn
        worker = conn.worker
        conn_id, key = conn.conn_id, self.key
        if on_done is None:
            for shard in self.shards:
                worker.shard_put(shard, [contract.CHANNEL_CLOSED, conn_id, key, None])
        else:
            waiting = [len(self.shards)]
            timer: list = []

            def answered(_ok: bool = True, _result: Any = None) -> None:
                waiting[0] -= 1
                if waiting[0] == 0:
                    if timer:
                        timer[0].cancel()
                    on_done()

            def give_up() -> None:  # a shard that never answers (a lost batch) must not hang the close
                if waiting[0] > 0:
                    waiting[0] = 1
                    answered()

            for shard in self.shards:
                worker.shard_request(shard, lambda req_id: [contract.CHANNEL_CLOSED, conn_id, key, req_id],
                                     conn, answered)
            if self.shards:
                timer.append(worker.loop.call_later(CLOSE_ANSWER_TIMEOUT, give_up))
            else:
                on_done()
        self.shards = set()
        self.consumers.clear()
        self.cancelling = None
        self.tags = DeliveryTags()
        if self.held:
            self.held.clear()
        self.confirm = None
        self.reply_consumer = None

    # ------------------------------------------------------------- requests
    def _request_args(self, method: Any) -> dict:
        conn = self.conn
        args = method_args(method)
        args["vhost"] = conn.vhost
        args["owner"] = [conn.worker.index, conn.conn_id]
        args["user"] = conn.user  # the node checks the user's configure/write/read permissions
        args["chain"] = self.key  # the node plans this channel's requests in order (request_chains.py)
        return args

    def _node_request(self, op: str, method: Any, on_ok) -> None:
        conn = self.conn
        args = self._request_args(method)
        cid, mid = _ids(method)
        self.backlog.block()
        conn.worker.node_request(op, args, lambda ok, result: conn.on_reply(self, ok, result, on_ok, cid, mid))

    def may_pipeline(self, event: Any) -> bool:
        """May this event go to the node while earlier requests are still in flight?

        Only declares, binds and deletes whose queue is named (an empty name means the channel's
        last declared queue, known once the declares before it are answered), and a queue.delete
        only on a channel without consumers (its basic.cancel must follow the delete-ok).
        """
        if event.__class__ is not E.MethodFrame or len(self.pipeline) >= MAX_IN_FLIGHT:
            return False
        method = event.method
        cls = method.__class__
        if cls not in PIPELINED:
            return False
        if cls is C.Queue.Bind or cls is C.Queue.Unbind:
            return bool(method.queue)
        if cls is C.Queue.Delete:
            return bool(method.queue) and not self.consumers
        return True

    def _pipelined_request(self, op: str, method: Any, on_ok, on_replied=None) -> None:
        """Send a declare/bind/delete without waiting for those before it (frontend/amqp/pipeline.py).

        on_ok(result) runs in the channel's order; on_replied(pending, result), if given, runs as
        soon as the node's ok arrives and must call self._answered(pending, ...) itself.
        """
        cid, mid = _ids(method)
        pending = self.pipeline.add(on_ok, cid, mid)
        self.backlog.busy = True  # everything else waits behind the pipeline

        def replied(ok: bool, result: Any) -> None:
            if ok and on_replied is not None:
                on_replied(pending, result)
            else:
                self._answered(pending, ok, result)

        self.conn.worker.node_request(op, self._request_args(method), replied)

    def _answered(self, pending: Pending, ok: bool, result: Any) -> None:
        """A pipelined request has its answer: answer the client for every request done in order."""
        if self.state != OPEN:
            return  # the channel failed on an earlier request (the node skipped the later ones)
        pending.done, pending.ok, pending.result = True, ok, result
        conn = self.conn
        while (ready := self.pipeline.pop_ready()) is not None:
            conn.on_reply(self, ready.ok, ready.result, ready.on_ok, ready.class_id, ready.method_id)
            if self.state != OPEN:
                break

    def _shard_request(self, shard: int, build, on_ok, method: Any) -> None:
        conn = self.conn
        cid, mid = _ids(method)
        self.backlog.block()
        self.shards.add(shard)
        conn.worker.shard_request(
            shard, build, conn, lambda ok, result: conn.on_reply(self, ok, result, on_ok, cid, mid))

    def reply_done(self) -> None:
        """A request was answered: handle waiting events, several declares/binds at once where allowed."""
        backlog = self.backlog
        events = backlog.events
        pipeline = self.pipeline
        backlog.busy = bool(pipeline)
        while events and self.state == OPEN:
            if backlog.busy and not (pipeline and self.may_pipeline(events[0])):
                break
            self.handle(events.popleft())

    def reply_error(self, result: Any, class_id: int, method_id: int) -> None:
        self._flush_deferred_cancels()
        exc = error_from_reply(result, class_id, method_id)
        if isinstance(exc, AMQPConnectionError):
            raise exc
        self.fail(exc)

    # --------------------------------------------------------------- helpers
    def _send(self, method: Any) -> None:
        self.conn.send_method(self.number, method)

    def _queue_name(self, name: str, method: Any) -> str:
        if name:
            return name
        if self.last_queue is None:
            cid, mid = _ids(method)
            raise AMQPChannelError(NOT_FOUND, "no previously declared queue", cid, mid)
        return self.last_queue

    def _local_queue(self, name: str, method: Any) -> Any:
        """The queue's definition, checked as RabbitMQ does before it touches the queue."""
        conn = self.conn
        q = conn.worker.defs.queue(conn.vhost, name)
        if q is None:
            cid, mid = _ids(method)
            raise AMQPChannelError(NOT_FOUND, f"no queue '{name}' in vhost '{conn.vhost}'", cid, mid)
        owner = q.exclusive_owner
        if owner and (owner[0] != conn.worker.index or owner[1] != conn.conn_id):
            cid, mid = _ids(method)
            raise AMQPChannelError(
                RESOURCE_LOCKED,
                f"cannot obtain exclusive access to locked queue '{name}' in vhost '{conn.vhost}'. "
                "It could be originally declared on another connection or the exclusive property "
                "value does not match that of the original declaration.", cid, mid)
        return q

    # ------------------------------------------------------------- publish
    def publish(self, ev: E.Publish) -> None:
        ex, persistent = self._publish_checks(ev)
        conn = self.conn
        vhost = conn.vhost
        worker = conn.worker
        defs = worker.defs
        exchange = ev.exchange
        # rabbitmq_global_messages_received_total (in STATS); refused publishes above count nowhere,
        # so routed = received - unroutable (broker/http/metrics.py).
        worker.n_received += 1
        props_raw = ev.props_raw
        # Plain path: one flag test. 0x22 = headers (CC/BCC) or reply-to (direct reply-to) present.
        if self.extras or ex.extras or (props_raw and props_raw[0] & 0x22 and (
                may_have_cc(props_raw) or may_reply_to_pseudo_queue(props_raw))):
            props_raw, queues = self._publish_extras(ex, ev, props_raw)
            if queues is None:
                return  # delayed or deduplicated: handed to a shard
        else:
            queues = defs.route(vhost, exchange, ev.routing_key, props_raw)
        confirm = self.confirm
        if not queues:
            if not exchange and ev.routing_key.startswith(REPLY_PREFIX):
                route_reply(conn.worker, ev.routing_key, exchange, props_raw, ev.body)
            elif ev.mandatory:
                worker.n_unroutable_returned += 1
                conn.write(encode_content(
                    self.number, C.Basic.Return(NO_ROUTE, "NO_ROUTE", exchange, ev.routing_key),
                    props_raw, ev.body, conn.frame_max))
            else:
                worker.n_unroutable_dropped += 1
            if confirm is not None:
                worker.n_received_confirm += 1
                confirm.publish(0)
                conn.confirm_dirty(self)
            return
        groups = queues_by_shard(defs, vhost, queues)
        if confirm is None:
            put_publish(conn.worker, groups, vhost, exchange, ev.routing_key, props_raw, ev.body, persistent)
        else:
            worker.n_received_confirm += 1
            seq = confirm.publish(len(groups))
            put_publish(conn.worker, groups, vhost, exchange, ev.routing_key, props_raw, ev.body, persistent,
                        conn.conn_id, self.key, seq)
            conn.confirm_shards.update(groups)

    def publish_run(self, ev: E.PublishRun) -> None:
        """Publishes alike but for their bodies (the parser's PublishRun): checked, routed and handed
        to the shards once, one PUBLISH_RUN per shard, with the same effects as publishing each body.
        Whatever could treat them apart goes message by message: CC/BCC or direct reply-to in the
        properties, server timestamps, delayed and deduplicating exchanges, and no route (returns,
        direct reply-to answers, unroutable counters); a refusal (no exchange, access, malformed
        properties) is the first message's, as it would be, and the channel ignores the rest."""
        conn = self.conn
        worker = conn.worker
        defs = worker.defs
        vhost = conn.vhost
        exchange = ev.exchange
        props_raw = ev.props_raw
        ex = defs.exchange(vhost, exchange)
        if (self.extras or ex is None or ex.extras or (props_raw and props_raw[0] & 0x22 and (
                may_have_cc(props_raw) or may_reply_to_pseudo_queue(props_raw)))):
            self._publish_each(ev)
            return
        ex, persistent = self._publish_checks(ev)
        queues = defs.route(vhost, exchange, ev.routing_key, props_raw)
        if not queues:
            self._publish_each(ev)
            return
        bodies = ev.bodies
        n = len(bodies)
        worker.n_received += n
        groups = queues_by_shard(defs, vhost, queues)
        confirm = self.confirm
        if confirm is None:
            put_publish_run(worker, groups, vhost, exchange, ev.routing_key, props_raw, bodies, persistent)
        else:
            worker.n_received_confirm += n
            first = confirm.publish_run(len(groups), n)
            put_publish_run(worker, groups, vhost, exchange, ev.routing_key, props_raw, bodies, persistent,
                            conn.conn_id, self.key, first)
            conn.confirm_shards.update(groups)

    def _publish_each(self, ev: E.PublishRun) -> None:
        """A run as the Publish events it stands for, until one of them closes the channel."""
        publish = self.publish
        for one in _each_publish(ev):
            publish(one)
            if self.state != OPEN:
                return

    def _publish_checks(self, ev: E.Publish | E.PublishRun) -> tuple[Any, bool]:
        """What a publish must pass before it is routed, in RabbitMQ's order (the exchange, write
        access, not internal, not immediate, well-formed properties with a permitted user-id):
        (the exchange, whether the message is persistent)."""
        conn = self.conn
        if not conn.publisher:
            conn.became_publisher()
        vhost = conn.vhost
        defs = conn.worker.defs
        exchange = ev.exchange
        ex = defs.exchange(vhost, exchange)
        if ex is None:
            raise AMQPChannelError(NOT_FOUND, f"no exchange '{exchange}' in vhost '{vhost}'", 60, 40)
        # RabbitMQ checks write permission first; the cache makes a permitted publish one set lookup.
        access = conn.access
        if exchange not in access.writable or access.version != defs.version or access.topics is not None:
            access.check_publish(defs, ex, exchange, ev.routing_key)
        if ex.internal:
            raise AMQPChannelError(
                ACCESS_REFUSED, f"cannot publish to internal exchange '{exchange}' in vhost '{vhost}'", 60, 40)
        if ev.immediate:
            raise AMQPConnectionError(NOT_IMPLEMENTED, "immediate=true", 60, 40)
        props_raw = ev.props_raw
        # Empty or delivery-mode-only properties (the bulk of high-rate traffic) need no more check
        # than their shape; their delivery mode is read here, as delivery_mode() would read it.
        n = len(props_raw)
        if n == 2 and props_raw == _NO_PROPS:
            return ex, False
        if n == 3 and props_raw[:2] == _MODE_ONLY:
            return ex, props_raw[2] == 2
        try:
            persistent = delivery_mode(props_raw) == 2
            # Properties other than delivery-mode are decoded once here, as RabbitMQ does, so a
            # malformed headers table or string is refused at publish instead of being stored and
            # breaking every consumer's client later.
            props = decode_properties(props_raw)
            if props.user_id is not None:
                self._check_user_id(props.user_id)
        except ValueError as exc:
            raise AMQPConnectionError(SYNTAX_ERROR, f"malformed content properties: {exc}", 60, 40) from None
        return ex, persistent

    def _publish_extras(self, ex: Any, ev: E.Publish, props_raw: bytes) -> tuple[bytes, Any]:
        """CC/BCC, server timestamp, delayed and deduplicating exchanges: (properties, queues, or
        None when the message was handed to a shard)."""
        conn = self.conn
        delay = 0
        try:
            if ex.delayed:
                delay = delay_ms(props_raw) or 0
                if not 0 < delay <= MAX_DELAY_MS:
                    delay = 0
            if conn.worker.settings.get("set_timestamp"):
                props_raw = with_timestamp(props_raw)
            keys: list[str] = []
            if not delay and may_have_cc(props_raw):  # a delayed message's CC/BCC apply when it is due
                props_raw, keys = sender_routes(props_raw)
            if may_reply_to_pseudo_queue(props_raw) and reply_to_of(props_raw) == PSEUDO_QUEUE:
                if self.reply_consumer is None:
                    raise AMQPChannelError(PRECONDITION_FAILED, "fast reply consumer does not exist", 60, 40)
                props_raw = with_reply_to(props_raw, self.reply_consumer[1])
            if delay:
                # Delivered with x-delay negated, as RabbitMQ's plugin does (so an exchange further
                # down never delays it again, and consumers can tell it was delayed).
                props_raw = with_delay(props_raw, -delay)
        except ValueError as exc:
            raise AMQPConnectionError(SYNTAX_ERROR, f"malformed content properties: {exc}", 60, 40) from None
        if delay:
            self._publish_delayed(ev, props_raw, delay)
            return props_raw, None
        route = conn.worker.defs.route
        vhost = conn.vhost
        queues = route(vhost, ev.exchange, ev.routing_key, props_raw)
        if keys:
            found = dict.fromkeys(queues)
            for key in keys:
                found.update(dict.fromkeys(route(vhost, ev.exchange, key, props_raw)))
            queues = list(found)
        if ex.dedup:
            # Unroutable too: RabbitMQ's deduplication exchange caches the key before it routes, so
            # a retry of an unroutable message stays a duplicate once a binding appears. The return
            # of an unroutable mandatory message is known here; the owner only remembers the key.
            if not queues and ev.mandatory:
                conn.write(encode_content(
                    self.number, C.Basic.Return(NO_ROUTE, "NO_ROUTE", ev.exchange, ev.routing_key),
                    props_raw, ev.body, conn.frame_max))
            publish_dedup(self, ex, ev.exchange, ev.routing_key, props_raw, ev.body, queues, ev.mandatory)
            return props_raw, None
        return props_raw, queues

    def _publish_delayed(self, ev: E.Publish, props_raw: bytes, delay: int) -> None:
        """Hand the message to the shard keeping this exchange's delay store (shard/delayed.py).

        ``mandatory`` is not honoured: whether it is routable is known only when it is due
        (RabbitMQ's plugin does the same).
        """
        conn = self.conn
        worker = conn.worker
        shard = delay_store_shard(conn.vhost, ev.exchange, worker.shard_count)
        persistent = delivery_mode(props_raw) == 2
        confirm = self.confirm
        if confirm is None:
            worker.shard_put(shard, [_DELAYED_PUBLISH, conn.vhost, ev.exchange, ev.routing_key, props_raw, ev.body,
                                     persistent, delay, None, None, None])
        else:
            seq = confirm.publish(1)
            worker.shard_put(shard, [_DELAYED_PUBLISH, conn.vhost, ev.exchange, ev.routing_key, props_raw, ev.body,
                                     persistent, delay, conn.conn_id, self.key, seq])
            conn.confirm_shards.add(shard)

    def _check_user_id(self, user_id: str | None) -> None:
        """RabbitMQ's validated user-id: a publish may only claim the user it authenticated as
        (users tagged impersonator may claim any)."""
        user = self.conn.user
        if user_id is not None and user_id != user:
            u = self.conn.worker.defs.users.get(user)
            if u is not None and "impersonator" in u.tags:
                return
            raise AMQPChannelError(
                PRECONDITION_FAILED,
                f"user_id property set to '{user_id}' but authenticated user was '{user}'", 60, 40)

    def on_confirm(self, seqs: list[int], ok: bool) -> None:
        confirm = self.confirm
        if confirm is not None and self.state == OPEN:
            confirm.confirm(seqs, ok)
            self.conn.confirm_dirty(self)
        elif self.tx_commit is not None:
            self.tx_commit.confirm(seqs, ok)
            self._maybe_commit_ok()

    def _maybe_commit_ok(self) -> None:
        tracker = self.tx_commit
        if tracker is None or tracker.unconfirmed:
            return
        self.tx_commit = None
        if self.state == OPEN:
            if any(not is_ack for _tag, _multiple, is_ack in tracker.drain()):
                # A publish of the commit was not stored (its shard died, a full disk): as RabbitMQ.
                self.fail(AMQPChannelError(PRECONDITION_FAILED, "partial tx completion", 90, 20))
                return
            self._send(C.Tx.CommitOk())
            self.reply_done()

    commit_settled = _maybe_commit_ok  # frontend/amqp/shard_loss.py settles a commit whose shard died

    def emit_confirms(self) -> None:
        confirm = self.confirm
        if confirm is None:
            return
        write = self.conn.write
        ch = self.number
        acked = confirm.n_acked
        frames = confirm.drain()
        self.conn.worker.n_confirmed += confirm.n_acked - acked  # once per batch of confirms
        # Packed with one struct (tests/test_codec.py: equal to pamqp's bytes): a synchronous
        # confirming publisher waits for this frame, and pamqp's generic marshal of it was ~7 % of a
        # pair's CPU per confirm round trip (py-spy, confirm-rtt).
        for tag, multiple, is_ack in frames:
            if is_ack:
                write(encode_ack(ch, tag, multiple))
            else:
                write(encode_nack(ch, tag, multiple, False))

    # ----------------------------------------------------------- deliveries
    def deliver(self, shard: int, item: list) -> None:
        """A DELIVER item from a shard: [DELIVER, conn, ch, tag, qid, mid, redelivered, ex, rk, props, body]."""
        consumer = self.consumers.get(item[3])
        if consumer is None or self.state != OPEN:
            if self.cancelling is not None and self.state == OPEN and self._to_cancelling(shard, item):
                return
            # Cancelled or closed meanwhile: hand an acked-mode message straight back (the shard
            # ignores the nack for a no-ack delivery it already settled).
            if self.state == OPEN:
                self.conn.worker.shard_put(
                    shard, [_NACK, self.conn.conn_id, self.key, True, [item[4], item[5]]])
            return
        if not consumer.ready:
            if self.cancelling is None or not self._to_cancelling(shard, item):
                consumer.early.append((shard, item))
            return
        if self.global_prefetch and not consumer.no_ack and (
            self.held or (len(self.shards) > 1 and len(self.tags) >= self.global_prefetch)
        ):
            if self.held.__class__ is not deque:
                self.held = deque()
            self.held.append((shard, item))
            return
        self._write_deliver(consumer, shard, item)

    def _write_deliver(self, consumer: Consumer, shard: int, item: list) -> None:
        conn = self.conn
        tags = self.tags
        tag = tags.skip() if consumer.no_ack else tags.add(shard, item[4], item[5])
        conn.write(encode_deliver(self.number, item[3], tag, item[6], item[7], item[8], item[9], item[10],
                                  conn.frame_max))
        conn.add_credit(shard, self.key, item[3], 1 + (len(item[10]) >> _CREDIT_SHIFT))  # as the shard charged

    def _to_cancelling(self, shard: int, item: list) -> bool:
        """Write a delivery of an earlier instance of its tag that is still cancelling on that shard
        (see ``cancelling``), without credit; False when it is not one."""
        for consumer in self.cancelling.get(item[3], ()):  # type: ignore[union-attr]
            if consumer.shard == shard:
                self._write_uncredited(consumer, shard, item)
                return True
        return False

    def _write_uncredited(self, consumer: Consumer, shard: int, item: list) -> None:
        """A delivery of a consumer whose CANCEL is sent: to the client (as RabbitMQ writes what comes
        between basic.cancel and cancel-ok), with no credit: its shard has no consumer to credit."""
        tags = self.tags
        tag = tags.skip() if consumer.no_ack else tags.add(shard, item[4], item[5])
        conn = self.conn
        conn.write(encode_deliver(self.number, item[3], tag, item[6], item[7], item[8], item[9], item[10],
                                  conn.frame_max))

    def _start_delivering(self, consumer: Consumer) -> None:
        """The consumer's reply is through and no earlier instance of its tag is cancelling."""
        consumer.ready = True
        early = consumer.early
        consumer.early = []
        for shard, item in early:
            self.deliver(shard, item)

    def _cancel_answered(self, tag: str, consumer: Consumer) -> None:
        """The shard removed a consumer that a newer instance of its tag had replaced."""
        cancelling = self.cancelling
        older = cancelling.get(tag) if cancelling is not None else None
        if older is None or consumer not in older:
            return
        older.remove(consumer)
        if older:
            return
        del cancelling[tag]  # type: ignore[union-attr]
        if not cancelling:
            self.cancelling = None
        current = self.consumers.get(tag)
        if current is not None and current.answered and not current.ready:
            self._start_delivering(current)

    def deliver_run(self, shard: int, items: list) -> None:
        """Consecutive DELIVER items of one shard batch for one consumer of this channel (2 or more).

        Encoded in one pass and credited once; the bytes, tags and credit are those of ``deliver``
        called per item. Anything but a ready consumer of an open channel outside a global prefetch
        takes the per-item path, which decides per message."""
        consumer = self.consumers.get(items[0][3])
        if (consumer is None or self.state != OPEN or not consumer.ready
                or (self.global_prefetch and not consumer.no_ack)):
            for item in items:
                self.deliver(shard, item)
            return
        conn = self.conn
        tags = self.tags
        cost = 0
        if consumer.no_ack:
            first = tags.skip_many(len(items))
            for item in items:
                cost += 1 + (len(item[10]) >> _CREDIT_SHIFT)
        else:
            first = tags.next_tag
            add = tags.add
            for item in items:
                add(shard, item[4], item[5])
                cost += 1 + (len(item[10]) >> _CREDIT_SHIFT)
        conn.write(encode_deliver_run(self.number, items[0][3], first, items, conn.frame_max))
        conn.add_credit(shard, self.key, items[0][3], cost)  # as the shard charged, once per run

    def _release_held(self) -> None:
        held = self.held
        limit = self.global_prefetch
        tags = self.tags
        while held and (not limit or len(tags) < limit):
            shard, item = held.popleft()
            consumer = self.consumers.get(item[3])
            if consumer is None or not consumer.ready:  # gone, or a newer instance of its tag
                if self.cancelling is not None and self._to_cancelling(shard, item):
                    continue
                self.conn.worker.shard_put(
                    shard, [_NACK, self.conn.conn_id, self.key, True, [item[4], item[5]]])
                continue
            self._write_deliver(consumer, shard, item)

    def _return_held(self, tag: str) -> None:
        """Give back what the global prefetch held for a consumer that is gone; nothing else would."""
        keep: deque = deque()
        put = self.conn.worker.shard_put
        conn_id = self.conn.conn_id
        for shard, item in self.held:
            if item[3] == tag:
                put(shard, [_NACK, conn_id, self.key, True, [item[4], item[5]]])
            else:
                keep.append((shard, item))
        self.held = keep

    def on_return(self, item: list) -> None:
        """A RETURN item: [RETURN, conn, ch, code, text, exchange, routing_key, props_raw, body]."""
        if self.state == OPEN:
            conn = self.conn
            conn.write(encode_content(self.number, C.Basic.Return(item[3], item[4], item[5], item[6]),
                                      item[7], item[8], conn.frame_max))

    def cancel_notify(self, tag: str) -> None:
        if self.cancelling is not None and tag in self.cancelling:
            current = self.consumers.get(tag)
            if current is None or not current.answered:
                return  # for an older instance of the tag, cancelled by the client already
        consumer = self.consumers.pop(tag, None)
        self.conn.drop_credit(self.key, tag)
        if consumer is not None and self.state == OPEN and self.conn.cancel_notify:
            if consumer.queue == self.deleting:
                self.deferred_cancels.append(tag)
            else:
                self._send(C.Basic.Cancel(consumer_tag=tag, nowait=True))

    def _flush_deferred_cancels(self) -> None:
        self.deleting = None
        tags = self.deferred_cancels
        if tags:
            self.deferred_cancels = []
            if self.state == OPEN:
                for tag in tags:
                    self._send(C.Basic.Cancel(consumer_tag=tag, nowait=True))

    # --------------------------------------------------------------- acks
    def ack(self, tag: int, multiple: bool) -> None:
        refs = self.tags.take(tag, multiple, 60, 80)
        if not refs:
            return
        conn = self.conn
        put = conn.worker.shard_put
        if len(refs) == 1:
            shard, qid, mid = refs[0]
            if shard >= 0:  # < 0: delivered by a shard that died since (frontend/amqp/shard_loss.py)
                put(shard, [_ACK, conn.conn_id, self.key, [qid, mid]])
        else:
            for shard, flat in group_by_shard(refs).items():
                put(shard, [_ACK, conn.conn_id, self.key, flat])
        if self.held:
            self._release_held()

    def nack(self, tag: int, multiple: bool, requeue: bool, class_id: int, method_id: int) -> None:
        refs = self.tags.take(tag, multiple, class_id, method_id)
        conn = self.conn
        for shard, flat in group_by_shard(refs).items():
            conn.worker.shard_put(shard, [_NACK, conn.conn_id, self.key, bool(requeue), flat])
        if self.held:
            self._release_held()

    # ------------------------------------------------------- channel class
    def m_channel_close(self, method: C.Channel.Close) -> None:
        # As RabbitMQ: close-ok once every shard this channel used has cancelled its consumers and
        # requeued its unacked messages, so a basic.get or consume right after close-ok sees them.
        # Until then the channel stays in conn.channels (its number is not free yet) but CLOSED.
        self.state = CLOSED
        self.backlog.clear()
        conn = self.conn

        def closed() -> None:
            if conn.channels.get(self.number) is self:  # the connection did not end meanwhile
                self._send(C.Channel.CloseOk())
                conn.forget_channel(self)

        self.release_resources(closed)

    def m_channel_close_ok(self, method: C.Channel.CloseOk) -> None:
        pass  # close-ok for a close we never sent: ignore, as RabbitMQ does

    def m_channel_open(self, method: C.Channel.Open) -> None:
        raise AMQPConnectionError(504, "second 'channel.open' seen", 20, 10)

    def m_channel_flow(self, method: C.Channel.Flow) -> None:
        if not method.active:
            raise AMQPConnectionError(NOT_IMPLEMENTED, "active=false", 20, 20)
        self._send(C.Channel.FlowOk(active=True))

    def m_channel_flow_ok(self, method: C.Channel.FlowOk) -> None:
        pass

    # ------------------------------------------------------ exchange class
    def m_exchange_declare(self, method: C.Exchange.Declare) -> None:
        nowait = method.nowait
        self._pipelined_request("exchange.declare", method,
                                lambda r: None if nowait else self._send(C.Exchange.DeclareOk()))

    def m_exchange_delete(self, method: C.Exchange.Delete) -> None:
        nowait = method.nowait
        self._pipelined_request("exchange.delete", method,
                                lambda r: None if nowait else self._send(C.Exchange.DeleteOk()))

    def m_exchange_bind(self, method: C.Exchange.Bind) -> None:
        nowait = method.nowait
        self._pipelined_request("exchange.bind", method,
                                lambda r: None if nowait else self._send(C.Exchange.BindOk()))

    def m_exchange_unbind(self, method: C.Exchange.Unbind) -> None:
        nowait = method.nowait
        self._pipelined_request("exchange.unbind", method,
                                lambda r: None if nowait else self._send(C.Exchange.UnbindOk()))

    # --------------------------------------------------------- queue class
    def m_queue_declare(self, method: C.Queue.Declare) -> None:
        nowait = method.nowait
        conn = self.conn
        if method.exclusive:
            conn.had_exclusive = True

        def ok(result: dict) -> None:  # in the channel's order
            name = result.get("queue", method.queue)
            self.last_queue = name
            if not nowait:
                self._send(C.Queue.DeclareOk(name, int(result.get("messages", 0)),
                                             int(result.get("consumers", 0))))

        def replied(pending: Pending, result: dict) -> None:  # the node's ok, maybe before earlier ones
            name = result.get("queue", method.queue)
            if nowait or result.get("created"):  # a new queue: no message, no consumer to count
                self._answered(pending, True, result)
                return
            q = conn.worker.defs.queue(conn.vhost, name)
            if q is None:
                self._answered(pending, True, result)
                return
            # The node's counts may miss publishes this frontend has not yet delivered to the
            # shard; asking the shard on the same (ordered) socket as those publishes includes them.
            vhost = conn.vhost
            conn.worker.shard_request(
                q.shard, lambda req_id: [_QUEUE_INFO, req_id, vhost, name], conn,
                lambda ok, info: self._answered(pending, ok, {**info, "queue": name} if ok else info))

        self._pipelined_request("queue.declare", method, ok, replied)

    def m_queue_bind(self, method: C.Queue.Bind) -> None:
        method.queue = self._queue_name(method.queue, method)
        nowait = method.nowait
        self._pipelined_request("queue.bind", method, lambda r: None if nowait else self._send(C.Queue.BindOk()))

    def m_queue_unbind(self, method: C.Queue.Unbind) -> None:
        method.queue = self._queue_name(method.queue, method)
        self._pipelined_request("queue.unbind", method, lambda r: self._send(C.Queue.UnbindOk()))

    def m_queue_delete(self, method: C.Queue.Delete) -> None:
        name = method.queue = self._queue_name(method.queue, method)
        nowait = method.nowait

        def ok(result: dict) -> None:
            if not nowait:
                self._send(C.Queue.DeleteOk(int(result.get("messages", 0))))
            self._flush_deferred_cancels()

        if self.consumers:
            self.deleting = name
            self._node_request("queue.delete", method, ok)
        else:  # no consumer of ours to cancel after delete-ok: other requests may be in flight with it
            self._pipelined_request("queue.delete", method, ok)

    def m_queue_purge(self, method: C.Queue.Purge) -> None:
        name = self._queue_name(method.queue, method)
        self.conn.access.check(self.conn.worker.defs, READ, "queue", name, 50, 30)
        q = self._local_queue(name, method)
        vhost = self.conn.vhost
        nowait = method.nowait
        self._shard_request(
            q.shard, lambda req_id: [contract.PURGE, req_id, vhost, name],
            lambda r: None if nowait else self._send(C.Queue.PurgeOk(int(r.get("messages", 0)))), method)

    # --------------------------------------------------------- basic class
    def m_basic_qos(self, method: C.Basic.Qos) -> None:
        if method.prefetch_size:
            raise AMQPConnectionError(NOT_IMPLEMENTED, f"prefetch_size!=0 ({method.prefetch_size})", 60, 10)
        count = int(method.prefetch_count)
        if method.global_:
            self.global_prefetch = count
            conn = self.conn
            worker = conn.worker
            for shard in range(worker.shard_count):
                worker.shard_put(shard, [contract.QOS, conn.conn_id, self.key, count])
                self.shards.add(shard)
            if self.held:
                self._release_held()
        else:
            self.prefetch_count = count
        self._send(C.Basic.QosOk())

    def m_basic_consume(self, method: C.Basic.Consume) -> None:
        if method.queue == PSEUDO_QUEUE:
            self._consume_replies(method)
            return
        name = self._queue_name(method.queue, method)
        self.conn.access.check(self.conn.worker.defs, READ, "queue", name, 60, 20)
        q = self._local_queue(name, method)
        check_consume_arguments(name, self.conn.vhost, method.arguments)
        tag = method.consumer_tag
        conn = self.conn
        if not tag:
            tag = "amq.ctag-" + secrets.token_urlsafe(16)
        elif tag in self.consumers:
            older = self.consumers[tag]
            if not older.cancelled:
                raise AMQPConnectionError(NOT_ALLOWED, f"attempt to reuse consumer tag '{tag}'", 60, 20)
            # Cancelled with nowait, its shard's answer not yet through: a new instance (``cancelling``).
            if self.cancelling is None:
                self.cancelling = {}
            self.cancelling.setdefault(tag, []).append(older)
            conn.drop_credit(self.key, tag)  # what is held back for the tag counts the older one's deliveries
        consumer = Consumer(tag, name, q.shard, bool(method.no_ack))
        self.consumers[tag] = consumer
        nowait = method.nowait
        item_tail = [conn.conn_id, self.key, conn.vhost, name, tag, bool(method.no_ack),
                     bool(method.exclusive), self.prefetch_count, consume_arguments(method.arguments or {})]

        def ok(_result: dict) -> None:
            if self.consumers.get(tag) is not consumer:
                return
            if not nowait:
                self._send(C.Basic.ConsumeOk(tag))
            consumer.answered = True
            if self.cancelling is None or tag not in self.cancelling:
                self._start_delivering(consumer)

        def build(req_id: int) -> list:
            return [contract.CONSUME, req_id, *item_tail]

        self._shard_request(q.shard, build, ok, method)
        conn.consumer_started(q.shard, self.key, tag)  # after the CONSUME, on the same lane

    def _consume_replies(self, method: C.Basic.Consume) -> None:
        if not method.no_ack:
            raise AMQPChannelError(PRECONDITION_FAILED, "reply consumer cannot acknowledge", 60, 20)
        if self.reply_consumer is not None:
            raise AMQPChannelError(PRECONDITION_FAILED, "reply consumer already set", 60, 20)
        tag = method.consumer_tag or "amq.ctag-" + secrets.token_urlsafe(16)
        if tag in self.consumers:
            raise AMQPConnectionError(NOT_ALLOWED, f"attempt to reuse consumer tag '{tag}'", 60, 20)
        conn = self.conn
        self.reply_consumer = (tag, new_reply_name(conn.worker.index, conn.conn_id, self.number))
        self.extras = True
        if not method.nowait:
            self._send(C.Basic.ConsumeOk(tag))

    def m_basic_cancel(self, method: C.Basic.Cancel) -> None:
        tag = method.consumer_tag
        nowait = method.nowait
        if self.reply_consumer is not None and self.reply_consumer[0] == tag:
            self.reply_consumer = None
        consumer = self.consumers.get(tag)
        if consumer is None or consumer.cancelled:
            if not nowait:
                self._send(C.Basic.CancelOk(tag))
            return
        consumer.cancelled = True

        def cancelled(_result: Any = None) -> None:
            # The shard has removed the consumer: nothing more comes for it. Deliveries it sent
            # before were written to the client (as RabbitMQ's, between basic.cancel and
            # cancel-ok), so a no-ack message is never lost in between.
            if self.consumers.get(tag) is consumer:
                del self.consumers[tag]
                self.conn.drop_credit(self.key, tag)
            else:
                self._cancel_answered(tag, consumer)
            if consumer.answered:  # its own, held while an older instance of its tag was cancelling
                for shard, item in consumer.early:
                    self._write_uncredited(consumer, shard, item)
            else:
                put = self.conn.worker.shard_put
                for shard, item in consumer.early:
                    put(shard, [_NACK, self.conn.conn_id, self.key, True, [item[4], item[5]]])
            consumer.early = []
            if self.held:
                self._return_held(tag)
            if not nowait and self.state == OPEN:
                self._send(C.Basic.CancelOk(tag))

        conn_id, key = self.conn.conn_id, self.key
        build = lambda req_id: [contract.CANCEL, conn_id, key, tag, req_id]  # noqa: E731
        if nowait:
            self.conn.worker.shard_request(consumer.shard, build, self.conn,
                                           lambda ok, result: cancelled() if self.state == OPEN else None)
        else:
            self._shard_request(consumer.shard, build, cancelled, method)

    def m_basic_get(self, method: C.Basic.Get) -> None:
        name = self._queue_name(method.queue, method)
        self.conn.access.check(self.conn.worker.defs, READ, "queue", name, 60, 70)
        q = self._local_queue(name, method)
        conn = self.conn
        no_ack = bool(method.no_ack)
        shard = q.shard
        tail = [conn.conn_id, self.key, conn.vhost, name, no_ack]

        def ok(result: dict) -> None:
            msg = result.get("message")
            if msg is None:
                self._send(C.Basic.GetEmpty())
                return
            qid, mid, redelivered, exchange, routing_key, props_raw, body, remaining = msg
            tag = self.tags.skip() if no_ack else self.tags.add(shard, qid, mid)
            conn.write(encode_content(
                self.number, C.Basic.GetOk(tag, bool(redelivered), exchange, routing_key, int(remaining)),
                props_raw, body, conn.frame_max))

        self._shard_request(shard, lambda req_id: [contract.GET, req_id, *tail], ok, method)

    def m_basic_recover(self, method: Any) -> None:
        if not method.requeue:
            # As rabbit_channel: redelivering to the same consumer is all RabbitMQ (and we) do.
            cid, mid = _ids(method)
            raise AMQPConnectionError(NOT_IMPLEMENTED, "requeue=false", cid, mid)
        self.tags.take_all()
        if self.held:
            self.held.clear()
        conn = self.conn
        for shard in self.shards:
            conn.worker.shard_put(shard, [contract.RECOVER, conn.conn_id, self.key])
        if isinstance(method, C.Basic.Recover):
            self._send(C.Basic.RecoverOk())

    # ------------------------------------------------------- confirm / tx
    def m_confirm_select(self, method: C.Confirm.Select) -> None:
        if self.tx is not None:
            raise AMQPChannelError(PRECONDITION_FAILED, "cannot switch from tx to confirm mode", 85, 10)
        if self.confirm is None:
            self.confirm = ConfirmTracker()
        if not method.nowait:
            self._send(C.Confirm.SelectOk())

    def m_tx_select(self, method: C.Tx.Select) -> None:
        if self.confirm is not None:
            raise AMQPChannelError(PRECONDITION_FAILED, "cannot switch from confirm to tx mode", 90, 10)
        if self.tx is None:
            self.tx = []
        self._send(C.Tx.SelectOk())

    def m_tx_commit(self, method: C.Tx.Commit) -> None:
        if self.tx is None:
            raise AMQPChannelError(PRECONDITION_FAILED, "channel is not transactional", 90, 20)
        pending = self.tx
        self.tx = None
        # Publishes go out as in confirm mode (internally): commit-ok waits for every shard's confirm.
        tracker = self.confirm = ConfirmTracker()
        try:
            for ev in pending:
                cls = ev.__class__
                if cls is E.Publish:
                    self.publish(ev)
                elif cls is E.Ack:
                    self.ack(ev.delivery_tag, ev.multiple)
                elif cls is E.Nack:
                    self.nack(ev.delivery_tag, ev.multiple, ev.requeue, 60, 120)
                elif cls is E.Reject:
                    self.nack(ev.delivery_tag, False, ev.requeue, 60, 90)
        finally:
            self.confirm = None
            if self.state == OPEN:
                self.tx = []
        if self.state != OPEN:
            return
        self.tx_commit = tracker
        self.backlog.block()
        self._maybe_commit_ok()

    def m_tx_rollback(self, method: C.Tx.Rollback) -> None:
        if self.tx is None:
            raise AMQPChannelError(PRECONDITION_FAILED, "channel is not transactional", 90, 30)
        self.tx = []
        self._send(C.Tx.RollbackOk())


_HANDLERS = {
    C.Channel.Close: Channel.m_channel_close,
    C.Channel.CloseOk: Channel.m_channel_close_ok,
    C.Channel.Open: Channel.m_channel_open,
    C.Channel.Flow: Channel.m_channel_flow,
    C.Channel.FlowOk: Channel.m_channel_flow_ok,
    C.Exchange.Declare: Channel.m_exchange_declare,
    C.Exchange.Delete: Channel.m_exchange_delete,
    C.Exchange.Bind: Channel.m_exchange_bind,
    C.Exchange.Unbind: Channel.m_exchange_unbind,
    C.Queue.Declare: Channel.m_queue_declare,
    C.Queue.Bind: Channel.m_queue_bind,
    C.Queue.Unbind: Channel.m_queue_unbind,
    C.Queue.Delete: Channel.m_queue_delete,
    C.Queue.Purge: Channel.m_queue_purge,
    C.Basic.Qos: Channel.m_basic_qos,
    C.Basic.Consume: Channel.m_basic_consume,
    C.Basic.Cancel: Channel.m_basic_cancel,
    C.Basic.Get: Channel.m_basic_get,
    C.Basic.Recover: Channel.m_basic_recover,
    C.Basic.RecoverAsync: Channel.m_basic_recover,
    C.Confirm.Select: Channel.m_confirm_select,
    C.Tx.Select: Channel.m_tx_select,
    C.Tx.Commit: Channel.m_tx_commit,
    C.Tx.Rollback: Channel.m_tx_rollback,
}
