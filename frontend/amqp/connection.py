"""One AMQP 0-9-1 client connection: handshake, heartbeats, channel 0, output batching.

An asyncio.Protocol around a sans-IO FrameParser. Everything a connection writes
during one loop turn is collected and written once by the worker's end-of-turn
flush (``flush_turn``; the worker also runs it when it has handled a read from a shard),
together with that turn's publisher confirms and the CREDIT returned to shards for
deliveries written out.
"""

from __future__ import annotations

import asyncio
import logging
import os
import platform
import time
from typing import TYPE_CHECKING, Any

from pamqp import commands as C

from broker import contract
from broker.alarms import REASONS
from broker.amqp import events as E
from broker.amqp.constants import (
    ACCESS_REFUSED,
    CHANNEL_ERROR,
    CONNECTION_FORCED,
    CONNECTION_LEVEL_CODES,
    FRAME_MIN_SIZE,
    INTERNAL_ERROR,
    NOT_ALLOWED,
    UNEXPECTED_FRAME,
)
from broker.amqp.encoder import encode_heartbeat, encode_method, encode_protocol_header
from broker.amqp.errors import AMQPChannelError, AMQPConnectionError, AMQPError
from broker.amqp.parser import FrameParser
from broker.auth import authenticate, check_vhost_access, is_loopback_peer
from broker.interning import Interner
from broker.permissions import Access
from broker.tls import peer_common_name
from broker.version import __version__
from frontend.amqp.channel import BACKLOG_PAUSE, CLOSED, OPEN, Channel
from frontend.amqp.replies import plain, reply_text
from frontend.amqp.shard_loss import connection_lost_shard
from frontend.paused_credit import START_WINDOW, give_back_step, keeps_up, return_lumps, take_back
from frontend.timer_wheel import wheel_for

if TYPE_CHECKING:
    from frontend.worker import FrontendWorker

log = logging.getLogger("shardmq.frontend")
_PROPERTIES = Interner()  # one copy of each distinct client-properties table (read-only)


def _drop_event(_event: Any) -> None:
    """A released channel's backlog handler: events of a closed channel are dropped."""

# Connection states, in handshake order.
AWAIT_HEADER = 0
AWAIT_START_OK = 1
AWAIT_TUNE_OK = 2
AWAIT_OPEN = 3
RUNNING = 4
CLOSING = 5  # we sent connection.close and wait for close-ok
CLOSED_STATE = 6

_STATE_NAMES = {AWAIT_HEADER: "starting", AWAIT_START_OK: "starting", AWAIT_TUNE_OK: "tuning",
                AWAIT_OPEN: "opening", RUNNING: "running", CLOSING: "closing", CLOSED_STATE: "closed"}

HANDSHAKE_TIMEOUT = 10.0
CLOSE_TIMEOUT = 2.0
# After close-ok the socket stays open for reading (bytes discarded) until the client closes it, at
# most this long: a client may send connection.close ahead of publishes still in its own buffer
# (Node.js amqplib does), and closing at once would reset its writes (ECONNRESET) and lose its
# close-ok. RabbitMQ lingers the same way (up to 30 s or the heartbeat).
LINGER_TIMEOUT = 10.0
# How long a client's connection.close may wait for its channels' pending work (RabbitMQ: 30 s).
DRAIN_TIMEOUT = 30.0
# A connection that was read more than this in one loop turn is not read again before the next turn
# (paused, resumed in flush_turn): the loop reads each ready socket up to 32 times a turn (256 KB
# each with uvloop), so one flooding publisher could fill a turn with megabytes to parse while the
# other connections of the frontend wait for it. MQTT's publishers are held per turn too
# (frontend/mqtt/direct.py TURN_PACKETS). A few thousand small publishes a turn keep the batches
# to the shards as large as they need to be.
TURN_READ_BYTES = 256 << 10
# A read's events are handled for about this long in one loop turn; the rest wait for the next turn,
# in order, with the socket paused ("dispatch"). A client pipelining 500 queue.delete (or declares)
# in one write made one turn of 4-8 ms in the frontend, in front of every other connection's
# publishes and deliveries (docs/benchmarks.md "Worst gap while 30,000 queues are deleted"). Checked
# every DISPATCH_CHECK events other than publishes and acks (the data path's turns stay as they were),
# and only for reads of more events than that.
DISPATCH_TURN_S = int(os.environ.get("SHARDMQ_TEST_DISPATCH_TURN_US") or 1000) / 1e6  # tests: 0 = defer always
DISPATCH_CHECK = 8
# A connection that has not published parses a big read this much at a time, a slice per loop turn
# (the rest waits with the deferred events): parsing 500 pipelined queue.delete (15 KB) took 2-3 ms
# of one turn, a 4 KiB slice ~0.8 ms. The slice's parse counts against the turn's DISPATCH_TURN_S
# (one deadline for the parse and the dispatch of its events), and a turn that dispatched events left
# from before parses no slice once that deadline passed: a 4 KiB slice parsed after a full turn of
# dispatch, then dispatched for DISPATCH_TURN_S more, made turns of 3-4 ms of the pair's CPU during
# 30,000 pipelined deletes (docs/benchmarks.md "Deletes paced by the round trips"). Publishers and
# consumers parse what they read at once (TURN_READ_BYTES bounds their turns).
PARSE_SLICE = 1024

