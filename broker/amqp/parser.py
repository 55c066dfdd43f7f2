"""Sans-IO AMQP 0-9-1 frame parser: bytes in, events out (broker/amqp/events.py).

The per-message methods (basic.publish, basic.deliver, basic.ack/nack/reject) and the content
frames are parsed by hand with precompiled structs, queue.bind, queue.unbind and queue.delete by
broker/amqp/bind_methods.py (into the pamqp objects pamqp would make); every other method is
decoded by pamqp.
Content is assembled per channel, so a whole message comes out as one Publish / Deliver /
ContentMethod event.

Errors follow the spec and RabbitMQ's rabbit_reader / rabbit_command_assembler:
  501 FRAME_ERROR       frame over frame_max, bad frame-end octet, unknown frame type, a frame too
                        short for its type, a heartbeat with a payload or on a non-zero channel,
                        body bytes beyond the declared body size
  502 SYNTAX_ERROR      method arguments that do not decode (truncated, trailing bytes, bad UTF-8)
  504 CHANNEL_ERROR     a content-bearing method on channel 0
  505 UNEXPECTED_FRAME  header/body without a content method before it, a method mid-content,
                        a content header of another class or with a non-zero weight
  540 NOT_IMPLEMENTED   unknown class/method id
  406 (channel)         declared body size over max_message_size, or unfinished content of the
                        connection over max_message_size in total; that message's frames are skipped
  505 UNEXPECTED_FRAME  (channel_gate) any frame on a non-zero channel before connection.open: it is
                        refused from its 7-byte header, nothing of it is buffered (as RabbitMQ)
  504 CHANNEL_ERROR     (channel_gate) a content-bearing method on a channel that is not open
A channel the server closes (the parser's own 406, or `channel_closing()` from the connection)
keeps no content state: every frame on it is ignored until the client's channel.close-ok (or a
crossing channel.close), as RabbitMQ does.
A ConnectionProtocolError is always the last event; the parser ignores all input after it.
The parser never raises: an unforeseen failure is reported as 541 INTERNAL_ERROR.

Publish runs (publish_runs=True, the broker's connections): consecutive Publish events of one channel
that differ only in their bodies come out as one PublishRun holding the bodies in order. After a
message assembled in the fast path (method, header and one body frame in one read), the messages that
follow at once, complete in the same read, whose frames are byte for byte that message's but for the
body size and body (so they pass the same checks; nothing is decoded again) join it. Expanding every
PublishRun into its Publish events gives exactly the events of a parser without runs. Looking for a
run that is not there costs a third of a publish's parse, so a connection whose publishes keep
missing is not probed for a while (_PROBE_MISSES, _PROBE_WAIT): which events come out as runs then
changes, never the events they expand to.

Memory: input is only buffered up to the frame being waited for, whose size is checked against
frame_max from its 7-byte header; a body is accumulated from its frames, never preallocated from
the declared size; the bodies being accumulated on all channels of a connection together never
exceed max_message_size, and none is accumulated before connection.open.
"""

from __future__ import annotations

import struct

from pamqp import commands

from broker.amqp import pamqp_types  # noqa: F401  (pamqp's amqp_type without a string per call)
from broker.amqp.bind_methods import DECODERS as _DIRECT
from broker.amqp.constants import (
    CHANNEL_ERROR,
    DEFAULT_FRAME_MAX,
    DEFAULT_MAX_MESSAGE_SIZE,
    FRAME_ERROR,
    INTERNAL_ERROR,
    NOT_IMPLEMENTED,
    PRECONDITION_FAILED,
    PROTOCOL_HEADER,
    PROTOCOL_HEADER_0_9,
    SYNTAX_ERROR,
    UNEXPECTED_FRAME,
)
from broker.amqp.events import (
    Ack,
    BadProtocolHeader,
    ChannelProtocolError,
    ConnectionProtocolError,
    ContentMethod,
    Deliver,
    Heartbeat,
    MethodFrame,
    Nack,
    ProtocolHeaderReceived,
    Publish,
    PublishRun,
    Reject,
)

_FRAME_HDR = struct.Struct(">BHI")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")
_CONTENT_HDR = struct.Struct(">HHQ")
_HEADER_FRAME = struct.Struct(">BHIHHQ")  # frame header + class, weight, body size
_TAG_BITS = struct.Struct(">QB")
_TAG_BIT_LEN = struct.Struct(">QBB")

