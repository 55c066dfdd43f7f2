"""``shardmq-perf amqp throughput``: N publisher and M consumer processes over raw sockets.

Body layout (big-endian): bytes 0-8 = CLOCK_MONOTONIC ns at send (when size >= 8), bytes 8-16 =
publisher index << 48 | sequence number (when size >= 16); the rest is zeros. Processes on one host
share CLOCK_MONOTONIC, so receive time minus that stamp is the end-to-end latency. With
``--confirm`` the publishers also time each burst from its send to the confirm that covers it
(``extra.confirm_latency_{min,p50,p95,p99,max}_us`` in run.json: publish -> basic.ack, weighted by
messages; the bench's table shows their median over runs), which is not
the end-to-end latency: that one counts the time in the queue, a confirm the time to durability.

Publishers write one pre-encoded buffer of up to 1000 publishes per sendall, stamping each
message in place. Consumers recv_into a large buffer and walk the frames with struct, counting
deliveries and reading the first body frame of each; the codec's FrameParser is used for
everything else (handshake, replies, confirms).

Workers report progress through a shared int64 array (one writer per slot) and their final
results through a multiprocessing queue; the parent samples the array once per second for
rates.jsonl and the progress line.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import queue as queue_mod
import socket
import struct
import sys
import time
import traceback
from array import array
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from pamqp import commands
from pamqp import frame as pamqp_frame

from broker.amqp import encoder, events
from broker.stage_trace import sampled
from loadtest.amqp_client import AMQPClient, AMQPClosed
from loadtest.results import RunResult, empty_latency, latency_summary, now_iso

_HEAD = struct.Struct(">BHI")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")
_STAMP = struct.Struct(">QQ")
_DELIVER_ID = 0x003C003C  # class 60, method 60
_SEQ_MASK = (1 << 48) - 1
PERSISTENT_PROPS = b"\x10\x00\x02"  # property flags: delivery-mode present; delivery-mode 2
TRANSIENT_PROPS = b"\x10\x00\x01"
RECV_BUF = 4 << 20
LATENCY_CAP = 200_000  # samples kept per consumer (uniform: halve and double the stride when full)

# shared counter slots per worker
_PUBLISHED, _CONFIRMED, _CONSUMED, _STATE = range(4)
_SLOTS = 4
_STATE_READY, _STATE_DONE, _STATE_FAILED = 1, 2, 3


@dataclass
class ThroughputOptions:
    uri: str = "amqp://guest:guest@127.0.0.1:5672/"
    publishers: int = 1
    consumers: int = 1
    size: int = 16
    persistent: bool = False
    confirm: int = 0  # outstanding-confirm window; 0 = no confirms
    ack_every: int = 0  # 0 = no-ack consumers
    prefetch: int = 0  # 0 = no basic.qos
    exchange: str = ""
    exchange_type: str = "direct"
    routing_key: str = ""
    routing_key_count: int = 1  # >1: publish round robin over this many keys, all bound to the queue
    queue: str = "perf-test"
    queues: int = 1
    queue_args: dict[str, Any] = field(default_factory=dict)
    rate: int = 0  # per publisher msgs/s, 0 = unlimited
    consume_rate: int = 0  # per consumer msgs/s, 0 = unlimited
    pmessages: int = 0  # per publisher, 0 = unlimited
    cmessages: int = 0  # per consumer, 0 = unlimited
    time_s: float = 0.0  # 0 = none (a default of 10 s applies when no count limit is set either)
    verify: bool = False
    keep: bool = False
    trace_stages: str = ""  # DIR: consumers append "client_recv KEY T" for the traced sample (broker.stage_trace)
    # after publishers finish, wait at most drain_timeout_s for consumers and stop early once they
    # received nothing for drain_idle_s. Consume-only runs (no publishers) end at --cmessages, -z, or
    # drain_idle_s after the last delivery; without -z, also when nothing came within drain_timeout_s.
    drain_timeout_s: float = 10.0
    drain_idle_s: float = 2.0

    def validate(self) -> None:
        if self.publishers < 0 or self.consumers < 0 or self.publishers + self.consumers == 0:
            raise ValueError("need at least one publisher or consumer")
        if self.publishers > 0xFFFF:
            raise ValueError("at most 65535 publishers")
        if self.size < 0:
            raise ValueError("size must be >= 0")
        if self.verify and self.size < 16:
            raise ValueError("--verify needs -s/--size >= 16 (timestamp + publisher/sequence)")
        if self.verify and (self.publishers == 0 or self.consumers == 0):
            raise ValueError("--verify needs publishers and consumers")
        if self.queues < 1:
            raise ValueError("--queues must be >= 1")
        if self.routing_key_count < 1:
            raise ValueError("--routing-key-count must be >= 1")
        if self.routing_key_count > 1 and not self.exchange:
            raise ValueError("--routing-key-count needs --exchange (the default exchange routes by queue name)")
        if not self.time_s and not self.pmessages and not self.cmessages:
            self.time_s = 10.0  # every run is bounded

    def queue_names(self) -> list[str]:
        if self.queues == 1:
            return [self.queue]
        return [f"{self.queue}-{i + 1}" for i in range(self.queues)]

    def publish_target(self, idx: int) -> tuple[str, str]:
        """(exchange, routing key) publisher ``idx`` publishes to."""
        q = self.queue_names()[idx % self.queues]
        return self.exchange, self.routing_key or q

    def reaches_every_queue(self) -> bool:
        """Whether each publish is routed to every queue of the run (a copy per queue) rather than to the
        publisher's own queue: a fanout or headers exchange (the tool binds without arguments, which a
        headers exchange matches for every message), or one --routing-key that every queue is bound with."""
        if not self.exchange or self.queues == 1:
            return False
        kind = self.exchange_type
        if self.exchange.startswith("amq."):  # the broker's own exchanges: the name says the type
            kind = {"amq.fanout": "fanout", "amq.headers": "headers", "amq.match": "headers"}.get(self.exchange, "direct")
        return kind in ("fanout", "headers") or bool(self.routing_key)

    def routing_keys(self, key: str) -> list[str]:
        """The keys a publisher whose routing key is ``key`` takes turns over (all of one length, told
        apart by a zero-padded number in front, so they end alike: per-device or RPC-style keys)."""
        n = self.routing_key_count
        if n == 1:
            return [key]
        width = len(str(n - 1))
        return [f"{i:0{width}d}.{key}" for i in range(n)]

    def params(self) -> dict[str, Any]:
        return asdict(self)


# --------------------------------------------------------------------------------------------------
# worker side


class _Shared:
    """Picklable handles to the shared state (fork context)."""

    def __init__(self, ctx: Any, workers: int) -> None:
        self.counters = ctx.RawArray("q", workers * _SLOTS)
        self.go = ctx.RawValue("q", 0)  # monotonic ns of start once publishers may go
        self.stop_pub = ctx.RawValue("b", 0)
        self.stop_con = ctx.RawValue("b", 0)
        self.results = ctx.Queue()


WorkerFn = Callable[[int, int, Any, "_Shared"], dict[str, Any]]


def _worker(kind: str, fn: WorkerFn, idx: int, slot: int, opts: ThroughputOptions, sh: _Shared) -> None:
    base = slot * _SLOTS
    try:
        result = fn(idx, base, opts, sh)
        result.update(kind=kind, idx=idx, error=None)
        sh.counters[base + _STATE] = _STATE_DONE
    except BaseException as exc:  # reported to the parent, which prints it and fails the run
        sh.counters[base + _STATE] = _STATE_FAILED
        text = f"{exc}" if isinstance(exc, AMQPClosed | OSError) else traceback.format_exc()
        result = {"kind": kind, "idx": idx, "error": f"{kind} {idx}: {text}"}
    sh.results.put(result)


def wait_for_go(sh: _Shared) -> bool:
    """Block until the parent starts the run; False if it stopped publishers first."""
    while not sh.go.value:
        if sh.stop_pub.value:
            return False
        time.sleep(0.001)
    return True


def _poll_confirms(client: AMQPClient, state: list[int], singles: set[int], block: bool) -> None:
    """Read whatever the broker sent (non-blocking unless ``block``) and account confirms.

    state = [floor, nacked]: every tag <= floor is confirmed; ``singles`` holds confirmed tags above it.
    """
    sock = client.sock
    assert sock is not None
    try:
        data = sock.recv(1 << 16) if block else sock.recv(1 << 16, socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError):
        return
    except TimeoutError:
        return
    if not data:
        raise AMQPClosed(320, "socket closed by broker")
    client.pending += data
    while True:
        frame = client._split_one_frame()
        if frame is None:
            return
        for ev in client._parser.feed(frame):
            cls = ev.__class__
            if cls is events.Ack or cls is events.Nack:
                tag = ev.delivery_tag
                if cls is events.Nack:
                    state[1] += 1
                if ev.multiple:
                    if tag > state[0]:
                        state[0] = tag
                        if singles:
                            for t in [t for t in singles if t <= tag]:
                                singles.discard(t)
                elif tag > state[0]:
                    singles.add(tag)
                    while state[0] + 1 in singles:
                        state[0] += 1
                        singles.discard(state[0])
            else:
                client._handle_close(ev)


def _settle_confirm_latency(pending: deque, floor: int, now: int, lats: array, counts: array) -> None:
    """Confirm latency: ``pending`` holds [first seq, last seq, send time] of each sent burst not yet
    confirmed; every seq up to ``floor`` is confirmed now. Appends (latency ns, messages) pairs. Only the
    contiguous floor counts (singles above it are confirms out of order: nacks, several shards)."""
    while pending and pending[0][0] <= floor:
        first, last, sent = pending[0]
        upto = last if last <= floor else floor
        if len(lats) < LATENCY_CAP:
            lats.append(now - sent)
            counts.append(upto - first + 1)
        if upto == last:
            pending.popleft()
        else:
            pending[0][0] = upto + 1


def confirm_latency_summary(pub_results: list[dict[str, Any]]) -> dict[str, int | None] | None:
    """min/p50/p95/p99/max (µs) of publish -> confirm over every confirmed message of every publisher
    (nearest rank, each burst's latency weighted by its messages); None without confirms."""
    pairs: list[tuple[int, int]] = []
    for r in pub_results:
        if r.get("confirm_lats"):
            la, co = array("q"), array("q")
            la.frombytes(r["confirm_lats"])
            co.frombytes(r["confirm_counts"])
            pairs.extend(zip(la, co, strict=True))
    if not pairs:
        return None
    pairs.sort()
    total = sum(c for _, c in pairs)

    def pct(q: float) -> int:
        rank = max(1, -(-q * total // 100))
        seen = 0
        for lat, c in pairs:
            seen += c
            if seen >= rank:
                return lat // 1000
        return pairs[-1][0] // 1000

    return {"min": pairs[0][0] // 1000, "p50": pct(50), "p95": pct(95), "p99": pct(99),
            "max": pairs[-1][0] // 1000}


def _publisher(idx: int, base: int, o: ThroughputOptions, sh: _Shared) -> dict[str, Any]:
    counters = sh.counters
    client = AMQPClient(o.uri).connect()
    try:
        if o.confirm:
            client.confirm_select()
        exchange, rk = o.publish_target(idx)
        keys = [k.encode() for k in o.routing_keys(rk)]
        props = PERSISTENT_PROPS if o.persistent else TRANSIENT_PROPS
        marker = bytes(range(1, 17))[: min(16, o.size)]
        body = marker + bytes(o.size - len(marker))
        one = encoder.encode_publish(1, exchange, keys[0].decode(), False, props, body, client.frame_max)
        step = len(one)
        # Message i of the stream has keys[i % len(keys)], written over the first key in place (same length).
        key_at = one.index(keys[0], 7) if len(keys) > 1 else -1
        key_len = len(keys[0])
        body_at = one.index(marker) if o.size >= 8 else -1
        batch = max(1, min(1000, (1 << 20) // step))
        if o.confirm:
            batch = min(batch, o.confirm)
        if o.rate:
            # 1,000 sends/s: a steady rate, not bursts (a burst's tail waits for its head in the broker,
            # which a latency measurement at a fixed rate must not count as the broker's latency)
            batch = min(batch, max(1, o.rate // 1000))
        buf = bytearray(one * batch)
        view = memoryview(buf)
        offs = [i * step + body_at for i in range(batch)] if body_at >= 0 else []
        stamp2 = _STAMP.pack_into
        stamp1 = _U64.pack_into
        ident = idx << 48
        sock = client.sock
        assert sock is not None
        sock.settimeout(None)
        counters[base + _STATE] = _STATE_READY
        if not wait_for_go(sh):
            return {"published": 0, "confirmed": 0, "nacked": 0, "t_last": 0}
        started = time.monotonic()
        seq = 0
        limit = o.pmessages or (1 << 62)
        confirm_state = [0, 0]
        singles: set[int] = set()
        unconfirmed: deque = deque()  # [first seq, last seq, send time] per burst (confirm latency)
        clats = array("q")
        ccounts = array("q")
        mono = time.monotonic_ns
        stop = sh.stop_pub
        t_last = time.monotonic_ns()
        while seq < limit and not stop.value:
            n = min(batch, limit - seq)
            if o.confirm:
                room = o.confirm - (seq - confirm_state[0] - len(singles))
                while room <= 0 and not stop.value:
                    _poll_confirms(client, confirm_state, singles, block=True)
                    _settle_confirm_latency(unconfirmed, confirm_state[0], mono(), clats, ccounts)
                    room = o.confirm - (seq - confirm_state[0] - len(singles))
                if room <= 0:
                    break
                n = min(n, room)
            now = time.monotonic_ns()
            if key_at >= 0:
                nkeys = len(keys)
                for i in range(n):
                    at = i * step + key_at
                    buf[at : at + key_len] = keys[(seq + i) % nkeys]
            if o.size >= 16:
                for i in range(n):
                    stamp2(buf, offs[i], now, ident | (seq + i))
            elif offs:
                for i in range(n):
                    stamp1(buf, offs[i], now)
            sock.sendall(view[: n * step])
            if o.confirm:
                unconfirmed.append([seq + 1, seq + n, now])
            seq += n
            t_last = time.monotonic_ns()
            counters[base + _PUBLISHED] = seq
            _poll_confirms(client, confirm_state, singles, block=False)
            if o.confirm:
                _settle_confirm_latency(unconfirmed, confirm_state[0], mono(), clats, ccounts)
            counters[base + _CONFIRMED] = confirm_state[0] + len(singles)
            if o.rate:
                ahead = seq / o.rate - (time.monotonic() - started)
                if ahead > 0:
                    time.sleep(ahead)
        if o.confirm:  # wait (bounded) for the confirms still outstanding
            deadline = time.monotonic() + 10
            sock.settimeout(0.2)
            while confirm_state[0] + len(singles) < seq and time.monotonic() < deadline:
                _poll_confirms(client, confirm_state, singles, block=True)
                _settle_confirm_latency(unconfirmed, confirm_state[0], mono(), clats, ccounts)
            counters[base + _CONFIRMED] = confirm_state[0] + len(singles)
            if confirm_state[0] + len(singles) >= seq:
                t_last = time.monotonic_ns()
        return {"published": seq, "confirmed": confirm_state[0] + len(singles), "nacked": confirm_state[1],
                "t_last": t_last, "confirm_lats": clats.tobytes(), "confirm_counts": ccounts.tobytes()}
    finally:
        client.close(timeout=60)  # close-ok comes after the broker has read all our publishes


def _consumer(idx: int, base: int, o: ThroughputOptions, sh: _Shared) -> dict[str, Any]:
    client = AMQPClient(o.uri).connect()
    try:
        if o.prefetch:
            client.basic_qos(o.prefetch)
        queue = o.queue_names()[idx % o.queues]
        no_ack = o.ack_every == 0
        client.basic_consume(queue, no_ack=no_ack, consumer_tag=f"perf-{os.getpid()}-{idx}")
        return _consume_loop(client, base, o, sh, no_ack)
    finally:
        # close-ok queues behind deliveries still in flight; a consumer loses nothing by not waiting
        client.close(timeout=0.5)


def _consume_loop(client: AMQPClient, base: int, o: ThroughputOptions, sh: _Shared,
                  no_ack: bool) -> dict[str, Any]:
    counters = sh.counters
    sock = client.sock
    assert sock is not None
    sock.settimeout(0.1)  # so an idle consumer still notices the stop flag
    buf = bytearray(RECV_BUF)
    view = memoryview(buf)
    pending = client.take_pending()
    end = len(pending)
    buf[:end] = pending
    pos = 0
    head = _HEAD.unpack_from
    u32 = _U32.unpack_from
    u64 = _U64.unpack_from
    stamp = _STAMP.unpack_from
    mono = time.monotonic_ns
    encode_ack = encoder.encode_ack
    ack_every = o.ack_every
    limit = o.cmessages or (1 << 62)
    verify = o.verify
    want_latency = o.size >= 8
    consumed = 0
    unacked = 0
    tag = 0
    want_body = False
    lat_min = 1 << 62
    lat_max = -1
    lats = array("q")
    times = array("q")
    stride = 1
    skip = 0
    seen: dict[int, bytearray] = {}
    tracing = bool(o.trace_stages)
    traced: list[str] = []
    dups = 0
    foreign = 0
    t_last = 0
    stop = sh.stop_con
    counters[base + _STATE] = _STATE_READY
    while consumed < limit and not stop.value:
        try:
            got = sock.recv_into(view[end:])
        except TimeoutError:
            got = -1
        if got == 0:
            raise AMQPClosed(320, "socket closed by broker")
        if got > 0:
            end += got
        now = mono()
        go = sh.go.value
        before = consumed
        while end - pos >= 7:
            ftype, _ch, size = head(buf, pos)
            fend = pos + 8 + size
            if fend > end:
                break
            if ftype == 3:
                if want_body:
                    want_body = False
                    if want_latency and size >= 8:
                        if verify and size >= 16:
                            ts, ident = stamp(buf, pos + 7)
                            pub = ident >> 48
                            if pub == 0xFFFF:
                                foreign += 1
                            else:
                                seq = ident & _SEQ_MASK
                                bm = seen.get(pub)
                                if bm is None:
                                    bm = seen[pub] = bytearray(1 << 12)
                                byte = seq >> 3
                                if byte >= len(bm):
                                    bm.extend(bytes(max(len(bm), byte + 1 - len(bm))))
                                bit = 1 << (seq & 7)
                                if bm[byte] & bit:
                                    dups += 1
                                else:
                                    bm[byte] |= bit
                        else:
                            ts = u64(buf, pos + 7)[0]
                        lat = now - ts
                        if tracing and size >= 16:
                            key = bytes(buf[pos + 7:pos + 23])
                            if sampled(key):
                                traced.append(f"client_recv {key.hex()} {now}\n")
                        if lat < lat_min:
                            lat_min = lat
                        if lat > lat_max:
                            lat_max = lat
                        skip += 1
                        if skip >= stride:
                            skip = 0
                            lats.append(lat)
                            times.append(now - go if go else 0)
                            if len(lats) >= LATENCY_CAP:
                                lats = lats[::2]
                                times = times[::2]
                                stride *= 2
            elif ftype == 1:
                if u32(buf, pos + 7)[0] == _DELIVER_ID:
                    consumed += 1
                    want_body = o.size > 0
                    if not no_ack:
                        tag = u64(buf, pos + 12 + buf[pos + 11])[0]
                        unacked += 1
                        if unacked >= ack_every:
                            sock.sendall(encode_ack(1, tag, True))
                            unacked = 0
                else:
                    _control_frame(client, bytes(buf[pos:fend]))
            pos = fend
            if consumed >= limit and not want_body:
                break
        if consumed != before:
            counters[base + _CONSUMED] = consumed
            t_last = now
        if pos == end:
            pos = end = 0
        elif end > RECV_BUF - (RECV_BUF >> 2):  # keep room to recv: move the partial frame down
            buf[: end - pos] = buf[pos:end]
            end -= pos
            pos = 0
        if o.consume_rate and go:
            ahead = consumed / o.consume_rate - (now - go) / 1e9
            if ahead > 0:
                time.sleep(ahead)
    if unacked:
        sock.sendall(encode_ack(1, tag, True))
    if traced:
        os.makedirs(o.trace_stages, exist_ok=True)
        with open(os.path.join(o.trace_stages, f"client-{os.getpid()}.trace"), "a") as fh:
            fh.writelines(traced)
    return {"consumed": consumed, "t_last": t_last, "lat_min": lat_min if lat_max >= 0 else None,
            "lat_max": lat_max if lat_max >= 0 else None, "lats": lats.tobytes(), "times": times.tobytes(),
            "stride": stride, "seen": {k: bytes(v) for k, v in seen.items()}, "dups": dups, "foreign": foreign}


def _control_frame(client: AMQPClient, frame: bytes) -> None:
    """A non-deliver method frame in the consumer stream: a close or cancel ends the run."""
    method = pamqp_frame.unmarshal(frame)[2]
    if isinstance(method, commands.Connection.Close):
        raise AMQPClosed(method.reply_code, method.reply_text)
    if isinstance(method, commands.Channel.Close):
        raise AMQPClosed(method.reply_code, method.reply_text, 1)
    if isinstance(method, commands.Basic.Cancel):
        raise AMQPClosed(0, "consumer cancelled by broker", 1)


# --------------------------------------------------------------------------------------------------
# parent side


@dataclass
class VerifyReport:
    """``published`` counts publishes; every one is expected ``copies`` times (once per consumer group:
    per queue with a fanout exchange, per subscriber in MQTT), and the other counts are over all copies."""

    ok: bool
    published: int
    received_unique: int
    missing: int
    duplicates: int
    unexpected: int
    per_publisher: dict[int, dict[str, int]]
    copies: int = 1

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["per_publisher"] = {str(k): v for k, v in self.per_publisher.items()}
        return d


def _verify(pub_results: list[dict[str, Any]], con_results: list[dict[str, Any]]) -> VerifyReport:
    published = {r["idx"]: r["published"] for r in pub_results}
    per: dict[int, dict[str, int]] = {}
    total_dups = sum(r["dups"] for r in con_results)
    unexpected = sum(r["foreign"] for r in con_results)
    pubs = set(published) | {p for r in con_results for p in r["seen"]}
    unique_total = 0
    missing_total = 0
    for p in sorted(pubs):
        acc = 0
        dups = 0
        for r in con_results:
            raw = r["seen"].get(p)
            if raw:
                bits = int.from_bytes(raw, "little")
                dups += (acc & bits).bit_count()
                acc |= bits
        n = published.get(p, 0)
        in_range = acc & ((1 << n) - 1)
        unique = in_range.bit_count()
        extra = (acc >> n).bit_count()
        per[p] = {"published": n, "received": unique, "missing": n - unique, "duplicates": dups,
                  "unexpected": extra}
        unique_total += unique
        missing_total += n - unique
        total_dups += dups
        unexpected += extra
    ok = missing_total == 0 and total_dups == 0 and unexpected == 0
    return VerifyReport(ok, sum(published.values()), unique_total, missing_total, total_dups, unexpected, per)


def _verify_copies(pub_results: list[dict[str, Any]], con_results: list[dict[str, Any]],
                   groups: list[list[int]]) -> VerifyReport:
    """Every group of consumers (by index) must have received every message exactly once between them:
    a group is the consumers of one queue a fanout exchange copies each message to, or one MQTT
    subscriber. One group of every consumer is the plain case (each publish is delivered once)."""
    by_idx = {r["idx"]: r for r in con_results}
    reports = [_verify(pub_results, [by_idx[i] for i in group if i in by_idx]) for group in groups]
    if len(reports) == 1:
        return reports[0]
    per: dict[int, dict[str, int]] = {}
    for rep in reports:
        for p, d in rep.per_publisher.items():
            acc = per.setdefault(p, {k: 0 for k in d} | {"published": d["published"]})
            for k in ("received", "missing", "duplicates", "unexpected"):
                acc[k] += d[k]
    return VerifyReport(all(r.ok for r in reports), sum(r["published"] for r in pub_results),
                        sum(r.received_unique for r in reports), sum(r.missing for r in reports),
                        sum(r.duplicates for r in reports), sum(r.unexpected for r in reports), per, len(groups))


def _merge_latency(con_results: list[dict[str, Any]]) -> tuple[dict[str, int | None], list[tuple[float, int]]]:
    """Summary over all consumers' samples (equalised to the largest stride) + (t, us) samples."""
    parts = [r for r in con_results if r.get("lat_max") is not None]
    if not parts:
        return empty_latency(), []
    top = max(r["stride"] for r in parts)
    lats: list[int] = []
    times: list[int] = []
    for r in parts:
        la = array("q")
        la.frombytes(r["lats"])
        ti = array("q")
        ti.frombytes(r["times"])
        k = top // r["stride"]
        lats.extend(la[::k])
        times.extend(ti[::k])
    pairs = sorted(zip(times, lats, strict=True))
    summary = latency_summary([max(0, lat // 1000) for lat in lats])
    summary["min"] = max(0, min(r["lat_min"] for r in parts) // 1000)
    summary["max"] = max(r["lat_max"] for r in parts) // 1000
    samples = [(t / 1e9, max(0, lat // 1000)) for t, lat in pairs]
    return summary, samples


class ThroughputRun:
    """Declare, spawn, measure, collect, clean up. ``progress`` gets a status dict every ~0.5 s."""

    def __init__(self, opts: ThroughputOptions, *, broker: str = "shardmq", scenario: str = "throughput",
                 broker_rss: Callable[[], int | None] = lambda: None,
                 progress: Callable[[dict[str, Any]], None] | None = None) -> None:
        opts.validate()
        self.o = opts
        self.broker = broker
        self.scenario = scenario
        self.broker_rss = broker_rss
        self.progress = progress
        self.errors: list[str] = []
        self.verify: VerifyReport | None = None
        self.created_queues: list[str] = []
        # subclasses (MQTT) swap the worker functions; fanout = every consumer gets every message
        self.publisher_fn: WorkerFn = _publisher
        self.consumer_fn: WorkerFn = _consumer
        self.fanout = False
        self.created_exchange = False

    def copy_groups(self) -> list[list[int]]:
        """The consumers (by index) that share one copy of each message between them: the run expects
        every publish once in each group. Each consumer alone when every one gets every message (MQTT);
        the consumers of each queue when each publish reaches every queue (fanout: consumer i reads
        queue i mod --queues, and a queue nobody reads is not counted); else all consumers together."""
        o = self.o
        if self.fanout:
            return [[i] for i in range(o.consumers)]
        if o.reaches_every_queue():
            by_queue: dict[int, list[int]] = {}
            for i in range(o.consumers):
                by_queue.setdefault(i % o.queues, []).append(i)
            return list(by_queue.values())
        return [list(range(o.consumers))]

    # topology -------------------------------------------------------------------------------

    def _declare(self, c: AMQPClient) -> None:
        o = self.o
        if o.exchange and not o.exchange.startswith("amq."):
            c.exchange_declare(o.exchange, o.exchange_type, durable=o.persistent)
            self.created_exchange = True
        for q in o.queue_names():
            existed = c.queue_exists(q)
            c.queue_declare(q, durable=o.persistent, arguments=o.queue_args or None)
            if not existed:
                self.created_queues.append(q)
            if o.exchange:
                for key in o.routing_keys(o.routing_key or q):
                    c.queue_bind(q, o.exchange, key)

    def _cleanup(self, c: AMQPClient) -> None:
        if self.o.keep:
            return
        for q in self.created_queues:
            c.queue_delete(q)
        if self.created_exchange:
            c.exchange_delete(self.o.exchange)

    # run ------------------------------------------------------------------------------------

    def run(self) -> RunResult:
        o = self.o
        with AMQPClient(o.uri).connect() as control:
            self._declare(control)
            try:
                result = self._measure()
            finally:
                try:
                    self._cleanup(control)
                except (AMQPClosed, OSError) as exc:
                    self.errors.append(f"cleanup: {exc}")
        return result

    def _measure(self) -> RunResult:
        o = self.o
        ctx = multiprocessing.get_context("fork")
        workers = [("consumer", i) for i in range(o.consumers)] + [("publisher", i) for i in range(o.publishers)]
        sh = _Shared(ctx, len(workers))
        procs = []
        for slot, (kind, idx) in enumerate(workers):
            fn = self.publisher_fn if kind == "publisher" else self.consumer_fn
            p = ctx.Process(target=_worker, args=(kind, fn, idx, slot, o, sh), daemon=True)
            p.start()
            procs.append(p)
        c = sh.counters
        n = len(workers)
        pubs = range(o.consumers, n)
        cons = range(o.consumers)

        def total(field_: int, slots: range) -> int:
            return sum(c[s * _SLOTS + field_] for s in slots)

        def states(slots: range) -> list[int]:
            return [c[s * _SLOTS + _STATE] for s in slots]

        results: list[dict[str, Any]] = []
        copies = len(self.copy_groups())

        def collect(block_s: float) -> None:
            try:
                while True:
                    results.append(sh.results.get(timeout=block_s))
                    block_s = 0.0
            except queue_mod.Empty:
                pass

        started_at = now_iso()
        rates: list[tuple[int, int, int]] = []
        try:
            deadline = time.monotonic() + 15
            while any(st == 0 for st in states(range(n))) and time.monotonic() < deadline:
                if any(st == _STATE_FAILED for st in states(range(n))):
                    break
                time.sleep(0.005)
            # A consumer may drain a backlog and finish before "go" (pacing starts at go): DONE is ready too.
            if any(st not in (_STATE_READY, _STATE_DONE) for st in states(range(n))):
                sh.stop_pub.value = sh.stop_con.value = 1
                collect(2.0)
                self.errors += [r["error"] for r in results if r.get("error")]
                if not self.errors:
                    self.errors.append("workers did not get ready within 15 s")
                raise RuntimeError("; ".join(self.errors))
            t0 = time.monotonic_ns()
            sh.go.value = t0
            last = (0, 0)
            next_tick = 1
            next_progress = 0.0
            drain_deadline: float | None = None
            drain_seen = (0, 0.0)  # (consumed, when it last changed) while draining
            pub_stop_at: float | None = None
            while True:
                time.sleep(0.05)
                el = (time.monotonic_ns() - t0) / 1e9
                published = total(_PUBLISHED, pubs)
                consumed = total(_CONSUMED, cons)
                if el >= next_tick:
                    rates.append((next_tick, published - last[0], consumed - last[1]))
                    last = (published, consumed)
                    next_tick += 1
                if self.progress and el >= next_progress:
                    next_progress = el + 0.5
                    self.progress({"elapsed": el, "published": published, "consumed": consumed,
                                   "confirmed": total(_CONFIRMED, pubs), "rates": rates[-1:] or None})
                pst = states(pubs)
                cst = states(cons)
                if _STATE_FAILED in pst or _STATE_FAILED in cst:
                    break
                if o.time_s and el >= o.time_s and not sh.stop_pub.value:
                    sh.stop_pub.value = 1
                    if not (o.verify or o.cmessages):
                        sh.stop_con.value = 1  # count consumption over the same window as publishing
                pubs_done = all(s != _STATE_READY for s in pst)
                cons_done = all(s != _STATE_READY for s in cst)
                if pubs_done and pub_stop_at is None:
                    pub_stop_at = time.monotonic()
                if cons_done and o.consumers:
                    sh.stop_pub.value = 1  # consumers reached --cmessages: nothing left to measure
                if cons_done and (pubs_done or not o.publishers):
                    break
                if not o.publishers:  # consume-only: drain a backlog that exists before the run
                    if o.time_s and el >= o.time_s:
                        break
                    now_s = time.monotonic()
                    if consumed != drain_seen[0]:
                        drain_seen = (consumed, now_s)
                    # idle only counts once messages flowed: the first delivery may take a while
                    if consumed and now_s - drain_seen[1] > o.drain_idle_s:
                        break
                    if not consumed and not o.time_s and el > o.drain_timeout_s:
                        break  # no -z and nothing to drain: still a bounded run
                    continue
                if pubs_done:
                    # drain only when the counts matter (verify / cmessages); otherwise stop now
                    if not (o.verify or o.cmessages) or not o.consumers:
                        break
                    now_s = time.monotonic()
                    if drain_deadline is None:
                        drain_deadline = now_s + o.drain_timeout_s
                        drain_seen = (consumed, now_s)
                    if consumed != drain_seen[0]:
                        drain_seen = (consumed, now_s)
                    expected = published * copies
                    if (consumed >= expected or now_s > drain_deadline
                            or now_s - drain_seen[1] > o.drain_idle_s):
                        break
            sh.stop_pub.value = sh.stop_con.value = 1
            deadline = time.monotonic() + 15
            while len(results) < n and time.monotonic() < deadline:
                collect(0.2)
        finally:
            sh.stop_pub.value = sh.stop_con.value = 1
            join_deadline = time.monotonic() + 5
            for p in procs:
                p.join(timeout=max(0.1, join_deadline - time.monotonic()))
                if p.is_alive():
                    p.terminate()
                    p.join(2)
        self.errors += [r["error"] for r in results if r.get("error")]
        if len(results) < n:
            self.errors.append(f"{n - len(results)} worker(s) reported no result")
        pub_r = [r for r in results if r["kind"] == "publisher" and not r.get("error")]
        con_r = [r for r in results if r["kind"] == "consumer" and not r.get("error")]
        t_end = max([r["t_last"] for r in pub_r + con_r if r.get("t_last")] or [time.monotonic_ns()])
        duration = max(1e-9, (t_end - t0) / 1e9)
        if rates and (duration - rates[-1][0]) > 0.05 or not rates:  # the partial last second
            published = sum(r["published"] for r in pub_r)
            consumed = sum(r["consumed"] for r in con_r)
            rates.append((len(rates) + 1, published - last[0], consumed - last[1]))
        latency, samples = _merge_latency(con_r)
        if o.verify and not self.errors:
            self.verify = _verify_copies(pub_r, con_r, self.copy_groups())
        return RunResult(
            broker=self.broker, scenario=self.scenario, params=o.params(), started_at=started_at,
            duration_s=duration, published=sum(r["published"] for r in pub_r),
            consumed=sum(r["consumed"] for r in con_r), confirmed=sum(r["confirmed"] for r in pub_r),
            latency_us=latency, broker_rss_bytes=self.broker_rss(), rates=rates, latency_samples=samples,
            # flat numbers: the Spark report shows numeric extras as rows (median over runs)
            extra=({f"confirm_latency_{k}_us": v for k, v in clat.items()}
                   if (clat := confirm_latency_summary(pub_r)) else None),
        )


def print_human(result: RunResult, verify: VerifyReport | None, out: Any = sys.stdout) -> None:
    lat = result.latency_us
    print(f"duration      {result.duration_s:.2f} s", file=out)
    print(f"published     {result.published}  ({result.publish_rate:,.0f} msgs/s)", file=out)
    print(f"confirmed     {result.confirmed}", file=out)
    print(f"consumed      {result.consumed}  ({result.consume_rate:,.0f} msgs/s)", file=out)
    if lat["p50"] is not None:
        print("latency (us)  min {min}  p50 {p50}  p95 {p95}  p99 {p99}  max {max}".format(**lat), file=out)
    extra = result.extra or {}
    if "confirm_latency_p50_us" in extra:
        print("confirm (us)  " + "  ".join(f"{k} {extra[f'confirm_latency_{k}_us']}"
                                           for k in ("min", "p50", "p95", "p99", "max")), file=out)
    if result.broker_rss_bytes is not None:
        print(f"broker RSS    {result.broker_rss_bytes / 1048576:.1f} MiB", file=out)
    if verify is not None:
        copies = f" x {verify.copies} copies" if verify.copies != 1 else ""
        print(f"verify        {'OK' if verify.ok else 'FAILED'}: published {verify.published}{copies}, "
              f"received {verify.received_unique}, missing {verify.missing}, "
              f"duplicates {verify.duplicates}, unexpected {verify.unexpected}", file=out)


def result_json(result: RunResult, verify: VerifyReport | None, errors: list[str]) -> str:
    d = result.to_json()
    if verify is not None:
        d["verify"] = verify.to_json()
    if errors:
        d["errors"] = errors
    return json.dumps(d)