_PUBLISH = E.Publish
_PUBLISH_RUN = E.PublishRun
_ACK = E.Ack
_METHOD = E.MethodFrame
_CREDIT = contract.CREDIT
# Credit goes back to a shard once a consumer has this much to return, not after every written
# delivery: at a steady low rate each CREDIT woke the shard once per message (one more cross-core
# wake-up, ~10 us of shard CPU each on a 2-core VM) just as the consumer's own wake-up needed a
# core. The shard still holds at least CREDIT_WINDOW - CREDIT_RETURN_AT credits for deliveries it
# has not seen written, so holding the rest back never stops a consumer (docs/architecture.md); a
# consumer whose window is not whole (slow start, after a pause) returns at a quarter of what it has.
CREDIT_RETURN_AT = contract.CREDIT_WINDOW // 4
_NO_CREDIT: dict = {}  # shared, never written
_CLOSE_OK_FRAME = encode_method(0, C.Connection.CloseOk())
_OPEN_OK_FRAME = encode_method(0, C.Connection.OpenOk())
# The handshake's other frames depend only on settings and the channel number: encoded once
# (pamqp's encoder is most of the handshake's Python time), keyed by what they hold.
_FRAMES: dict[tuple, bytes] = {}


def _cached_frame(key: tuple, build) -> bytes:  # noqa: ANN001
    frame = _FRAMES.get(key)
    if frame is None:
        frame = _FRAMES[key] = build()
    return frame



def server_properties(frontend_index: int) -> dict:
    return {
        "product": "ShardMQ",
        "version": __version__,
        "platform": f"Python {platform.python_version()}",
        "information": "https://github.com/shardmq",
        "capabilities": {
            "publisher_confirms": True,
            "exchange_exchange_bindings": True,
            "basic.nack": True,
            "consumer_cancel_notify": True,
            "connection.blocked": True,
            "authentication_failure_close": True,
            "per_consumer_qos": True,
            "consumer_priorities": True,
            "direct_reply_to": True,
        },
        "shardmq_frontend": frontend_index,
    }



_NO_REASONS: frozenset = frozenset()  # an idle connection's read-pause reasons and confirm channels