# class << 16 | method
_PUBLISH = 0x003C0028
_DELIVER = 0x003C003C
_ACK = 0x003C0050
_NACK = 0x003C0078
_REJECT = 0x003C005A
_CONTENT_METHODS = frozenset({0x003C0028, 0x003C0032, 0x003C003C, 0x003C0047})
_CONNECTION_OPEN = 0x000A0028
_CHANNEL_OPEN = 0x0014000A
_CHANNEL_CLOSE = 0x00140028
_CHANNEL_CLOSE_OK = 0x00140029

# Publish-run probe back-off (per connection, see _probe_missed): after _PROBE_MISSES publishes in a
# row that could have started a run but did not (a new routing key each time, two keys taking turns,
# acks between publishes), no publish is probed for the rest of that read and for the next
# _PROBE_WAIT bytes of input; each back-off in a row doubles that, up to _PROBE_WAIT << _PROBE_WAIT_SHIFTS
# bytes; a run found ends it. A failed probe costs ~7,000 instructions, a third of the publish's parse;
# while backed off a publish pays one local test (scripts/parser-instructions.py).
_PROBE_MISSES = 4
_PROBE_WAIT = 16 << 10
_PROBE_WAIT_SHIFTS = 4

# content state stages
_HEADER = 0
_BODY = 1
_SKIP = 2

_new_tuple = tuple.__new__


class _Content:
    """A channel's message in progress."""

    __slots__ = ("stage", "kind", "info", "method_id", "props", "remaining", "parts")

    def remaining_total(self) -> int:
        """Bytes held in parts (what the parser counts as unfinished for this message)."""
        return sum(len(p) for p in self.parts)

    def __init__(self, kind: type, info: tuple, method_id: int) -> None:
        self.stage = _HEADER
        self.kind = kind  # the event class to emit: Publish, Deliver or ContentMethod
        self.info = info  # event fields between channel and props_raw
        self.method_id = method_id
        self.props = b""
        self.remaining = 0
        self.parts: list = []


def _field_sizes(cls: type) -> tuple:
    """Per argument: fixed byte size, 0 for a bit, -1 shortstr, -4 longstr/table."""
    size = {"octet": 1, "short": 2, "long": 4, "longlong": 8, "timestamp": 8, "bit": 0,
            "shortstr": -1, "longstr": -4, "table": -4}
    return tuple(size[getattr(cls, "_" + name)] for name in cls.__slots__)


_METHOD_FIELDS = {index: (cls, _field_sizes(cls)) for index, cls in commands.INDEX_MAPPING.items()}


def _args_fit(fields: tuple, data: bytes) -> bool:
    """True when the arguments occupy data exactly (pamqp silently truncates short strings)."""
    pos, n, bits = 0, len(data), 0
    for size in fields:
        if size == 0:
            if bits % 8 == 0:
                pos += 1
            bits += 1
            continue
        bits = 0
        if size > 0:
            pos += size
        elif pos >= n:
            return False
        elif size == -1:
            pos += 1 + data[pos]
        else:
            if pos + 4 > n:
                return False
            pos += 4 + _U32.unpack_from(data, pos)[0]
        if pos > n:
            return False
    return pos == n


