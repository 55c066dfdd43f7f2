"""A fake AMQP broker on a random loopback port, for testing the perf tool and measuring its ceiling.

Two modes:

* ``relay`` (threads, one process): a tiny in-memory broker. Publishes on the default exchange go
  to the queue named by the routing key, on other exchanges through the bindings; each queue hands
  messages round-robin to its consumers (buffering while it has none). Confirms are acked. Used
  by the tests: totals and --verify are meaningful.
* ``flood`` (one forked process per connection): swallows publishes (acking confirms with one
  multiple-ack per read) and, after basic.consume, floods pre-encoded deliveries stamped with the
  current CLOCK_MONOTONIC time as fast as the socket takes them. Used by ``sink-ceiling``: the
  rates the tool reaches here are the most it can drive, whatever the broker.

The handshake and control methods are decoded with pamqp and answered with the project's encoder.
"""

from __future__ import annotations

import multiprocessing
import os
import selectors
import signal
import socket
import struct
import threading
import time
from collections import deque
from typing import Any

from pamqp import commands
from pamqp import frame as pamqp_frame

from broker.amqp import encoder
from broker.amqp.constants import PROTOCOL_HEADER
from broker.amqp.properties import EMPTY_PROPS

_HEAD = struct.Struct(">BHI")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")
_BODY_SIZE = struct.Struct(">Q")
_PUBLISH_ID = 0x003C0028  # class 60, method 40
FRAME_MAX = 131072


class _Closed(Exception):
    pass


