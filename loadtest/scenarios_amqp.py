"""AMQP scenarios other than throughput: queue-count, connection-count, bind-churn, connection-churn,
delete-stall.

Each returns a RunResult whose ``extra`` holds the scenario's own measurements; everything it
declares is deleted again (unless --keep), and every loop is bounded by a count or -z seconds.
"""

from __future__ import annotations

import argparse
import base64
import json
import multiprocessing
import resource
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any

from pamqp import commands

from broker.amqp import events
from loadtest.amqp_client import AMQPClient, AMQPClosed
from loadtest.results import RunResult, now_iso

RssFn = Callable[[], int | None]


def _raise_nofile(want: int) -> None:
    """Idle-connection counts need file descriptors: lift the soft limit toward the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


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


def _settled_rss(broker_rss: RssFn, settle_s: float, samples: int = 3, gap_s: float = 0.2) -> list[int] | None:
    """``samples`` RSS readings ``gap_s`` apart after ``settle_s``: a single reading right after the
    last handshake misses memory the broker has yet to fault in and jitters with its GC/allocator."""
    time.sleep(settle_s)
    got: list[int] = []
    for i in range(samples):
        if i:
            time.sleep(gap_s)
        rss = broker_rss()
        if rss is None:
            return None
        got.append(rss)
    return got


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


def connection_count(args: argparse.Namespace, *, broker: str, scenario: str, broker_rss: RssFn,
                     settle_s: float = 1.0) -> RunResult:
    """Open ``--count`` idle connections (handshake + channel), report RSS, hold, close them all.

    RSS is sampled (max of 3, 0.2 s apart) before the first connection and again ``settle_s``
    after the last one completed its handshake; ``rss_after_bytes`` is the total with N open.
    """
    _raise_nofile(args.count + 256)
    started_at = now_iso()
    conns: list[AMQPClient] = []
    rss_before = _settled_rss(broker_rss, 0.0)
    t0 = time.monotonic()
    deadline = t0 + (args.time_s or 600)
    try:
        for _ in range(args.count):
            conns.append(AMQPClient(args.uri).connect())  # returns after connection + channel open-ok
            if time.monotonic() > deadline:
                break
        open_s = time.monotonic() - t0
        rss_after = _settled_rss(broker_rss, settle_s)
        held = settle_s + 0.4
        time.sleep(max(0.0, min(args.hold, args.time_s or args.hold) - held))
    finally:
        for c in conns:
            try:
                c.close()
            except OSError:
                pass
    extra = {"connections": len(conns), "open_s": round(open_s, 4),
             "connections_per_s": round(len(conns) / open_s, 1) if open_s else None,
             **rss_growth(rss_before, rss_after, len(conns))}
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


def _churn_worker(uri: str, duration: float, counter: Any, errors: Any) -> None:
    t0 = time.monotonic()
    n = 0
    while time.monotonic() - t0 < duration:
        try:
            AMQPClient(uri).connect().close()
            n += 1
            counter.value = n
        except (AMQPClosed, OSError):
            errors.value += 1
            time.sleep(0.01)


def connection_churn(args: argparse.Namespace, *, broker: str, scenario: str, broker_rss: RssFn) -> RunResult:
    """Connections opened (full handshake + channel.open) and closed per second, in -x processes."""
    duration = args.time_s or 10.0
    ctx = multiprocessing.get_context("fork")
    counters = [ctx.RawValue("q", 0) for _ in range(args.parallel)]
    errs = [ctx.RawValue("q", 0) for _ in range(args.parallel)]
    started_at = now_iso()
    procs = [ctx.Process(target=_churn_worker, args=(args.uri, duration, counters[i], errs[i]), daemon=True)
             for i in range(args.parallel)]
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
    extra = {"connections": total, "connections_per_s": round(total / took, 1),
             "errors": sum(e.value for e in errs)}
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


def _declare_many(c: AMQPClient, names: list[str], durable: bool) -> None:
    for start in range(0, len(names), 500):
        chunk = names[start : start + 500]
        c.send(b"".join(_encode(commands.Queue.Declare(queue=q, durable=durable)) for q in chunk))
        for _ in chunk:
            c._wait_method(1, commands.Queue.DeclareOk)


class _ConfirmProbe(threading.Thread):
    """One publisher with confirms, one message in flight, on its own connection: (send time, round
    trip) of every publish until stopped. A stall anywhere on its path shows as one long round trip."""

    def __init__(self, uri: str, queue: str) -> None:
        super().__init__(daemon=True)
        self.uri, self.queue = uri, queue
        self.samples: list[tuple[float, float]] = []
        self.stop = threading.Event()
        self.ready = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        from broker.amqp import encoder

        try:
            with AMQPClient(self.uri).connect() as c:
                c.queue_declare(self.queue)
                c.confirm_select()
                frame = encoder.encode_publish(1, "", self.queue, False, b"\x00\x00", b"p" * 16, c.frame_max)
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
        probe = _ConfirmProbe(args.uri, f"{args.queue}-probe")
        probe.start()
        probe.ready.wait(30)
        time.sleep(1.0)  # the probe's round trips before the delete: the baseline
        t0 = time.monotonic()
        if args.vhost:
            c.close()
            _api(args.api, "DELETE", f"/api/vhosts/{vq}")
        else:
            for start in range(0, len(names), 500):
                chunk = names[start : start + 500]
                c.send(b"".join(_encode(commands.Queue.Delete(queue=q)) for q in chunk))
                for _ in chunk:
                    c._wait_method(1, commands.Queue.DeleteOk)
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
    extra = {"queues": len(names), "vhost": args.vhost or None, "declare_s": round(declare_s, 3),
             "delete_s": round(t1 - t0, 3),
             "deletes_per_s": round(len(names) / (t1 - t0), 1) if t1 > t0 else None,
             "probe_before_p50_ms": round(_percentile(before, 0.5) * ms, 2) if before else None,
             "probe_before_max_ms": round(max(before) * ms, 2) if before else None,
             "probe_during_confirms": len(during),
             "probe_during_p50_ms": round(_percentile(during, 0.5) * ms, 2) if during else None,
             "probe_during_p99_ms": round(_percentile(during, 0.99) * ms, 2) if during else None,
             "worst_stall_ms": round(max(during) * ms, 2) if during else None}
    return _result(args, broker, scenario, started_at, t1 - t0, extra, broker_rss())