class AMQPConnection(asyncio.Protocol):
    # Slots, not a __dict__: with this many attributes an instance dict outgrows the shared-key
    # layout and costs ~1.5 KB per connection (10,000 idle connections: 15 MB per frontend).
    __slots__ = (
        "worker", "conn_id", "frame_max", "channel_max", "heartbeat", "parser", "transport", "state", "vhost",
        "user", "access", "peer", "client_properties", "connected_at", "recv_oct", "send_oct", "_sent_blocked",
        "channels", "had_exclusive", "registered", "confirm_shards", "_out", "_dirty", "_confirm_channels", "_credit", "_credit_due",
        "_taken", "_credit_seen", "_write_paused", "_read_pause", "publisher", "_close_after_flush", "_linger_after_flush", "_released",
        "wheel_tick", "_wheel", "_close_timer", "_received", "_wrote", "_missed", "_close_requested", "_open_pending",
        "_generation", "_turn_read", "_deferred", "_unparsed",
    )

    def __init__(self, worker: FrontendWorker) -> None:
        self.worker = worker
        self.conn_id = worker.new_conn_id()
        settings = worker.settings
        self.frame_max = int(settings.get("frame_max", 131072))
        self.channel_max = int(settings.get("channel_max", 2047))
        self.heartbeat = int(settings.get("heartbeat", 60))
        self.parser = FrameParser("server", self.frame_max, int(settings.get("max_message_size", 128 << 20)),
                                  channel_gate=True, publish_runs=True)
        self.transport: asyncio.Transport | None = None
        self.state = AWAIT_HEADER
        self.vhost = "/"
        self.user = ""
        self.access = Access("", "/")  # replaced at connection.open: the user's permission checks
        self.peer = None
        # For the management API's connection list (frontend/stats.py), sent in periodic STATS.
        self.client_properties: dict = {}
        self.connected_at = int(time.time() * 1000)
        self.recv_oct = 0
        self.send_oct = 0
        self._sent_blocked = False  # connection.blocked sent, unblocked owed
        self.channels: dict[int, Channel] = {}
        self.had_exclusive = False  # declared an exclusive queue: the node deletes them when we go
        self.registered = False  # counted by the node (connection.open): it must hear when we go
        self.confirm_shards: set[int] = set()
        self._out: list[bytes] = []
        self._dirty = False
        # Empty and shared until used (an idle connection has neither): a set each is 216 bytes.
        self._confirm_channels: set[Channel] | frozenset = _NO_REASONS
        self._credit: dict[tuple[int, int, str], int] = {}
        self._credit_due = False  # some _credit entry reached CREDIT_RETURN_AT since the last return
        self._taken: dict[tuple[int, int, str], int] | None = None  # credit taken back while paused
        self._credit_seen: dict[tuple[int, int, str], int] = _NO_CREDIT  # _credit after the last turn, while _taken
        self._write_paused = False
        self._read_pause: set[str] | frozenset = _NO_REASONS
        # Set on the first basic.publish: only publishing connections are paused under shard
        # back-pressure (as RabbitMQ's flow control), so consumers' acks are still read.
        self.publisher = False
        self._close_after_flush = False
        self._linger_after_flush = False  # close-ok sent: half-close and read until the client closes
        self._released = False
        # The handshake deadline, then the heartbeat check: an entry in the frontend's one timer
        # wheel (frontend/timer_wheel.py), not a loop timer per connection.
        self.wheel_tick: int | None = None
        self._wheel = wheel_for(worker.loop)
        self._close_timer: asyncio.TimerHandle | None = None
        self._received = False
        self._wrote = False
        self._missed = 0
        self._close_requested = False  # client sent connection.close; channels still finishing
        self._open_pending: list | None = None  # events that arrived while connection.open awaits the node
        self._generation = 0  # channel openings so far: the generation part of Channel.key
        self._turn_read = 0  # bytes read in this loop turn (TURN_READ_BYTES)
        # Input read and not handled yet, in order: events (DISPATCH_TURN_S), then bytes not parsed yet
        # (PARSE_SLICE). _deferred is not None whenever either waits; _dispatch_deferred is scheduled.
        self._deferred: list | None = None
        self._unparsed = b""

    # ------------------------------------------------------------- transport
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.peer = transport.get_extra_info("peername")
        self.worker.add_connection(self)
        self._wheel.arm(self, HANDSHAKE_TIMEOUT)

    def data_received(self, data: bytes) -> None:
        worker = self.worker
        if worker._trace is not None:  # --trace-stages (debug): the fe_read stage
            worker._trace.read()
        if worker.fence[0] > worker.defs_version:  # definitions fence: broker/defs_fence.py
            worker.catch_up_defs()
        self._received = True
        n = len(data)
        self.recv_oct += n
        read = self._turn_read + n
        self._turn_read = read
        if read > TURN_READ_BYTES:
            # The event loop reads a socket up to 32 times a turn: without this one publisher could
            # hand the turn megabytes while every other connection of the frontend waits for it.
            self.pause_reading("turn")
        try:
            if self.state == CLOSED_STATE:
                return
            parser = self.parser
            if parser._dead:  # FrameParser.dead, without the property's call on every read
                # After a framing/syntax error the parser reads nothing more, but the client's
                # close-ok is still a well-formed frame: close as soon as it shows up, not at the timeout.
                if self.state == CLOSING and _CLOSE_OK_FRAME in data:
                    self._close_transport()
                return
            if self._deferred is not None:  # input read before still waits for its turn: this goes behind
                self._unparsed += data
                return
            deadline = None
            if len(data) > PARSE_SLICE and not self._data_path():
                self._unparsed = data[PARSE_SLICE:]
                data = data[:PARSE_SLICE]
                deadline = time.perf_counter() + DISPATCH_TURN_S  # the slice's parse counts too
            try:  # _feed, inline: every client read comes through here
                events = parser.feed(data)
            except Exception as exc:  # the parser is fuzzed never to raise; still never a crash
                self.internal_error(exc)
            else:
                self._dispatch_all(events, deadline)
            if self._unparsed and self._deferred is None:
                self._defer([])
            if worker._early:
                worker.send_early()
        finally:
            # flush_turn ends this turn's count. Marked once the read is handled, not before: the
            # turn's end is then scheduled behind what the read handed to a paired shard
            # (send_early), whose answer (a confirm, a delivery) ends the turn at once
            # (_shard_drained) and cancels it, where an end of turn that found nothing to write ran
            # before the shard even saw the publish (a callback and a flush_turn per message).
            if not self._dirty:
                self._dirty = True
                worker.mark_dirty(self)

    def _data_path(self) -> bool:
        """A publisher's or a consumer's connection: what it sends (publishes, acks) is parsed at once."""
        return self.publisher or any(ch.consumers for ch in self.channels.values())

    def _feed(self, data: bytes, deadline: float | None = None) -> None:
        try:
            events = self.parser.feed(data)
        except Exception as exc:  # the parser is fuzzed never to raise; still never a crash
            self.internal_error(exc)
            return
        self._dispatch_all(events, deadline)

    def _defer(self, rest: list) -> None:
        """Leave events (and any bytes not parsed) to the next loop turn, reading paused meanwhile."""
        if self._deferred is None:
            self._deferred = rest
            self.pause_reading("dispatch")
            self.worker.loop.call_soon(self._dispatch_deferred)
        else:  # events older than those already waiting (connection.open's): first
            self._deferred = rest + self._deferred

    def _dispatch_all(self, events: list, deadline: float | None = None) -> None:
        """Handle events in order; a connection error closes us, a bug is a 541, never a crash.
        deadline: the turn's (perf_counter), when it began before these events (a parse)."""
        if len(events) > DISPATCH_CHECK:
            self._dispatch_budgeted(events, deadline)
            return
        try:
            for ev in events:
                try:
                    self._dispatch(ev)
                except AMQPConnectionError as exc:
                    self.fail(exc.code, exc.text, exc.class_id, exc.method_id)
                if self.state == CLOSED_STATE:
                    return
        except Exception as exc:
            self.internal_error(exc)

    def _dispatch_budgeted(self, events: list, deadline: float | None = None) -> None:
        """_dispatch_all for many events: those left after DISPATCH_TURN_S (or ``deadline``) go to the
        next loop turn."""
        if deadline is None:
            deadline = time.perf_counter() + DISPATCH_TURN_S
        n = len(events)
        i = 0
        counted = 0
        try:
            while i < n:
                ev = events[i]
                i += 1
                try:
                    self._dispatch(ev)
                except AMQPConnectionError as exc:
                    self.fail(exc.code, exc.text, exc.class_id, exc.method_id)
                if self.state == CLOSED_STATE:
                    return
                cls = ev.__class__
                if cls is _PUBLISH or cls is _PUBLISH_RUN or cls is _ACK:
                    continue  # the data path keeps its turns (TURN_READ_BYTES bounds them)
                counted += 1
                if not counted % DISPATCH_CHECK and i < n and time.perf_counter() > deadline:
                    self._defer(events[i:])
                    return
        except Exception as exc:
            self.internal_error(exc)

    def _dispatch_deferred(self) -> None:
        """The next turn's share of the input read earlier: events (DISPATCH_TURN_S), then a slice of
        the bytes not parsed yet (PARSE_SLICE)."""
        events = self._deferred
        self._deferred = None
        if events is None or self.state == CLOSED_STATE:
            return
        worker = self.worker
        if worker.fence[0] > worker.defs_version:  # as for any input (broker/defs_fence.py)
            worker.catch_up_defs()
        if not self._dirty:
            self._dirty = True
            worker.mark_dirty(self)
        deadline = time.perf_counter() + DISPATCH_TURN_S  # this turn's, for the events and a slice
        if events:
            self._dispatch_all(events, deadline)
        if self._deferred is None and self._unparsed and self.state != CLOSED_STATE:
            data = self._unparsed
            data_path = self._data_path()
            if events and not data_path and time.perf_counter() > deadline:
                # This turn went to the events left from before: the next slice in the next turn.
                self._defer([])
            else:
                cut = len(data) if data_path else PARSE_SLICE
                self._unparsed = data[cut:]
                data = data[:cut]
                if self.parser.dead:  # as in data_received
                    self._unparsed = b""
                    if self.state == CLOSING and _CLOSE_OK_FRAME in data:
                        self._close_transport()
                else:
                    self._feed(data, None if data_path else deadline)
                if self._unparsed and self._deferred is None:
                    self._defer([])
        if self._deferred is None:
            self.resume_reading("dispatch")
        if worker._early:
            worker.send_early()

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        if self.state not in (CLOSING, CLOSED_STATE) and self.state >= AWAIT_OPEN:
            log.info("connection %s (%s): client went away%s", self.conn_id, self.peer,
                     f": {exc}" if exc else "")
        self.state = CLOSED_STATE
        self._release()
        self._wheel.disarm(self)
        if self._close_timer is not None:
            self._close_timer.cancel()
        self._out = []
        self.worker.remove_connection(self)

    def pause_writing(self) -> None:
        self._write_paused = True
        self.take_back_credit()

    def take_back_credit(self) -> None:
        """The client stopped reading: the shards keep what they have not sent (frontend/paused_credit.py)."""
        if self.state != CLOSED_STATE:
            credit = self._credit
            consumers = []
            for ch in self.channels.values():
                for tag, c in ch.consumers.items():
                    key = (c.shard, ch.key, tag)
                    consumers.append((key, credit.get(key, 0)))
            taken = self._taken
            if taken is None:
                taken = self._taken = {}
            take_back(self.worker.shard_put, self.conn_id, consumers, taken)

    def consumer_started(self, shard: int, channel: int, tag: str) -> None:
        """A CONSUME was just put: the consumer starts with START_WINDOW of its window, and with none on
        a paused connection (the shard applies this in the same batch, before it delivers)."""
        if self.state != CLOSED_STATE:
            if self._taken is None:
                self._taken = {}
            key = (shard, channel, tag)
            take_back(self.worker.shard_put, self.conn_id, [(key, self._credit.get(key, 0))], self._taken,
                      0 if self._write_paused else START_WINDOW)

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._taken is not None:
            self._give_back()
        if self._credit:
            self._mark_dirty()

    def _give_back(self, moved: set | None = None) -> None:
        """At resume, and after a turn that wrote deliveries (``moved``: for whom): a step of the credit
        taken back (frontend/paused_credit.py give_back_step)."""
        self._taken = give_back_step(self.worker.shard_put, self.conn_id, self._taken, self.state != CLOSED_STATE,
                                     keeps_up(self.transport, self.send_oct), moved)
        if self._taken is None:
            self._credit_seen = _NO_CREDIT

    def became_publisher(self) -> None:
        self.publisher = True
        if self.worker.pressure:
            self.pause_reading("pressure")
        if self.worker.alarms:
            self.apply_alarms()

    def apply_alarms(self) -> None:
        """Block a publishing connection while a resource alarm is in effect (RabbitMQ's connection.blocked):
        stop reading it, tell the client if it announced the capability; unblock once they clear."""
        alarms = self.worker.alarms
        if self.state in (CLOSING, CLOSED_STATE):
            return
        if alarms and self.publisher:
            if "alarm" not in self._read_pause:
                self.pause_reading("alarm")
                caps = self.client_properties.get("capabilities") or {}
                if isinstance(caps, dict) and caps.get("connection.blocked") and self.state == RUNNING:
                    self._sent_blocked = True
                    self.send_method(0, C.Connection.Blocked(", ".join(REASONS.get(a, a) for a in alarms)))
        elif not alarms and "alarm" in self._read_pause:
            self.resume_reading("alarm")
            if self._sent_blocked:
                self._sent_blocked = False
                self.send_method(0, C.Connection.Unblocked())

    def pause_reading(self, reason: str) -> None:
        if not self._read_pause:
            if self.transport is not None and not self.transport.is_closing():
                self.transport.pause_reading()
            self._read_pause = {reason}
        else:
            self._read_pause.add(reason)

    def resume_reading(self, reason: str) -> None:
        if reason in self._read_pause:
            self._read_pause.discard(reason)
            if not self._read_pause and self.transport is not None and not self.transport.is_closing():
                self.transport.resume_reading()

    def backlog_grew(self) -> None:
        if "backlog" not in self._read_pause:
            self.pause_reading("backlog")

    def _check_backlog(self) -> None:
        if "backlog" in self._read_pause and all(len(ch.backlog) < BACKLOG_PAUSE // 2
                                                 for ch in self.channels.values()):
            self.resume_reading("backlog")

    # ---------------------------------------------------------------- output
    def _mark_dirty(self) -> None:
        if not self._dirty:
            self._dirty = True
            self.worker.mark_dirty(self)

    def write(self, data: bytes) -> None:
        self._out.append(data)
        if not self._dirty:
            self._dirty = True
            self.worker.mark_dirty(self)

    def send_method(self, channel: int, method: Any) -> None:
        self.write(encode_method(channel, method))

    def confirm_dirty(self, channel: Channel) -> None:
        if self._confirm_channels:
            self._confirm_channels.add(channel)
        else:
            self._confirm_channels = {channel}
        if not self._dirty:
            self._dirty = True
            self.worker.mark_dirty(self)

    def add_credit(self, shard: int, channel: int, tag: str, n: int = 1) -> None:
        key = (shard, channel, tag)
        credit = self._credit
        held = credit[key] = credit.get(key, 0) + n
        if held >= CREDIT_RETURN_AT:
            self._credit_due = True  # flush_turn looks for lumps to return only then

    def drop_credit(self, channel: int, tag: str | None = None) -> None:
        """Forget the credit held back for a consumer (``tag``) or a whole channel that is gone: the
        shard has dropped it, and a connection that consumes and cancels for hours must not keep an
        entry per consumer tag it ever had."""
        credit = self._credit
        if credit:
            for key in [k for k in credit if k[1] == channel and (tag is None or k[2] == tag)]:
                del credit[key]
        taken = self._taken
        if taken:  # nothing to give back to a consumer the shard no longer has
            for key in [k for k in taken if k[1] == channel and (tag is None or k[2] == tag)]:
                del taken[key]

    def flush_turn(self) -> None:
        """End of a loop turn: confirms, then one write, then the credit for what was written."""
        if self._confirm_channels:
            chans = self._confirm_channels
            self._confirm_channels = _NO_REASONS
            for ch in chans:
                ch.emit_confirms()
        out = self._out
        transport = self.transport
        if out:
            self._out = []
            if transport is not None and not transport.is_closing():
                if len(out) == 1:
                    transport.write(out[0])
                    self.send_oct += len(out[0])
                else:
                    transport.writelines(out)
                    self.send_oct += sum(map(len, out))
                self._wrote = True
        moved: set | None = None
        if self._credit and not self._write_paused and self.state != CLOSED_STATE:
            put = self.worker.shard_put
            conn_id = self.conn_id
            credit = self._credit
            if self._taken:  # a consumer's window is not whole (it started, or its socket paused)
                seen = self._credit_seen
                moved = {key for key, n in credit.items() if n != seen.get(key, 0)}  # deliveries this turn
                return_lumps(put, conn_id, credit, self._taken, CREDIT_RETURN_AT)
                self._credit_seen = dict(credit)
            elif self._credit_due:  # some key reached a lump (add_credit): not a scan of every turn
                self._credit_due = False
                due = [key for key, n in credit.items() if n >= CREDIT_RETURN_AT]
                for key in due:
                    put(key[0], [_CREDIT, conn_id, key[1], key[2], credit.pop(key)])
        if moved and self._taken is not None and not self._write_paused and transport is not None:
            self._give_back(moved)  # a step if the client took what was written (paused_credit.keeps_up)
        self._dirty = False
        read = self._turn_read
        if read:
            self._turn_read = 0
            counters = self.worker.counters
            if read > counters["read_bytes_per_turn_peak"]:
                counters["read_bytes_per_turn_peak"] = read
            if read > TURN_READ_BYTES:
                self.resume_reading("turn")
        if self._close_after_flush and transport is not None:
            transport.close()
        elif self._linger_after_flush and transport is not None:
            self._linger_after_flush = False
            self._linger(transport)

    def _linger(self, transport: asyncio.Transport) -> None:
        """close-ok is on its way: send FIN, keep reading (and discarding) until the client closes."""
        if transport.is_closing():
            return
        if self._read_pause:
            self._read_pause.clear()
            transport.resume_reading()
        if transport.can_write_eof():
            transport.write_eof()
        if self._close_timer is not None:
            self._close_timer.cancel()
        self._close_timer = self.worker.loop.call_later(LINGER_TIMEOUT, transport.close)

    @staticmethod
    def reply_text(code: int, text: str) -> str:
        return reply_text(code, text)

    # --------------------------------------------------------------- dispatch
    def _dispatch(self, ev: Any) -> None:
        if self._close_requested:
            return  # the client said connection.close: nothing it sends after that counts
        if self._open_pending is not None:
            # connection.open waits for the node (connection count); clients may pipeline
            # channel.open and more behind it: keep them in order until open-ok is sent.
            self._open_pending.append(ev)
            return
        cls = ev.__class__
        if self.state == CLOSING and not (cls is _METHOD and ev.channel == 0):
            return  # after our connection.close only close/close-ok matter
        if cls is _PUBLISH or cls is _PUBLISH_RUN or cls is _ACK:
            ch = self.channels.get(ev.channel)
            if ch is None:
                self._no_channel(ev)
            ch.submit(ev)
            return
        if cls is _METHOD:
            if ev.channel == 0:
                self._connection_method(ev.method)
                return
            if self.state != RUNNING:
                self._unexpected_frame(ev)
                return
            ch = self.channels.get(ev.channel)
            if ch is None:
                if isinstance(ev.method, C.Channel.Open):
                    self._open_channel(ev.channel)
                    return
                self._no_channel(ev)
            ch.submit(ev)
            return
        if cls is E.ConnectionProtocolError:
            self.fail(ev.code, ev.text, ev.class_id, ev.method_id)
            return
        if cls is E.ProtocolHeaderReceived:
            self._start()
            return
        if cls is E.BadProtocolHeader:
            self.write(encode_protocol_header())
            self._close_after_flush = True
            self.state = CLOSED_STATE
            return
        if cls is E.Heartbeat:
            return
        ch = self.channels.get(getattr(ev, "channel", 0))
        if ch is None:
            self._no_channel(ev)
        ch.submit(ev)

    def _no_channel(self, ev: Any) -> None:
        if self.state != RUNNING:
            self._unexpected_frame(ev)
        cid, mid = 0, 0
        method = getattr(ev, "method", None)
        if method is not None:
            cid, mid = method.index >> 16, method.index & 0xFFFF
        elif ev.__class__ is _PUBLISH or ev.__class__ is _PUBLISH_RUN:
            cid, mid = 60, 40
        raise AMQPConnectionError(CHANNEL_ERROR, "expected 'channel.open'", cid, mid)

    def _unexpected_frame(self, ev: Any) -> None:
        raise AMQPConnectionError(UNEXPECTED_FRAME,
                                  f"type 1, channel {getattr(ev, 'channel', 0)} before the connection was opened")

    def _open_channel(self, number: int) -> None:
        # RabbitMQ limits how many channels are open, not their numbers (aiormq opens 65535 on
        # purpose): rabbit_reader's 530 names the count, with class and method 0.
        if len(self.channels) >= self.channel_max:
            raise AMQPConnectionError(
                NOT_ALLOWED, f"number of channels opened ({len(self.channels)}) has reached the negotiated "
                f"channel_max ({self.channel_max})")
        self._generation += 1
        ch = Channel(self, number, self._generation)
        self.channels[number] = ch
        if number <= 64:  # the numbers clients use; the cache stays small whatever a client opens
            self.write(_cached_frame(("channel.open-ok", number), lambda: encode_method(number, C.Channel.OpenOk())))
        else:
            self.send_method(number, C.Channel.OpenOk())

    def forget_channel(self, ch: Channel) -> None:
        ch.state = CLOSED
        self.drop_credit(ch.key)
        if self.channels.get(ch.number) is ch:
            del self.channels[ch.number]
        if self._confirm_channels:
            self._confirm_channels.discard(ch)

    # ------------------------------------------------------------- channel 0
    def _connection_method(self, method: Any) -> None:
        state = self.state
        if state == CLOSING:
            if isinstance(method, C.Connection.CloseOk):
                self._close_transport()
            elif isinstance(method, C.Connection.Close):
                self.send_method(0, C.Connection.CloseOk())
                self._linger_after_flush = True
            return
        if isinstance(method, C.Connection.Close):
            if state == RUNNING and self._channels_busy():
                # RabbitMQ shuts the channels down behind what they already received and answers
                # close-ok after: a publish pipelined behind a declare must not be dropped.
                self._close_requested = True
                self._close_timer = self.worker.loop.call_later(DRAIN_TIMEOUT, self._finish_client_close)
                return
            self._finish_client_close()
            return
        if state == AWAIT_START_OK and isinstance(method, C.Connection.StartOk):
            self._start_ok(method)
        elif state == AWAIT_TUNE_OK and isinstance(method, C.Connection.TuneOk):
            self._tune_ok(method)
        elif state == AWAIT_OPEN and isinstance(method, C.Connection.Open):
            self._open(method)
        elif isinstance(method, C.Connection.Blocked | C.Connection.Unblocked | C.Connection.UpdateSecret):
            if isinstance(method, C.Connection.UpdateSecret) and state == RUNNING:
                self.send_method(0, C.Connection.UpdateSecretOk())
        else:
            index = method.index
            raise AMQPConnectionError(
                CHANNEL_ERROR, f"unexpected method in connection state {_STATE_NAMES[state]}",
                index >> 16, index & 0xFFFF)

    def _channels_busy(self) -> bool:
        return any(ch.backlog.busy or ch.backlog.events for ch in self.channels.values() if ch.state == OPEN)

    def _finish_client_close(self) -> None:
        if self.state in (CLOSING, CLOSED_STATE):
            return
        if self._close_timer is not None:
            self._close_timer.cancel()
            self._close_timer = None
        self._release()
        self.write(_CLOSE_OK_FRAME)
        self._linger_after_flush = True
        self.state = CLOSED_STATE

    def _start(self) -> None:
        self.state = AWAIT_START_OK
        index = self.worker.index
        mechanisms = "PLAIN AMQPLAIN EXTERNAL" if self._cert_user() else "PLAIN AMQPLAIN"
        self.write(_cached_frame(("start", index, mechanisms), lambda: encode_method(0, C.Connection.Start(
            0, 9, server_properties(index), mechanisms, "en_US"))))

    def _cert_user(self) -> str | None:
        return peer_common_name(self.transport, self.worker.settings)

    def _start_ok(self, method: C.Connection.StartOk) -> None:
        response = method.response
        if isinstance(response, str):
            response = response.encode("utf-8", "surrogateescape")
        loopback_users = self.worker.settings.get("loopback_users")
        if method.mechanism == "EXTERNAL" and self._cert_user():
            # The verified client certificate is the credential; its CN must be a user of the broker.
            if self._cert_user() not in self.worker.defs.users:
                raise AMQPConnectionError(ACCESS_REFUSED, f"user '{self._cert_user()}' (certificate CN) unknown",
                                          10, 11)
            self.user = self._cert_user()
            self.state = AWAIT_TUNE_OK
            self._send_tune()
            return
        try:
            self.user = authenticate(self.worker.defs, method.mechanism, response or b"",
                                     is_loopback_peer(self.peer),
                                     tuple(loopback_users) if loopback_users is not None else None)
        except AMQPError as exc:
            raise AMQPConnectionError(ACCESS_REFUSED, exc.text, 10, 11) from None
        self.client_properties = _PROPERTIES(plain(method.client_properties or {}))
        self.state = AWAIT_TUNE_OK
        self._send_tune()

    def _send_tune(self) -> None:
        tune = (self.channel_max, self.frame_max, self.heartbeat)
        self.write(_cached_frame(("tune", *tune), lambda: encode_method(0, C.Connection.Tune(*tune))))

    def _tune_ok(self, method: C.Connection.TuneOk) -> None:
        # rabbit_reader's validate_negotiated_integer_value: 530 with its wording.
        frame_max = int(method.frame_max)
        if frame_max and frame_max < FRAME_MIN_SIZE:
            raise AMQPConnectionError(
                NOT_ALLOWED, f"negotiated frame_max = {frame_max} is lower than the minimum allowed value "
                f"({FRAME_MIN_SIZE})", 10, 30)
        if frame_max == 0 or frame_max > self.frame_max:
            detail = " (no limit)" if frame_max == 0 else ""
            raise AMQPConnectionError(
                NOT_ALLOWED, f"negotiated frame_max = {frame_max}{detail} is higher than the maximum allowed "
                f"value ({self.frame_max})", 10, 30)
        channel_max = int(method.channel_max)
        if channel_max > self.channel_max:
            raise AMQPConnectionError(
                NOT_ALLOWED, f"negotiated channel_max = {channel_max} is higher than the maximum allowed "
                f"value ({self.channel_max})", 10, 30)
        if channel_max:
            self.channel_max = channel_max
        self.frame_max = frame_max
        self.parser.frame_max = frame_max
        self.heartbeat = int(method.heartbeat)
        self.state = AWAIT_OPEN

    def _open(self, method: C.Connection.Open) -> None:
        vhost = method.virtual_host or "/"
        try:
            check_vhost_access(self.worker.defs, self.user, vhost)
        except AMQPError as exc:
            raise AMQPConnectionError(exc.code, exc.text, 10, 40) from None
        self.vhost = vhost
        self.access = Access(self.user, vhost)
        # Every connection is counted by the node across frontends, so a max-connections limit set
        # later counts the connections that are already open (registered makes _release tell the
        # node when we go).
        self.registered = True
        self._open_pending = []
        worker = self.worker
        worker.node_request("connection.open", {"vhost": vhost, "user": self.user,
                                                "owner": [worker.index, self.conn_id]}, self._open_counted)

    def _open_counted(self, ok: bool, result: Any) -> None:
        pending = self._open_pending or []
        self._open_pending = None
        if self.state != AWAIT_OPEN or self.transport is None:
            return
        if not ok:
            self.fail(int(result[0]), str(result[1]), 10, 40)
            return
        self._opened()
        self._dispatch_all(pending)

    def _opened(self) -> None:
        vhost = self.vhost
        self.state = RUNNING
        self.write(_OPEN_OK_FRAME)
        if self.heartbeat:
            self._missed = 0
            self._wheel.arm(self, self.heartbeat / 2)
        else:
            self._wheel.disarm(self)
        log.debug("connection %s (%s): user '%s' opened vhost '%s'", self.conn_id, self.peer, self.user, vhost)

    # ------------------------------------------------------------- timers
    def on_tick(self) -> None:
        """The timer wheel: the handshake deadline before open-ok, the heartbeat check after."""
        if self.state < RUNNING:
            self._handshake_timeout()
        elif self.state == RUNNING:
            self._heartbeat_tick()

    def _handshake_timeout(self) -> None:
        if self.transport is not None:
            log.info("connection %s (%s): handshake timeout", self.conn_id, self.peer)
            self.transport.abort()

    def _heartbeat_tick(self) -> None:
        """Every heartbeat/2 s: send one if we were silent; give up after two silent intervals."""
        if self.transport is None:
            return
        if self._received or self._read_pause:
            # While we do not read the socket (blocked by an alarm, back-pressure) its heartbeats
            # cannot be seen: not a dead peer (RabbitMQ pauses its heartbeat monitor likewise).
            self._received = False
            self._missed = 0
        else:
            self._missed += 1
            if self._missed >= 4:
                log.warning("connection %s (%s): missed heartbeats from client, timeout: %ds",
                            self.conn_id, self.peer, self.heartbeat)
                self.transport.abort()
                return
        if not self._wrote:
            self.write(encode_heartbeat())
        self._wrote = False
        self._wheel.arm(self, self.heartbeat / 2)

    # ---------------------------------------------------------- node / shards
    def on_reply(self, ch: Channel, ok: bool, result: Any, on_ok, class_id: int, method_id: int) -> None:
        if self.state != RUNNING or ch.state != OPEN:
            return
        try:
            try:
                # on_ok may chain another request (which blocks the backlog again): only drain
                # the backlog when it did not.
                ch.backlog.busy = False
                if ok:
                    on_ok(result if isinstance(result, dict) else {})
                else:
                    ch.reply_error(result, class_id, method_id)
                if not ch.backlog.busy:
                    ch.reply_done()
            except AMQPChannelError as exc:
                if exc.code in CONNECTION_LEVEL_CODES:
                    raise AMQPConnectionError(exc.code, exc.text, exc.class_id, exc.method_id) from None
                ch.fail(exc)
            if self._read_pause:
                self._check_backlog()
            if self._close_requested and not self._channels_busy():
                self._finish_client_close()
        except AMQPConnectionError as exc:
            self.fail(exc.code, exc.text, exc.class_id, exc.method_id)
        except Exception as exc:
            self.internal_error(exc)

    # Shards name a channel by its key (Channel.key: number + 65536 * generation); an item for an
    # earlier opening of the same number finds a channel with another key and is dropped.
    def on_deliver(self, shard: int, item: list) -> None:
        key = item[2]
        ch = self.channels.get(key & 0xFFFF)
        if ch is not None and ch.key == key:
            ch.deliver(shard, item)

    def on_deliver_run(self, shard: int, items: list) -> None:
        """Consecutive DELIVER items of one batch for the same channel and consumer (worker._on_shard)."""
        key = items[0][2]
        ch = self.channels.get(key & 0xFFFF)
        if ch is not None and ch.key == key:
            ch.deliver_run(shard, items)

    def on_confirm(self, channel: int, seqs: list, ok: bool) -> None:
        ch = self.channels.get(channel & 0xFFFF)
        if ch is not None and ch.key == channel:
            ch.on_confirm(seqs, ok)

    @property
    def cancel_notify(self) -> bool:
        """Whether the client announced consumer_cancel_notify: RabbitMQ sends basic.cancel only then."""
        caps = self.client_properties.get("capabilities")
        return isinstance(caps, dict) and bool(caps.get("consumer_cancel_notify"))

    def on_cancel_notify(self, channel: int, tag: str) -> None:
        ch = self.channels.get(channel & 0xFFFF)
        if ch is not None and ch.key == channel:
            ch.cancel_notify(tag)

    def on_return(self, channel: int, item: list) -> None:
        ch = self.channels.get(channel & 0xFFFF)
        if ch is not None and ch.key == channel:
            ch.on_return(item)

    def on_close_channel(self, channel: int, code: int, text: str) -> None:
        ch = self.channels.get(channel & 0xFFFF)
        if ch is None or ch.key != channel or self.state != RUNNING:
            return
        if code in CONNECTION_LEVEL_CODES:
            self.fail(code, text)
        else:
            ch.fail(AMQPChannelError(code, text))

    def shard_lost(self, shard: int) -> None:
        """A shard died: settle what this connection had on it; the connection stays open."""
        if self.state != RUNNING:
            return
        # Credit held back or taken back for that shard's consumers was for the dead incarnation: its
        # restarted consumers (a CONSUME still waiting is sent again) start with a whole window there.
        for held in (self._credit, self._taken):
            if held:
                for key in [k for k in held if k[0] == shard]:
                    del held[key]
        if self._taken is not None and not self._taken:
            self._taken = None
        try:
            connection_lost_shard(self, shard)
        except AMQPConnectionError as exc:
            self.fail(exc.code, exc.text, exc.class_id, exc.method_id)
        except Exception as exc:
            self.internal_error(exc)

    # -------------------------------------------------------------- closing
    def fail(self, code: int, text: str, class_id: int = 0, method_id: int = 0) -> None:
        """Connection error: connection.close, then only close-ok matters; socket closed after it or 2 s."""
        if self.state in (CLOSING, CLOSED_STATE):
            return
        if code != CONNECTION_FORCED:
            log.warning("connection %s (%s): closing with %d %s", self.conn_id, self.peer, code, text)
        self.write(encode_method(0, C.Connection.Close(code, reply_text(code, text), class_id, method_id)))
        self.state = CLOSING
        self.parser.connection_closing()  # nothing on a channel is assembled any more
        self._release()
        self._wheel.disarm(self)
        self._close_timer = self.worker.loop.call_later(CLOSE_TIMEOUT, self._close_transport)

    def internal_error(self, exc: BaseException) -> None:
        log.error("connection %s (%s): internal error", self.conn_id, self.peer, exc_info=exc)
        if self.state in (CLOSING, CLOSED_STATE):
            self._close_transport()
            return
        try:
            self.fail(INTERNAL_ERROR, f"internal error: {exc!r}")
        except Exception:
            self._close_transport()

    def _close_transport(self) -> None:
        self._close_timer = None
        self._close_after_flush = True
        self._mark_dirty()

    def _release(self) -> None:
        """Shards forget this connection's consumers/unacked; the node drops its exclusive queues."""
        if self._released:
            return
        self._released = True
        worker = self.worker
        shards: set[int] = set()
        for ch in self.channels.values():
            shards |= ch.shards
            ch.state = CLOSED
            ch.backlog.clear()
            # The backlog's handler is the channel's bound method: a cycle that would keep the
            # channel and this connection (transport, parser, timers: ~20 objects) for a full
            # collection, which an idle frontend never runs. Reference counting frees them now.
            ch.backlog.handler = _drop_event
        shards |= self.confirm_shards
        for shard in shards:
            worker.shard_put(shard, [contract.CONNECTION_CLOSED, self.conn_id])
        self.channels.clear()
        self._confirm_channels = _NO_REASONS
        if self.had_exclusive:
            # The node deletes this connection's exclusive queues: at once, so a client that
            # reconnects and declares the same name does not find it still locked.
            worker.node_request("connection.closed", {"owner": [worker.index, self.conn_id],
                                                      "exclusive": True}, None)
        elif self.registered:
            # Only uncounted ("exclusive": False spares the node its walk over every queue). Sent at
            # once, never batched for later: a client that closes one connection and opens another
            # must find the slot free under a max-connections limit set meanwhile (a 20 ms batch of
            # closes made tests/test_feature_policies.py's limit test refuse a connection).
            worker.node_request("connection.closed", {"owner": [worker.index, self.conn_id],
                                                      "exclusive": False}, None)