class SinkConnection:
    """Server side of one connection: framing, handshake and control replies; content is the mode's."""

    def __init__(self, sock: socket.socket, server: SinkServer) -> None:
        self.sock = sock
        self.server = server
        self.buf = bytearray()
        self.send_lock = threading.Lock()
        self.confirm = False
        self.published = 0
        # relay content assembly: [queue-or-exchange, routing_key, props_raw, body_size, body_parts]
        self.content: list[Any] | None = None
        self.consumer_tags: dict[str, str] = {}  # tag -> queue
        self.delivery_tag = 0

    def send(self, data: bytes) -> None:
        with self.send_lock:
            self.sock.sendall(data)

    def method(self, channel: int, m: Any) -> None:
        self.send(encoder.encode_method(channel, m))

    def recv_more(self) -> None:
        data = self.sock.recv(1 << 20)
        if not data:
            raise _Closed
        self.buf += data

    def frames(self) -> Any:
        """Yield (type, channel, start, end) of each complete buffered frame's payload, then compact."""
        buf = self.buf
        pos = 0
        n = len(buf)
        try:
            while n - pos >= 7:
                ftype, ch, size = _HEAD.unpack_from(buf, pos)
                end = pos + 8 + size
                if end > n:
                    break
                yield ftype, ch, pos + 7, end - 1
                pos = end
        finally:
            del buf[:pos]

    def handshake(self) -> None:
        while len(self.buf) < 8:
            self.recv_more()
        if bytes(self.buf[:8]) != PROTOCOL_HEADER:
            self.sock.sendall(PROTOCOL_HEADER)
            raise _Closed
        del self.buf[:8]
        self.method(0, commands.Connection.Start(
            server_properties={"product": "shardmq-perf-sink"}, mechanisms="PLAIN", locales="en_US"))

    def control(self, channel: int, start: int, end: int) -> None:
        """Answer one non-publish method frame (its payload is buf[start:end])."""
        m = pamqp_frame.unmarshal(bytes(self.buf[start - 7 : end + 1]))[2]
        C = commands
        if isinstance(m, C.Connection.StartOk):
            self.method(0, C.Connection.Tune(channel_max=2047, frame_max=FRAME_MAX, heartbeat=0))
        elif isinstance(m, C.Connection.Open):
            self.method(0, C.Connection.OpenOk())
        elif isinstance(m, C.Connection.Close):
            self.method(0, C.Connection.CloseOk())
            raise _Closed
        elif isinstance(m, C.Channel.Open):
            self.method(channel, C.Channel.OpenOk())
        elif isinstance(m, C.Channel.Close):
            self.method(channel, C.Channel.CloseOk())
        elif isinstance(m, C.Queue.Declare):
            name = m.queue or f"amq.gen-{os.getpid()}-{time.monotonic_ns()}"
            if m.passive and not self.server.queue_exists(name):
                self.method(channel, C.Channel.Close(reply_code=404, reply_text=f"NOT_FOUND - no queue '{name}'",
                                                     class_id=50, method_id=10))
                return
            self.server.declare_queue(name)
            self.method(channel, C.Queue.DeclareOk(queue=name, message_count=0, consumer_count=0))
        elif isinstance(m, C.Queue.Delete):
            self.method(channel, C.Queue.DeleteOk(message_count=self.server.delete_queue(m.queue)))
        elif isinstance(m, C.Queue.Bind):
            self.server.bind(m.exchange, m.routing_key, m.queue, True)
            self.method(channel, C.Queue.BindOk())
        elif isinstance(m, C.Queue.Unbind):
            self.server.bind(m.exchange, m.routing_key, m.queue, False)
            self.method(channel, C.Queue.UnbindOk())
        elif isinstance(m, C.Exchange.Declare):
            self.method(channel, C.Exchange.DeclareOk())
        elif isinstance(m, C.Exchange.Delete):
            self.method(channel, C.Exchange.DeleteOk())
        elif isinstance(m, C.Basic.Qos):
            self.method(channel, C.Basic.QosOk())
        elif isinstance(m, C.Confirm.Select):
            self.confirm = True
            self.method(channel, C.Confirm.SelectOk())
        elif isinstance(m, C.Basic.Consume):
            tag = m.consumer_tag or f"ctag-{os.getpid()}-{len(self.consumer_tags) + 1}"
            self.consumer_tags[tag] = m.queue
            self.method(channel, C.Basic.ConsumeOk(consumer_tag=tag))
            self.server.add_consumer(self, channel, tag, m.queue, m.no_ack)
        elif isinstance(m, C.Basic.Cancel):
            self.method(channel, C.Basic.CancelOk(consumer_tag=m.consumer_tag))
        # basic.ack/nack/reject and anything else: swallowed

    # -- relay mode ----------------------------------------------------------------------------

    def serve_relay(self) -> None:
        self.handshake()
        while True:
            self.recv_more()
            acked_before = self.published
            buf = self.buf
            for ftype, ch, start, end in self.frames():
                if ftype == 1:
                    if _U32.unpack_from(buf, start)[0] == _PUBLISH_ID:
                        ex_len = buf[start + 6]
                        exchange = bytes(buf[start + 7 : start + 7 + ex_len]).decode()
                        rk_at = start + 7 + ex_len
                        rk = bytes(buf[rk_at + 1 : rk_at + 1 + buf[rk_at]]).decode()
                        self.content = [exchange, rk, b"", 0, []]
                        self.published += 1
                    else:
                        self.control(ch, start, end)
                elif ftype == 2 and self.content is not None:
                    self.content[3] = _BODY_SIZE.unpack_from(buf, start + 4)[0]
                    self.content[2] = bytes(buf[start + 12 : end])
                    if self.content[3] == 0:
                        self._route()
                elif ftype == 3 and self.content is not None:
                    self.content[4].append(bytes(buf[start:end]))
                    if sum(map(len, self.content[4])) >= self.content[3]:
                        self._route()
            if self.confirm and self.published > acked_before:
                self.send(encoder.encode_ack(1, self.published, True))

    def _route(self) -> None:
        exchange, rk, props, _, parts = self.content  # type: ignore[misc]
        self.content = None
        self.server.route(exchange, rk, props, b"".join(parts))

    def deliver(self, channel: int, tag: str, exchange: str, rk: str, props: bytes, body: bytes) -> None:
        self.delivery_tag += 1
        self.send(encoder.encode_deliver(channel, tag, self.delivery_tag, False, exchange, rk, props, body,
                                         FRAME_MAX))

    # -- flood mode ----------------------------------------------------------------------------

    def serve_flood(self) -> None:
        self.handshake()
        while True:
            self.recv_more()
            before = self.published
            buf = self.buf
            for ftype, ch, start, end in self.frames():
                if ftype == 1:
                    if _U32.unpack_from(buf, start)[0] == _PUBLISH_ID:
                        self.published += 1
                    else:
                        self.control(ch, start, end)
                        if self.consumer_tags:
                            channel, tag = ch, next(iter(self.consumer_tags))
                            break
            else:
                if self.confirm and self.published > before:
                    self.send(encoder.encode_ack(1, self.published, True))
                continue
            self.flood(channel, tag)
            return

    def flood(self, channel: int, tag: str, batch: int = 2000) -> None:
        """Send deliveries until the peer goes away; read (and drop) whatever it sends meanwhile."""
        size = self.server.flood_size
        body = b"\xab" * size
        one = encoder.encode_deliver(channel, tag, 1, False, "", "flood", EMPTY_PROPS, body, FRAME_MAX)
        tag_off = one.index(b"\x00" * 7 + b"\x01")  # delivery-tag field (value 1)
        body_off = one.rindex(body) if size else -1
        buf = bytearray(one * batch)
        step = len(one)
        tag_offs = [i * step + tag_off for i in range(batch)]
        ts_offs = [i * step + body_off for i in range(batch)] if size >= 8 else []
        pack_into = _U64.pack_into
        sock = self.sock
        sock.setblocking(False)
        sel = selectors.DefaultSelector()
        sel.register(sock, selectors.EVENT_READ | selectors.EVENT_WRITE)
        next_tag = 1
        view = memoryview(buf)
        pos = len(buf)  # nothing pending yet: fill first
        while True:
            if pos >= len(buf):
                for off in tag_offs:
                    pack_into(buf, off, next_tag)
                    next_tag += 1
                now = time.monotonic_ns()
                for off in ts_offs:
                    pack_into(buf, off, now)
                pos = 0
            for _key, ev in sel.select(1.0):
                if ev & selectors.EVENT_READ:
                    try:
                        data = sock.recv(1 << 20)
                    except BlockingIOError:
                        data = b"-"
                    if not data:
                        return
                    if b"\x00\x0a\x00\x32" in data:  # connection.close: stop flooding
                        sock.setblocking(True)
                        self.method(0, commands.Connection.CloseOk())
                        return
                if ev & selectors.EVENT_WRITE:
                    try:
                        pos += sock.send(view[pos:])
                    except BlockingIOError:
                        pass


