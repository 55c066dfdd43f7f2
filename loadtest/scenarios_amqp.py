"""AMQP scenarios other than throughput: queue-count, connection-count, bind-churn, connection-churn,
delete-stall.

Each returns a RunResult whose ``extra`` holds the scenario's own measurements; everything it
declares is deleted again (unless --keep), and every loop is bounded by a count or -z seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import multiprocessing
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any

from pamqp import commands

from broker.amqp import events
from loadtest.amqp_async import (
    ChurnCounts,
    ClientFrames,
    IdleConnections,
    churn,
    new_event_loop,
    raise_nofile,
)
from loadtest.amqp_client import AMQPClient, AMQPUri
from loadtest.results import RunResult, broker_cpu_seconds, broker_memory, now_iso

RssFn = Callable[[], int | None]
MemFn = Callable[[], dict[str, int] | None]


def _result(args: argparse.Namespace, broker: str, scenario: str, started_at: str, duration: float,
            extra: dict[str, Any], rss: int | None, rates: list[tuple[int, int, int]] | None = None) -> RunResult:
    params = {k: v for k, v in vars(args).items() if k not in ("json", "results_dir", "broker_name", "scenario")}
    return RunResult(broker=broker, scenario=scenario, params=params, started_at=started_at,
                     duration_s=duration, broker_rss_bytes=rss, extra=extra, rates=rates or [])


def queue_count(args: argparse.Namespace, *, broker: str, scenario: str, broker_rss: RssFn) -> RunResult:
    """Declare ``--count`` queues, pipelined in batches of 500, and report time and RSS growth."""
    n = args.count
    names = [f"{args.queue}-{i}" for i in range(n)]
    started_at = now_iso()
    with AMQPClient(args.uri).connect() as c:
        rss_before = broker_rss()
        t0 = time.monotonic()
        created: list[str] = []
        chunk_s: list[float] = []  # seconds per chunk of 500 declares, in order
        deadline = t0 + (args.time_s or 600)
        delete_s = None
        try:
            for start in range(0, n, 500):
                chunk = names[start : start + 500]
                t_chunk = time.monotonic()
                c.send(b"".join(_encode(commands.Queue.Declare(queue=q, durable=args.durable)) for q in chunk))
                for q in chunk:
                    c._wait_method(1, commands.Queue.DeclareOk)
                    created.append(q)
                chunk_s.append(time.monotonic() - t_chunk)
                if time.monotonic() > deadline:
                    break
            declare_s = time.monotonic() - t0
            rss_after = broker_rss()
        finally:
            if not args.keep:
                t_del = time.monotonic()
                for start in range(0, len(created), 500):
                    chunk = created[start : start + 500]
                    c.send(b"".join(_encode(commands.Queue.Delete(queue=q)) for q in chunk))
                    for _ in chunk:
                        c._wait_method(1, commands.Queue.DeleteOk)
                delete_s = time.monotonic() - t_del
    tenth = max(1, len(chunk_s) // 10)
    extra = {"queues": len(created), "declare_s": round(declare_s, 4),
             "declares_per_s": round(len(created) / declare_s, 1) if declare_s else None,
             # Flatness: the rate over the first and the last tenth of the chunks (500 declares each).
             "first_10pct_declares_per_s": round(500 * tenth / sum(chunk_s[:tenth]), 1) if chunk_s else None,
             "last_10pct_declares_per_s": round(500 * tenth / sum(chunk_s[-tenth:]), 1) if chunk_s else None,
             # The rate over each tenth of the chunks in turn (a growth with the count shows as a slope).
             "tenths_declares_per_s": [round(500 * len(chunk_s[i:i + tenth]) / sum(chunk_s[i:i + tenth]), 1)
                                       for i in range(0, len(chunk_s), tenth)] if chunk_s else None,
             "deletes_per_s": round(len(created) / delete_s, 1) if delete_s else None,
             "rss_before_bytes": rss_before, "rss_after_bytes": rss_after,
             "rss_per_queue_bytes": (rss_after - rss_before) // len(created)
             if rss_before is not None and rss_after is not None and created else None}
    return _result(args, broker, scenario, started_at, declare_s, extra, rss_after)


def _encode(method: Any, channel: int = 1) -> bytes:
    from broker.amqp import encoder

    return encoder.encode_method(channel, method)


def rss_growth(before: list[int] | None, after: list[int] | None, count: int) -> dict[str, Any]:
    """Per-item RSS growth from two sample sets (max of each), clamped at 0.

    The noise is the larger spread within one sample set; a growth not above it is reported as
    ``rss_delta_within_noise`` (and a negative one as 0 per item) rather than as a measurement.
    """
    if before is None or after is None or not count:
        return {"rss_before_bytes": max(before) if before else None,
                "rss_after_bytes": max(after) if after else None, "rss_per_connection_bytes": None}
    delta = max(after) - max(before)
    noise = max(max(before) - min(before), max(after) - min(after))
    return {"rss_before_bytes": max(before), "rss_after_bytes": max(after), "rss_delta_bytes": delta,
            "rss_noise_bytes": noise, "rss_delta_within_noise": delta <= noise,
            "rss_per_connection_bytes": max(0, delta) // count}


def _memory_samples(mem: MemFn, loop: asyncio.AbstractEventLoop, settle_s: float, samples: int = 3,
                    gap_s: float = 0.2) -> list[dict[str, int]] | None:
    """``samples`` memory readings ``gap_s`` apart after ``settle_s``, the client loop running meanwhile
    (its heartbeats go out): a single reading right after the last handshake misses memory the broker
    has yet to fault in and jitters with its GC/allocator."""
    async def take() -> list[dict[str, int]] | None:
        await asyncio.sleep(settle_s)
        got = []
        for i in range(samples):
            if i:
                await asyncio.sleep(gap_s)
            m = mem()
            if m is None:
                return None
            got.append(m)
        return got
    return loop.run_until_complete(take())


def _pss_growth(before: list[dict[str, int]] | None, after: list[dict[str, int]] | None,
                count: int) -> dict[str, Any]:
    if not before or not after or not count:
        return {}
    b, a = max(m["pss"] for m in before), max(m["pss"] for m in after)
    return {"pss_before_bytes": b, "pss_after_bytes": a, "pss_per_connection_bytes": max(0, a - b) // count,
            "broker_processes": after[-1]["processes"]}


def connection_count(args: argparse.Namespace, *, broker: str, scenario: str, broker_rss: RssFn,
                     settle_s: float = 1.0) -> RunResult:
    """Open ``--count`` idle connections (handshake + channel) from one process, report the broker's
    memory, hold them ``--hold`` seconds (heartbeats answered), close them all.

    Memory (the broker pid's whole process tree: RSS and PSS) is sampled (max of 3, 0.2 s apart)
    before the first connection and again at the end of the hold (at least ``settle_s`` after the
    last handshake); ``rss_after_bytes`` is the total with N open and the per-connection figures are
    the growth / N.
    """
    raise_nofile()
    pid = getattr(args, "broker_pid", None)

    def mem() -> dict[str, int] | None:
        if pid is not None:
            return broker_memory(pid)
        rss = broker_rss()
        return None if rss is None else {"rss": rss, "pss": 0, "uss": 0, "processes": 0}

    frames = ClientFrames(AMQPUri.parse(args.uri), heartbeat=args.heartbeat)
    loop = new_event_loop()
    idle = IdleConnections(frames)
    started_at = now_iso()
    before = _memory_samples(mem, loop, 0.0)
    t0 = time.monotonic()
    try:
        loop.run_until_complete(idle.open(args.count, args.concurrency, t0 + (args.time_s or 600)))
        open_s = time.monotonic() - t0
        # Sampled at the end of the hold (at least settle_s after the last handshake): what the broker
        # keeps per connection only after a while (its statistics of them) is counted too.
        hold = min(args.hold, args.time_s or args.hold)
        after = _memory_samples(mem, loop, max(settle_s, hold - 0.4))
        alive = idle.alive()
        t_close = time.monotonic()
        loop.run_until_complete(idle.close_all())
        close_s = time.monotonic() - t_close
    finally:
        loop.run_until_complete(idle.close_all())
        loop.close()
    n = len(idle.conns)
    if idle.errors:
        print(f"connection-count: {len(idle.errors)} connections failed, first: {idle.errors[0]}", file=sys.stderr)
    extra = {"connections": n, "connections_alive": alive, "errors": len(idle.errors),
             "open_s": round(open_s, 4), "connections_per_s": round(n / open_s, 1) if open_s else None,
             "close_s": round(close_s, 4),
             **rss_growth([m["rss"] for m in before] if before else None,
                          [m["rss"] for m in after] if after else None, n),
             **(_pss_growth(before, after, n) if pid is not None else {})}
    return _result(args, broker, scenario, started_at, open_s, extra, extra["rss_after_bytes"])


def bind_churn(args: argparse.Namespace, *, broker: str, scenario: str, broker_rss: RssFn) -> RunResult:
    """Synchronous queue.bind + queue.unbind pairs with fresh keys for -z seconds (default 10)."""
    duration = args.time_s or 10.0
    started_at = now_iso()
    rates: list[tuple[int, int, int]] = []
    with AMQPClient(args.uri).connect() as c:
        existed = c.queue_exists(args.queue)
        c.exchange_declare(args.exchange, "direct")
        c.queue_declare(args.queue)
        try:
            t0 = time.monotonic()
            pairs = 0
            last = 0
            tick = 1
            while (el := time.monotonic() - t0) < duration:
                key = f"k{pairs}"
                c.queue_bind(args.queue, args.exchange, key)
                c.queue_unbind(args.queue, args.exchange, key)
                pairs += 1
                if el >= tick:
                    rates.append((tick, pairs - last, 0))
                    last, tick = pairs, tick + 1
            took = time.monotonic() - t0
        finally:
            c.exchange_delete(args.exchange)
            if not existed:
                c.queue_delete(args.queue)
        rss = broker_rss()
    extra = {"bind_unbind_pairs": pairs, "pairs_per_s": round(pairs / took, 1)}
    return _result(args, broker, scenario, started_at, took, extra, rss, rates)


def time_wait_sockets(port: int) -> dict[str, int]:
    """TIME_WAIT sockets of connections to ``port`` on this host (IPv4), by the side that holds them:
    the side that closes first keeps the 4-tuple for 60 s (the client's would use up ephemeral ports)."""
    got = {"time_wait_server": 0, "time_wait_client": 0}
    hexport = f"{port:04X}"
    try:
        with open("/proc/net/tcp") as f:
            next(f)
            for line in f:
                parts = line.split()
                if len(parts) > 3 and parts[3] == "06":
                    if parts[1].endswith(":" + hexport):
                        got["time_wait_server"] += 1
                    elif parts[2].endswith(":" + hexport):
                        got["time_wait_client"] += 1
    except OSError:
        pass
    return got


def _churn_process(uri: str, heartbeat: int | None, concurrency: int, duration: float, counter: Any,
                   errors: Any) -> None:
    raise_nofile()
    counts = ChurnCounts()

    def done(n: int) -> None:
        counter.value = n
    loop = new_event_loop()
    try:
        loop.run_until_complete(churn(ClientFrames(AMQPUri.parse(uri), heartbeat=heartbeat), concurrency, duration,
                                      counts, done))
    finally:
        loop.close()
    errors.value = counts.errors
    if counts.first_error:
        print(f"connection-churn: {counts.errors} failed, first: {counts.first_error}", file=sys.stderr)


def connection_churn(args: argparse.Namespace, *, broker: str, scenario: str, broker_rss: RssFn) -> RunResult:
    """Connections opened (full handshake + channel.open) and closed per second for -z seconds (default
    10): ``--concurrency`` loops of open+close in each of ``-x`` processes (asyncio; 1 = this process)."""
    duration = args.time_s or 10.0
    ctx = multiprocessing.get_context("fork")
    counters = [ctx.RawValue("q", 0) for _ in range(args.parallel)]
    errs = [ctx.RawValue("q", 0) for _ in range(args.parallel)]
    started_at = now_iso()
    port = AMQPUri.parse(args.uri).port
    tw_before = time_wait_sockets(port)
    pid = getattr(args, "broker_pid", None)
    cpu_before = broker_cpu_seconds(pid)
    work = [(args.uri, args.heartbeat, args.concurrency, duration, counters[i], errs[i]) for i in range(args.parallel)]
    procs = [ctx.Process(target=_churn_process, args=w, daemon=True) for w in work]
    t0 = time.monotonic()
    for p in procs:
        p.start()
    rates: list[tuple[int, int, int]] = []
    last = 0
    tick = 1
    while any(p.is_alive() for p in procs):
        time.sleep(0.05)
        if time.monotonic() - t0 >= tick:
            now = sum(c.value for c in counters)
            rates.append((tick, now - last, 0))
            last, tick = now, tick + 1
        if time.monotonic() - t0 > duration + 30:
            for p in procs:
                p.terminate()
    for p in procs:
        p.join()
    took = time.monotonic() - t0
    total = sum(c.value for c in counters)
    tw = time_wait_sockets(port)
    cpu_after = broker_cpu_seconds(pid)
    extra = {"connections": total, "connections_per_s": round(total / took, 1),
             "errors": sum(e.value for e in errs),
             # The broker's CPU per connection: steadier than the rate when other work shares the cores.
             "broker_cpu_us_per_connection": round((cpu_after - cpu_before) * 1e6 / total)
             if cpu_before is not None and cpu_after is not None and total else None,
             **{k: max(0, v - tw_before[k]) for k, v in tw.items()}}
    return _result(args, broker, scenario, started_at, took, extra, broker_rss(), rates)


def _api(base: str, method: str, path: str, body: dict | None = None) -> None:
    """One management API call (ShardMQ's and RabbitMQ's share these paths); base carries user:password."""
    u = urllib.parse.urlsplit(base)
    req = urllib.request.Request(f"{u.scheme}://{u.hostname}:{u.port}{path}", method=method,
                                 data=json.dumps(body).encode() if body is not None else None,
                                 headers={"content-type": "application/json"})
    auth = f"{urllib.parse.unquote(u.username or 'guest')}:{urllib.parse.unquote(u.password or 'guest')}"
    req.add_header("authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    with urllib.request.urlopen(req, timeout=600) as resp:
        resp.read()


def delete_many(c: AMQPClient, names: list[str]) -> None:
    """Delete ``names`` on channel 1, 500 queue.delete in flight at a time (as a client that
    pipelines would): each chunk's delete-oks are awaited before the next chunk goes."""
    for start in range(0, len(names), 500):
        chunk = names[start : start + 500]
        c.send(b"".join(_encode(commands.Queue.Delete(queue=q)) for q in chunk))
        for _ in chunk:
            c._wait_method(1, commands.Queue.DeleteOk)


def _declare_many(c: AMQPClient, names: list[str], durable: bool) -> None:
    for start in range(0, len(names), 500):
        chunk = names[start : start + 500]
        c.send(b"".join(_encode(commands.Queue.Declare(queue=q, durable=durable)) for q in chunk))
        for _ in chunk:
            c._wait_method(1, commands.Queue.DeclareOk)


class _ConfirmProbe(threading.Thread):
    """One publisher with confirms, one message in flight, on its own connection: (send time, round
    trip) of every publish until stopped. A stall anywhere on its path shows as one long round trip."""

    def __init__(self, uri: str, queue: str, durable: bool = False) -> None:
        super().__init__(daemon=True)
        self.uri, self.queue, self.durable = uri, queue, durable
        self.samples: list[tuple[float, float]] = []
        self.stop = threading.Event()
        self.ready = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        from broker.amqp import encoder

        try:
            with AMQPClient(self.uri).connect() as c:
                c.queue_declare(self.queue, durable=self.durable)
                c.confirm_select()
                # Property flags: none, or delivery-mode only (0x1000) = 2, persistent.
                props = b"\x10\x00\x02" if self.durable else b"\x00\x00"
                frame = encoder.encode_publish(1, "", self.queue, False, props, b"p" * 16, c.frame_max)
                purge = _encode(commands.Queue.Purge(queue=self.queue))
                n = 0
                self.ready.set()
                while not self.stop.is_set():
                    t = time.monotonic()
                    c.send(frame)
                    while True:
                        ev = c.next_event()
                        c._handle_close(ev)
                        if ev.__class__ is events.Ack or ev.__class__ is events.Nack:
                            break
                    self.samples.append((t, time.monotonic() - t))
                    n += 1
                    if n % 10000 == 0:  # keep the probe queue small
                        c.send(purge)
                        c._wait_method(1, commands.Queue.PurgeOk)
                c.queue_delete(self.queue)
        except BaseException as exc:  # reported by the caller
            self.error = exc
            self.ready.set()


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def confirm_rtt(args: argparse.Namespace, *, broker: str, scenario: str, broker_rss: RssFn) -> RunResult:
    """One publisher with confirms and one message in flight (a synchronous publisher: pika's
    BlockingConnection with confirm_delivery publishes so) for --time seconds: its confirm round trips.
    What a publisher that waits for each confirm gets per second is 1 / the mean round trip."""
    started_at = now_iso()
    probe = _ConfirmProbe(args.uri, args.queue, args.durable)
    probe.start()
    if not probe.ready.wait(30):
        raise RuntimeError("confirm-rtt: the probe did not connect within 30 s")
    t0 = time.monotonic()
    probe.stop.wait(args.time_s or 10.0)
    probe.stop.set()
    probe.join(30)
    t1 = time.monotonic()
    if probe.error is not None:
        raise probe.error
    rtts = [rtt for _ts, rtt in probe.samples]
    us = 1e6
    extra = {"durable": args.durable, "confirms": len(rtts),
             "confirms_per_s": round(len(rtts) / (t1 - t0), 1) if t1 > t0 else None,
             "rtt_p50_us": round(_percentile(rtts, 0.5) * us, 1) if rtts else None,
             "rtt_p99_us": round(_percentile(rtts, 0.99) * us, 1) if rtts else None,
             "rtt_max_us": round(max(rtts) * us, 1) if rtts else None}
    return _result(args, broker, scenario, started_at, t1 - t0, extra, broker_rss())


def delete_stall(args: argparse.Namespace, *, broker: str, scenario: str, broker_rss: RssFn) -> RunResult:
    """Delete --count queues (pipelined queue.delete, or with --vhost the vhost holding them, through the
    management API --api) while a confirming publisher (one message in flight) publishes to a queue of
    the URI's vhost: its worst confirm round trip during the delete is the stall other queues see."""
    started_at = now_iso()
    names = [f"{args.queue}-{i}" for i in range(args.count)]
    target_uri = args.uri
    if args.vhost:
        if not args.api:
            raise SystemExit("delete-stall --vhost needs --api (the management API base URL)")
        user = AMQPClient(args.uri).uri.user
        vq = urllib.parse.quote(args.vhost, safe="")
        _api(args.api, "PUT", f"/api/vhosts/{vq}", {})
        _api(args.api, "PUT", f"/api/permissions/{vq}/{urllib.parse.quote(user, safe='')}",
             {"configure": ".*", "write": ".*", "read": ".*"})
        u = urllib.parse.urlsplit(args.uri)
        target_uri = urllib.parse.urlunsplit((u.scheme, u.netloc, "/" + vq, "", ""))
    with AMQPClient(target_uri).connect() as c:
        t = time.monotonic()
        _declare_many(c, names, args.durable)
        declare_s = time.monotonic() - t
        probe = _ConfirmProbe(args.uri, f"{args.queue}-probe", args.probe_durable)
        probe.start()
        probe.ready.wait(30)
        time.sleep(1.0)  # the probe's round trips before the delete: the baseline
        t0 = time.monotonic()
        if args.vhost:
            c.close()
            _api(args.api, "DELETE", f"/api/vhosts/{vq}")
        else:
            delete_many(c, names)
        t1 = time.monotonic()
    time.sleep(0.5)
    probe.stop.set()
    probe.join(30)
    if probe.error is not None:
        raise probe.error
    before = [rtt for ts, rtt in probe.samples if ts < t0]
    # A publish sent before the delete began but answered during it counts too, and so do the 0.5 s
    # after the reply (the brokers may still be finishing: removing files, reporting stats).
    during = [rtt for ts, rtt in probe.samples if ts + rtt >= t0]
    ms = 1000.0
    extra = {"queues": len(names), "vhost": args.vhost or None, "probe_durable": args.probe_durable,
             "declare_s": round(declare_s, 3),
             "delete_s": round(t1 - t0, 3),
             "deletes_per_s": round(len(names) / (t1 - t0), 1) if t1 > t0 else None,
             "probe_before_p50_ms": round(_percentile(before, 0.5) * ms, 2) if before else None,
             "probe_before_max_ms": round(max(before) * ms, 2) if before else None,
             "probe_during_confirms": len(during),
             "probe_during_p50_ms": round(_percentile(during, 0.5) * ms, 2) if during else None,
             "probe_during_p99_ms": round(_percentile(during, 0.99) * ms, 2) if during else None,
             "worst_stall_ms": round(max(during) * ms, 2) if during else None}
    return _result(args, broker, scenario, started_at, t1 - t0, extra, broker_rss())