class FrameParser:
    """Feed bytes as they arrive; get back the events they complete.

    role="server" expects the client's protocol header first; role="client" (the perf tool)
    parses the server's frames from the first byte. frame_max may be changed after tune.
    channel_gate=True (the broker's connections) tracks the connection and channel states as
    described in the module docstring; without it any channel may carry content (codec tests).
    """

    def __init__(
        self,
        role: str = "server",
        frame_max: int = DEFAULT_FRAME_MAX,
        max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
        channel_gate: bool = False,
        publish_runs: bool = False,
    ) -> None:
        if role not in ("server", "client"):
            raise ValueError(f"role must be 'server' or 'client', not {role!r}")
        self.role = role
        self.frame_max = frame_max
        self.max_message_size = max_message_size
        self.publish_runs = publish_runs
        self._expect_header = True  # the client role only checks for a refusal header
        self._dead = False
        self._pending: list[bytes] = []
        self._pending_len = 0
        self._need = 8 if role == "server" else 1
        self._content: dict[int, _Content] = {}
        # Server role: channels the client opened (by its channel.open), channels we are closing (only
        # close/close-ok count on them), whether connection.open was seen, bytes of unfinished bodies.
        self._gated = channel_gate and role == "server"
        self._opened = not self._gated
        self._open_channels: set[int] = set()
        self._closing: set[int] = set()
        self._unfinished = 0
        self._ignore_channels = False
        self._probe_misses = 0  # publishes in a row a run probe found alone (see _PROBE_MISSES)
        self._probe_wait = 0  # bytes of input still to read without run probes

    def channel_closing(self, channel: int) -> None:
        """The server sent channel.close: drop the channel's content, ignore its frames until close-ok."""
        st = self._content.pop(channel, None)
        if st is not None and st.parts:
            self._unfinished -= sum(len(p) for p in st.parts)
        self._closing.add(channel)

    def connection_closing(self) -> None:
        """The server sent connection.close: frames on channels are skipped from now on, unbuffered."""
        self._content.clear()
        self._unfinished = 0
        self._open_channels.clear()
        self._opened = False
        self._gated = False  # not an error any more, just ignored (see _frames)
        self._ignore_channels = True

    @property
    def dead(self) -> bool:
        """True after a ConnectionProtocolError or BadProtocolHeader: all input is ignored."""
        return self._dead

    def feed(self, data: bytes) -> list:
        if self._dead or not data:
            return []
        if self._pending:
            self._pending.append(bytes(data))
            self._pending_len += len(data)
            if self._pending_len < self._need:
                return []
            data = b"".join(self._pending)
            self._pending = []
            self._pending_len = 0
        elif data.__class__ is not bytes:
            data = bytes(data)
        events: list = []
        try:
            pos = 0
            if self._expect_header:
                pos = self._protocol_header(data, events)
                if pos < 0:
                    return events
            self._frames(data, pos, events)
        except Exception as exc:  # a codec bug must not become a traceback in the connection
            self._fail(events, INTERNAL_ERROR, f"internal codec error: {exc!r}", 0, 0)
        return events

    # ------------------------------------------------------------------ internals

    def _wait(self, data: bytes, pos: int, need: int) -> None:
        rest = data[pos:] if pos else data
        self._pending = [rest]
        self._pending_len = len(rest)
        self._need = need

    def _fail(self, events: list, code: int, text: str, class_id: int, method_id: int) -> None:
        events.append(ConnectionProtocolError(code, text, class_id, method_id))
        self._dead = True
        self._pending = []
        self._pending_len = 0
        self._content.clear()
        self._unfinished = 0

    def _protocol_header(self, data: bytes, events: list) -> int:
        """Offset after the header, or -1 when waiting for more or finished."""
        if self.role == "client":
            # a server refusing our version answers with its own header instead of frames
            if data[:1] != b"A":
                self._expect_header = False
                return 0
        if len(data) < 8:
            self._wait(data, 0, 8)
            return -1
        header = data[:8]
        self._expect_header = False
        if self.role == "server" and (header == PROTOCOL_HEADER or header == PROTOCOL_HEADER_0_9):
            events.append(ProtocolHeaderReceived())
            return 8
        events.append(BadProtocolHeader(header))
        self._dead = True
        return -1

    def _frames(self, data: bytes, pos: int, events: list) -> None:
        end = len(data)
        limit = self.frame_max or 0xFFFFFFFF
        max_size = self.max_message_size
        content = self._content
        emit = events.append
        unpack_hdr = _FRAME_HDR.unpack_from
        probe = self.publish_runs  # look for publish runs in this read
        if probe and self._probe_wait > 0:
            self._probe_wait -= end - pos
            probe = False
        while True:
            if end - pos < 7:
                if pos < end:
                    self._wait(data, pos, 7)
                return
            ftype, ch, size = unpack_hdr(data, pos)
            if size > limit:
                # RabbitMQ allows frame_max of payload (clients are often off by the 8 overhead bytes)
                return self._fail(events, FRAME_ERROR,
                                  f"frame size {size} is larger than negotiated frame_max {limit}", 0, 0)
            if ch and not self._opened and self._gated:
                # Refused from the header: an unauthenticated client gets no buffer for content.
                return self._fail(events, UNEXPECTED_FRAME,
                                  f"frame type {ftype} on channel {ch} before connection.open", 0, 0)
            start = pos + 7
            fend = start + size
            if fend >= end:
                self._wait(data, pos, size + 8)
                return
            if data[fend] != 0xCE:
                return self._fail(events, FRAME_ERROR,
                                  f"invalid frame end marker 0x{data[fend]:02x} on channel {ch}", 0, 0)
            pos = fend + 1
            if ch and (self._ignore_channels or ch in self._closing):
                # Only a close-ok (or a crossing close) counts on a channel we are closing.
                if self._ignore_channels or ftype != 1 or size < 4:
                    continue
                index = _U32.unpack_from(data, start)[0]
                if index == _CHANNEL_CLOSE_OK:
                    self._closing.discard(ch)
                    self._open_channels.discard(ch)
                elif index != _CHANNEL_CLOSE:
                    continue

            if ftype == 1:
                if size < 4:
                    return self._fail(events, FRAME_ERROR, f"method frame of {size} bytes on channel {ch}", 0, 0)
                index = _U32.unpack_from(data, start)[0]
                if ch in content:
                    return self._unexpected(events, content[ch], f"got method {index >> 16}.{index & 0xFFFF}")
                if index == _PUBLISH:
                    # ticket(2) exchange(shortstr) routing-key(shortstr) bits(1)
                    p = start + 7
                    if p > fend:
                        return self._syntax(events, index)
                    q = p + data[p - 1]
                    r = q + 1
                    b = r + (data[q] if q < fend else 0)
                    if b + 1 != fend:
                        return self._syntax(events, index)
                    try:
                        info = (data[p:q].decode(), data[r:b].decode(), data[b] & 1 == 1, data[b] & 2 == 2)
                    except UnicodeDecodeError:
                        return self._syntax(events, index)
                    kind = Publish
                elif index == _ACK:
                    if size != 13:
                        return self._syntax(events, index)
                    tag, bits = _TAG_BITS.unpack_from(data, start + 4)
                    emit(_new_tuple(Ack, (ch, tag, bits & 1 == 1)))
                    continue
                elif index == _NACK:
                    if size != 13:
                        return self._syntax(events, index)
                    tag, bits = _TAG_BITS.unpack_from(data, start + 4)
                    emit(_new_tuple(Nack, (ch, tag, bits & 1 == 1, bits & 2 == 2)))
                    continue
                elif index == _REJECT:
                    if size != 13:
                        return self._syntax(events, index)
                    tag, bits = _TAG_BITS.unpack_from(data, start + 4)
                    emit(_new_tuple(Reject, (ch, tag, bits & 1 == 1)))
                    continue
                elif index == _DELIVER:
                    # consumer-tag(shortstr) delivery-tag(8) redelivered(1) exchange rk
                    p = start + 5
                    if p > fend:
                        return self._syntax(events, index)
                    q = p + data[p - 1]
                    if q + 10 > fend:
                        return self._syntax(events, index)
                    tag, red, exlen = _TAG_BIT_LEN.unpack_from(data, q)
                    e = q + 10
                    r = e + exlen
                    b = r + 1 + (data[r] if r < fend else 0)
                    if b != fend:
                        return self._syntax(events, index)
                    try:
                        info = (data[p:q].decode(), tag, red & 1 == 1, data[e:r].decode(), data[r + 1 : b].decode())
                    except UnicodeDecodeError:
                        return self._syntax(events, index)
                    kind = Deliver
                else:
                    direct = _DIRECT.get(index)
                    if direct is not None:  # queue.bind / unbind / delete: no pamqp unmarshal (bind_methods.py)
                        method = direct(data, start + 4, fend)
                        if method is None:
                            return self._syntax(events, index)
                        emit(_new_tuple(MethodFrame, (ch, method)))
                        continue
                    entry = _METHOD_FIELDS.get(index)
                    if entry is None:
                        return self._fail(events, NOT_IMPLEMENTED,
                                          f"unknown method class {index >> 16} method {index & 0xFFFF}",
                                          index >> 16, index & 0xFFFF)
                    cls, fields = entry
                    args = data[start + 4 : fend]
                    if not _args_fit(fields, args):
                        return self._syntax(events, index)
                    method = cls.__new__(cls)  # skips __init__'s defaults/validation; unmarshal sets all
                    try:
                        method.unmarshal(args)
                    except Exception:
                        return self._syntax(events, index)
                    if index not in _CONTENT_METHODS:
                        emit(MethodFrame(ch, method))
                        if self._gated:
                            if index == _CHANNEL_OPEN:
                                self._open_channels.add(ch)
                            elif index == _CHANNEL_CLOSE:
                                self._open_channels.discard(ch)
                            elif index == _CONNECTION_OPEN and not ch:
                                self._opened = True
                        continue
                    info = (method,)
                    kind = ContentMethod
                # a content-bearing method: the message follows in a header and body frames
                if not ch:
                    return self._fail(events, CHANNEL_ERROR, "content-bearing method on channel 0",
                                      index >> 16, index & 0xFFFF)
                if self._gated and ch not in self._open_channels:
                    return self._fail(events, CHANNEL_ERROR, "expected 'channel.open'", index >> 16, index & 0xFFFF)
                # Fast path: a valid header and one body frame for this channel follow in full. Any
                # other shape goes frame by frame below, which yields the same events or error. (Guard
                # clauses, each with its own fallback: a condition that jumps past a long block costs an
                # EXTENDED_ARG each time it runs, taken or not.)
                if pos + 19 > end:
                    content[ch] = _Content(kind, info, index & 0xFFFF)
                    continue
                htype, hch, hsize, class_id, weight, body_size = _HEADER_FRAME.unpack_from(data, pos)
                hend = pos + 7 + hsize
                if not (htype == 2 and hch == ch and 14 <= hsize <= limit and hend < end and data[hend] == 0xCE
                        and class_id == 60 and not weight and body_size <= max_size):
                    content[ch] = _Content(kind, info, index & 0xFFFF)
                    continue
                b = hend + 1
                if not body_size:
                    emit(_new_tuple(kind, (ch, *info, data[pos + 19 : hend], b"")))
                    pos = b
                    continue
                if b + 7 > end:
                    content[ch] = _Content(kind, info, index & 0xFFFF)
                    continue
                btype, bch, bsize = unpack_hdr(data, b)
                bend = b + 7 + bsize
                if not (btype == 3 and bch == ch and bsize == body_size and bsize <= limit and bend < end
                        and data[bend] == 0xCE):
                    content[ch] = _Content(kind, info, index & 0xFFFF)
                    continue
                # A publish that may start a run (see _run), unless this connection's publishes formed
                # none lately (_probe_missed).
                if probe and kind is Publish and end - bend > 40:
                    if nxt := self._run(data, pos, start, fend, b, bend, ch, info, emit):
                        pos = nxt
                        continue
                    probe = self._probe_wait <= 0
                emit(_new_tuple(kind, (ch, *info, data[pos + 19 : hend], data[b + 7 : bend])))
                pos = bend + 1

            elif ftype == 3:
                st = content.get(ch)
                if st is None or st.stage == _HEADER:
                    return self._unexpected(events, st, "got content body frame")
                if size > st.remaining:
                    return self._fail(events, FRAME_ERROR, "content body frame exceeds remaining content size",
                                      60, st.method_id)
                if st.stage == _SKIP:
                    st.remaining -= size
                    if not st.remaining:
                        del content[ch]
                elif size == st.remaining and not st.parts:
                    del content[ch]
                    emit(self._message(ch, st, data[start:fend]))
                elif size == st.remaining:
                    del content[ch]
                    self._unfinished -= st.remaining_total()
                    st.parts.append(data[start:fend])
                    emit(self._message(ch, st, b"".join(st.parts)))
                elif self._gated and self._unfinished + size > max_size:
                    # Bodies being assembled on all channels together: one connection holds at most
                    # max_message_size of them, however many channels it spreads a bomb over.
                    emit(ChannelProtocolError(
                        ch, PRECONDITION_FAILED,
                        f"unfinished messages of this connection exceed the configured max size {max_size}",
                        60, st.method_id))
                    self.channel_closing(ch)
                else:
                    st.parts.append(data[start:fend])
                    st.remaining -= size
                    self._unfinished += size

            elif ftype == 2:
                st = content.get(ch)
                if st is None or st.stage != _HEADER:
                    return self._unexpected(events, st, "got content header frame")
                if size < 14:
                    return self._fail(events, FRAME_ERROR, f"content header frame of {size} bytes", 60, st.method_id)
                class_id, weight, body_size = _CONTENT_HDR.unpack_from(data, start)
                if class_id != 60 or weight:
                    return self._fail(events, UNEXPECTED_FRAME,
                                      f"expected content header for class 60, got one for class {class_id} "
                                      f"(weight {weight}) instead", 60, st.method_id)
                if body_size > max_size:
                    emit(ChannelProtocolError(
                        ch, PRECONDITION_FAILED,
                        f"message size {body_size} is larger than configured max size {max_size}",
                        60, st.method_id))
                    if self._gated:
                        # The channel is closed by this error: its body frames and anything else the
                        # client sends on it before close-ok are ignored, close-ok is not a 505.
                        self.channel_closing(ch)
                    else:
                        st.stage = _SKIP
                        st.remaining = body_size
                elif not body_size:
                    del content[ch]
                    st.props = data[start + 12 : fend]
                    emit(self._message(ch, st, b""))
                else:
                    st.stage = _BODY
                    st.props = data[start + 12 : fend]
                    st.remaining = body_size

            elif ftype == 8:
                if ch or size:
                    return self._fail(events, FRAME_ERROR,
                                      f"heartbeat frame on channel {ch} with {size} payload bytes", 0, 0)
                emit(Heartbeat(0))
            else:
                return self._fail(events, FRAME_ERROR, f"unknown frame type {ftype} on channel {ch}", 0, 0)

    def _run(self, data: bytes, pos: int, start: int, fend: int, b: int, bend: int, ch: int, info: tuple,
             emit) -> int:
        """Emit the publish whose header frame is at pos (its method frame payload start..fend, body frame
        b..bend) as a PublishRun with the publishes that follow it at once on its channel, complete in
        this read, with frames byte for byte its own but for the body size and body (so every check
        the caller made holds for them too); returns the offset after the run, or 0 (nothing emitted)
        when the next publish does not join it. Out of the caller's loop: inline, its code made
        every jump of the fast path long (EXTENDED_ARG, ~1,100 instructions per publish).

        Before any slice, two byte compares: the next frame's size has this method frame's low byte and
        its routing key's last byte matches."""
        end = len(data)
        nxt = bend + 1
        mlen = fend + 8 - start
        if not (data[bend + 7] == data[start - 1] and end - nxt > mlen + 30 and data[nxt + mlen - 3] == data[fend - 2]
                and data.startswith(method := data[start - 7 : fend + 1], nxt)):
            self._probe_missed()
            return 0
        limit = self.frame_max or 0xFFFFFFFF
        body_max = limit if limit < self.max_message_size else self.max_message_size
        head = data[pos : pos + 11]  # type, channel, size, class, weight
        tail = data[pos + 19 : b]  # properties and frame end
        bch3 = data[b : b + 3]  # body frame type and channel
        hskip = mlen + 19
        bskip = hskip + len(tail)
        bodies = [data[b + 7 : bend]]
        pos = nxt
        while True:
            if not (data.startswith(method, pos) and data.startswith(head, pos + mlen)
                    and data.startswith(tail, pos + hskip)):
                break
            size = _U64.unpack_from(data, pos + hskip - 8)[0]
            b = pos + bskip
            bend = b + 7 + size
            if not (0 < size <= body_max and bend < end and data.startswith(bch3, b)
                    and _U32.unpack_from(data, b + 3)[0] == size and data[bend] == 0xCE):
                break
            bodies.append(data[b + 7 : bend])
            pos = bend + 1
        if len(bodies) == 1:  # same method frame, other properties
            self._probe_missed()
            return 0
        self._probe_misses = 0
        emit(_new_tuple(PublishRun, (ch, *info, tail[:-1], bodies)))
        return pos

    def _probe_missed(self) -> None:
        """A run probe found a publish alone: after _PROBE_MISSES in a row, back off (see _PROBE_WAIT).

        Per connection, not per channel: a run is consecutive frames of one channel, so a connection
        whose channels interleave their publishes forms none either, and one counter costs least."""
        misses = self._probe_misses = self._probe_misses + 1
        if misses >= _PROBE_MISSES:
            self._probe_wait = _PROBE_WAIT << min(misses - _PROBE_MISSES, _PROBE_WAIT_SHIFTS)

    @staticmethod
    def _message(ch: int, st: _Content, body: bytes) -> tuple:
        return _new_tuple(st.kind, (ch, *st.info, st.props, body))

    def _syntax(self, events: list, index: int) -> None:
        self._fail(events, SYNTAX_ERROR, f"cannot decode arguments of method {index >> 16}.{index & 0xFFFF}",
                   index >> 16, index & 0xFFFF)

    def _unexpected(self, events: list, st: _Content | None, got: str) -> None:
        if st is None:
            expected, method_id = "expected method frame", 0
        elif st.stage == _HEADER:
            expected, method_id = "expected content header for class 60", st.method_id
        else:
            expected, method_id = "expected content body", st.method_id
        self._fail(events, UNEXPECTED_FRAME, f"{expected}, {got} instead", 60 if method_id else 0, method_id)