class SinkServer:
    """The listening socket plus relay-mode state (queues, bindings, consumers)."""

    def __init__(self, mode: str = "relay", host: str = "127.0.0.1", port: int = 0, flood_size: int = 16,
                 drop_every: int = 0, dup_every: int = 0) -> None:
        if mode not in ("relay", "flood"):
            raise ValueError("mode must be 'relay' or 'flood'")
        self.mode = mode
        self.flood_size = flood_size
        # fault injection (relay): lose / deliver twice every Nth routed message, to prove --verify fails
        self.drop_every = drop_every
        self.dup_every = dup_every
        self.routed = 0
        self.lsock = socket.create_server((host, port), backlog=1024)
        self.port = self.lsock.getsockname()[1]
        self.lock = threading.Lock()
        self.queues: dict[str, deque[tuple[str, str, bytes, bytes]]] = {}
        self.consumers: dict[str, list[tuple[SinkConnection, int, str]]] = {}
        self.rr: dict[str, int] = {}
        self.bindings: dict[tuple[str, str], set[str]] = {}

    # relay state; consumers are served under the lock so per-queue order is kept
    def queue_exists(self, name: str) -> bool:
        with self.lock:
            return name in self.queues

    def declare_queue(self, name: str) -> None:
        with self.lock:
            self.queues.setdefault(name, deque())

    def delete_queue(self, name: str) -> int:
        with self.lock:
            q = self.queues.pop(name, None)
            self.consumers.pop(name, None)
            return len(q) if q else 0

    def bind(self, exchange: str, rk: str, queue: str, add: bool) -> None:
        with self.lock:
            s = self.bindings.setdefault((exchange, rk), set())
            (s.add if add else s.discard)(queue)

    def add_consumer(self, conn: SinkConnection, channel: int, tag: str, queue: str, no_ack: bool) -> None:
        if self.mode != "relay":
            return
        with self.lock:
            self.consumers.setdefault(queue, []).append((conn, channel, tag))
            backlog = self.queues.setdefault(queue, deque())
            while backlog:
                self._deliver_locked(queue, *backlog.popleft())

    def route(self, exchange: str, rk: str, props: bytes, body: bytes) -> None:
        with self.lock:
            targets = [rk] if exchange == "" else sorted(self.bindings.get((exchange, rk), ()))
            self.routed += 1
            if self.drop_every and self.routed % self.drop_every == 0:
                return
            if self.dup_every and self.routed % self.dup_every == 0:
                targets = targets * 2
            for q in targets:
                if q not in self.queues:
                    continue
                if self.consumers.get(q):
                    self._deliver_locked(q, exchange, rk, props, body)
                else:
                    self.queues[q].append((exchange, rk, props, body))

    def _deliver_locked(self, queue: str, exchange: str, rk: str, props: bytes, body: bytes) -> None:
        cons = self.consumers[queue]
        i = self.rr.get(queue, 0) % len(cons)
        self.rr[queue] = i + 1
        conn, channel, tag = cons[i]
        try:
            conn.deliver(channel, tag, exchange, rk, props, body)
        except OSError:
            cons.pop(i)

    def remove_connection(self, conn: SinkConnection) -> None:
        with self.lock:
            for q, cons in self.consumers.items():
                self.consumers[q] = [c for c in cons if c[0] is not conn]

    def _serve_one(self, sock: socket.socket) -> None:
        conn = SinkConnection(sock, self)
        try:
            if self.mode == "relay":
                conn.serve_relay()
            else:
                conn.serve_flood()
        except (_Closed, OSError):
            pass
        finally:
            self.remove_connection(conn)
            sock.close()

    def serve_forever(self) -> None:
        if self.mode == "flood":
            signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children reaped by the kernel
        while True:
            sock, _ = self.lsock.accept()
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.mode == "relay":
                threading.Thread(target=self._serve_one, args=(sock,), daemon=True).start()
                continue
            pid = os.fork()
            if pid == 0:  # connection process: flood mode shares no state between connections
                try:
                    self.lsock.close()
                    self._serve_one(sock)
                finally:
                    os._exit(0)
            sock.close()


def _sink_main(mode: str, flood_size: int, faults: dict[str, int], conn: Any) -> None:
    os.setpgid(0, 0)  # own process group, so stop() ends the forked connection processes too
    server = SinkServer(mode, flood_size=flood_size, **faults)
    conn.send(server.port)
    conn.close()
    server.serve_forever()


class SinkProcess:
    """A sink server in its own process (start() -> port; stop() ends it and its children)."""

    def __init__(self, mode: str = "relay", flood_size: int = 16, drop_every: int = 0, dup_every: int = 0) -> None:
        self.mode = mode
        self.flood_size = flood_size
        self.faults = {"drop_every": drop_every, "dup_every": dup_every}
        self.proc: multiprocessing.process.BaseProcess | None = None
        self.port = 0

    @property
    def uri(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}/"

    def start(self) -> SinkProcess:
        ctx = multiprocessing.get_context("fork")
        parent, child = ctx.Pipe()
        self.proc = ctx.Process(target=_sink_main, args=(self.mode, self.flood_size, self.faults, child), daemon=False)
        self.proc.start()
        child.close()
        if not parent.poll(10):
            self.stop()
            raise RuntimeError("sink did not start")
        self.port = parent.recv()
        return self

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.pid:
            try:  # the sink's own forked connection processes are in its process group
                os.killpg(proc.pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass
        proc.terminate()
        proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join()

    def __enter__(self) -> SinkProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
