"""``shardmq-perf``: load generator for ShardMQ (and any AMQP 0-9-1 / MQTT 3.1.1 broker).

    shardmq-perf amqp throughput [-x N] [-y N] [-s BYTES] [-c WINDOW] [-a N] [-z S] ...
    shardmq-perf amqp queue-count | connection-count | bind-churn | connection-churn | delete-stall | confirm-rtt
    shardmq-perf amqp sink-ceiling      (the tool's own ceiling against a built-in fake broker)
    shardmq-perf mqtt throughput
    shardmq-perf bench ... | report RESULTS_DIR   (loadtest/bench.py, loadtest/report.py)

Exit status: 0 ok, 1 --verify found loss/duplicates, 2 usage error, 3 broker/connection error.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from loadtest.results import RunResult, broker_rss_bytes, write_run

EXIT_OK, EXIT_VERIFY, EXIT_USAGE, EXIT_ERROR = 0, 1, 2, 3


def _common(p: argparse.ArgumentParser, uri: str) -> None:
    p.add_argument("--uri", default=uri, help=f"broker URI (default {uri})")
    p.add_argument("-z", "--time", type=float, default=0.0, dest="time_s",
                   help="stop after this many seconds (default 10 when no count limit is given)")
    p.add_argument("--json", action="store_true", help="print one JSON object with the results at the end")
    p.add_argument("--results-dir", help="write RESULTS_DIR/<run_id>/{run.json,rates.jsonl,latency.jsonl}")
    p.add_argument("--broker-name", default="shardmq", help="broker label in run.json (default shardmq)")
    p.add_argument("--scenario", help="scenario label in run.json (default: the subcommand)")
    p.add_argument("--broker-pid", type=int, help="report the summed RSS of this pid and its children")


def _throughput_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("-x", "--publishers", type=int, default=1, help="publisher processes (default 1)")
    p.add_argument("-y", "--consumers", type=int, default=1, help="consumer processes (default 1)")
    p.add_argument("-s", "--size", type=int, default=16, help="body size in bytes (default 16)")
    p.add_argument("--persistent", action="store_true", help="delivery-mode 2 and durable queues")
    p.add_argument("-c", "--confirm", type=int, default=0, metavar="WINDOW",
                   help="publisher confirms with at most WINDOW outstanding (default off)")
    p.add_argument("-a", "--ack-every", type=int, default=0, metavar="N",
                   help="manual ack (multiple) every N deliveries; 0 = no-ack (default)")
    p.add_argument("-q", "--prefetch", type=int, default=0, help="basic.qos prefetch count (default none)")
    p.add_argument("--exchange", default="", help="exchange to publish to (default: the default exchange)")
    p.add_argument("--exchange-type", default="direct", help="type when the tool declares --exchange")
    p.add_argument("--routing-key", default="", help="routing key (default: the queue name)")
    p.add_argument("--routing-key-count", type=int, default=1, metavar="N",
                   help="publish round robin over N routing keys of one length (0.KEY .. N-1.KEY, zero-padded), "
                        "all bound to the publisher's queue; needs --exchange (default 1: the routing key)")
    p.add_argument("--queue", default="perf-test", help="queue name (default perf-test)")
    p.add_argument("--queues", type=int, default=1, help="spread over N queues NAME-1..NAME-N (default 1)")
    p.add_argument("--queue-args", type=json.loads, default={}, metavar="JSON", help="queue.declare arguments")
    p.add_argument("--rate", type=int, default=0, help="publish rate limit per publisher, msgs/s")
    p.add_argument("--consume-rate", type=int, default=0, help="consume rate limit per consumer, msgs/s")
    p.add_argument("--pmessages", type=int, default=0, help="each publisher stops after N messages")
    p.add_argument("--cmessages", type=int, default=0, help="each consumer stops after N messages")
    p.add_argument("--verify", action="store_true",
                   help="number messages per publisher; fail (exit 1) on loss or duplicates. When each publish "
                        "reaches every queue (fanout or headers exchange, or one --routing-key binding them all) "
                        "each queue's consumers must get every message once between them")
    p.add_argument("--keep", action="store_true", help="keep the queues/exchange the run declared")
    p.add_argument("--trace-stages", default="", metavar="DIR",
                   help="consumers write the receive time of the traced sample of messages to DIR (run the broker "
                        "with the same --trace-stages DIR; then: python -m loadtest.trace_stages DIR)")


def _heartbeat_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--heartbeat", type=int, default=None, metavar="S",
                   help="heartbeat to ask in tune-ok (default: accept the broker's proposal, as pika does)")


def build_parser() -> argparse.ArgumentParser:
    amqp_uri = "amqp://guest:guest@127.0.0.1:5672/"
    parser = argparse.ArgumentParser(prog="shardmq-perf", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    proto = parser.add_subparsers(dest="protocol", required=True)

    amqp = proto.add_parser("amqp", help="AMQP 0-9-1 scenarios").add_subparsers(dest="command", required=True)
    p = amqp.add_parser("throughput", help="publish/consume throughput and end-to-end latency")
    _common(p, amqp_uri)
    _throughput_flags(p)
    p.add_argument("--sink", action="store_true",
                   help="ignore --uri: run against the built-in fake broker (the tool's own ceiling)")

    p = amqp.add_parser("sink-ceiling", help="the highest rates the tool drives (against a built-in fake broker)")
    _common(p, amqp_uri)
    _throughput_flags(p)

    p = amqp.add_parser("queue-count", help="declare N queues; report time and broker RSS")
    _common(p, amqp_uri)
    p.add_argument("-n", "--count", type=int, default=1000, help="queues to declare (default 1000)")
    p.add_argument("--queue", default="perf-qc", help="queue name prefix (default perf-qc)")
    p.add_argument("--durable", action="store_true")
    p.add_argument("--keep", action="store_true", help="keep the queues")

    p = amqp.add_parser("delete-stall",
                        help="delete N queues (or a vhost of N queues) while a confirming publisher on "
                             "another queue measures its worst confirm round trip")
    _common(p, amqp_uri)
    p.add_argument("-n", "--count", type=int, default=10000, help="queues to declare, then delete (default 10000)")
    p.add_argument("--queue", default="perf-del", help="queue name prefix (default perf-del)")
    p.add_argument("--durable", action="store_true", help="durable queues")
    p.add_argument("--vhost", default="", help="declare the queues in this vhost and delete the vhost "
                   "(through --api) instead of the queues")
    p.add_argument("--api", default="", help="management API base URL with credentials, for --vhost "
                   "(e.g. http://guest:guest@127.0.0.1:15672)")
    p.add_argument("--probe-durable", action="store_true",
                   help="the probe publishes persistent messages to a durable queue (its confirms then wait "
                        "for an fsync) instead of transient ones")

    p = amqp.add_parser("confirm-rtt",
                        help="one publisher with confirms, one message in flight: its confirm round trips")
    _common(p, amqp_uri)
    p.add_argument("--queue", default="perf-rtt", help="queue the probe declares, then deletes (default perf-rtt)")
    p.add_argument("--durable", action="store_true",
                   help="persistent messages to a durable queue (each confirm then waits for an fsync)")

    p = amqp.add_parser("connection-count", help="open N idle connections; report broker RSS")
    _common(p, amqp_uri)
    p.add_argument("-n", "--count", type=int, default=100, help="connections to open (default 100)")
    p.add_argument("--hold", type=float, default=0.0, help="keep them open this many seconds")
    p.add_argument("-c", "--concurrency", type=int, default=100,
                   help="handshakes in flight while opening (default 100)")
    _heartbeat_flag(p)

    p = amqp.add_parser("bind-churn", help="queue.bind + queue.unbind per second")
    _common(p, amqp_uri)
    p.add_argument("--exchange", default="perf-churn", help="exchange the tool declares (default perf-churn)")
    p.add_argument("--queue", default="perf-churn", help="queue the tool declares (default perf-churn)")

    p = amqp.add_parser("connection-churn", help="connections opened+closed per second")
    _common(p, amqp_uri)
    p.add_argument("-x", "--parallel", type=int, default=1, help="churning processes (default 1)")
    p.add_argument("-c", "--concurrency", type=int, default=10,
                   help="open+close loops per process, each one connection at a time (default 10)")
    _heartbeat_flag(p)

    # listed for --help only: main() hands these to loadtest.bench / loadtest.report before parsing
    proto.add_parser("bench", add_help=False, help="side-by-side ShardMQ vs RabbitMQ scenarios (bench --help)")
    proto.add_parser("report", add_help=False, help="Spark report over a results dir (report --help)")
    proto.add_parser("memory", add_help=False,
                     help="RSS, PSS and USS per process of a broker's process tree (memory --help)")

    mqtt = proto.add_parser("mqtt", help="MQTT 3.1.1 scenarios").add_subparsers(dest="command", required=True)
    p = mqtt.add_parser("throughput", help="MQTT publish/subscribe throughput (QoS 0/1)")
    _common(p, "mqtt://127.0.0.1:1883")
    p.add_argument("-x", "--publishers", type=int, default=1)
    p.add_argument("-y", "--consumers", type=int, default=1)
    p.add_argument("-s", "--size", type=int, default=16)
    p.add_argument("--qos", type=int, choices=(0, 1), default=0)
    p.add_argument("--topic", default="perf/test")
    p.add_argument("--rate", type=int, default=0, help="publish rate limit per publisher, msgs/s")
    p.add_argument("--pmessages", type=int, default=0)
    p.add_argument("--cmessages", type=int, default=0)
    p.add_argument("--verify", action="store_true")
    return parser


class Progress:
    """A one-line rich live display; a no-op when disabled."""

    def __init__(self, enabled: bool) -> None:
        self.live: Any = None
        if enabled:
            from rich.console import Console
            from rich.live import Live

            self.live = Live("", console=Console(), transient=True, refresh_per_second=4)

    def __enter__(self) -> Progress:
        if self.live:
            self.live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live:
            self.live.__exit__(*exc)

    def update(self, st: dict[str, Any]) -> None:
        if not self.live:
            return
        last = st.get("rates")
        rate = f"  pub {last[0][1]:,}/s  con {last[0][2]:,}/s" if last else ""
        self.live.update(f"[bold]{st['elapsed']:6.1f}s[/]  published {st['published']:,}  "
                         f"confirmed {st.get('confirmed', 0):,}  consumed {st['consumed']:,}{rate}")


def _finish(args: argparse.Namespace, result: RunResult, human: Callable[[], None],
            extra_json: dict[str, Any] | None = None) -> None:
    if args.results_dir:
        path = write_run(args.results_dir, result)
        if not args.json:
            print(f"results       {path}")
    if args.json:
        d = result.to_json()
        d.update(extra_json or {})
        print(json.dumps(d))
    else:
        human()


def _throughput_opts(args: argparse.Namespace) -> Any:
    from loadtest.amqp_throughput import ThroughputOptions

    return ThroughputOptions(
        uri=args.uri, publishers=args.publishers, consumers=args.consumers, size=args.size,
        persistent=args.persistent, confirm=args.confirm, ack_every=args.ack_every, prefetch=args.prefetch,
        exchange=args.exchange, exchange_type=args.exchange_type, routing_key=args.routing_key,
        routing_key_count=args.routing_key_count, queue=args.queue, queues=args.queues, queue_args=args.queue_args,
        rate=args.rate, consume_rate=args.consume_rate, pmessages=args.pmessages, cmessages=args.cmessages,
        time_s=args.time_s, verify=args.verify, keep=args.keep, trace_stages=args.trace_stages)


def cmd_amqp_throughput(args: argparse.Namespace, *, sink: bool = False) -> int:
    from loadtest.amqp_throughput import ThroughputRun, print_human
    from loadtest.sink import SinkProcess

    opts = _throughput_opts(args)
    sink_proc = None
    if sink:
        sink_proc = SinkProcess("flood" if not opts.verify else "relay", flood_size=opts.size).start()
        opts.uri = sink_proc.uri
        if args.broker_name == "shardmq":
            args.broker_name = "sink"
    try:
        run = ThroughputRun(opts, broker=args.broker_name, scenario=args.scenario or f"amqp-{args.command}",
                            broker_rss=lambda: broker_rss_bytes(args.broker_pid))
        with Progress(not args.json and sys.stdout.isatty()) as progress:
            run.progress = progress.update
            result = run.run()
    finally:
        if sink_proc:
            sink_proc.stop()
    extra: dict[str, Any] = {}
    if run.verify is not None:
        extra["verify"] = run.verify.to_json()
    if run.errors:
        extra["errors"] = run.errors
    _finish(args, result, lambda: print_human(result, run.verify), extra)
    for e in run.errors:
        print(f"error: {e}", file=sys.stderr)
    if run.errors:
        return EXIT_ERROR
    if run.verify is not None and not run.verify.ok:
        return EXIT_VERIFY
    return EXIT_OK


def cmd_scenario(args: argparse.Namespace) -> int:
    from loadtest import scenarios_amqp

    fn = {"queue-count": scenarios_amqp.queue_count, "connection-count": scenarios_amqp.connection_count,
          "bind-churn": scenarios_amqp.bind_churn, "connection-churn": scenarios_amqp.connection_churn,
          "delete-stall": scenarios_amqp.delete_stall, "confirm-rtt": scenarios_amqp.confirm_rtt}[args.command]
    result = fn(args, broker=args.broker_name, scenario=args.scenario or f"amqp-{args.command}",
                broker_rss=lambda: broker_rss_bytes(args.broker_pid))

    def human() -> None:
        for k, v in (result.extra or {}).items():
            print(f"{k:<22}{v}")
        if result.broker_rss_bytes is not None:
            print(f"{'broker_rss_bytes':<22}{result.broker_rss_bytes}")

    _finish(args, result, human)
    return EXIT_OK


def cmd_mqtt_throughput(args: argparse.Namespace) -> int:
    from loadtest import mqtt_throughput

    with Progress(not args.json and sys.stdout.isatty()) as progress:
        result, verify, errors = mqtt_throughput.run(
            args, broker=args.broker_name, scenario=args.scenario or "mqtt-throughput",
            broker_rss=lambda: broker_rss_bytes(args.broker_pid), progress=progress.update)
    from loadtest.amqp_throughput import print_human

    extra: dict[str, Any] = {}
    if verify is not None:
        extra["verify"] = verify.to_json()
    if errors:
        extra["errors"] = errors
    _finish(args, result, lambda: print_human(result, verify), extra)
    for e in errors:
        print(f"error: {e}", file=sys.stderr)
    if errors:
        return EXIT_ERROR
    return EXIT_VERIFY if verify is not None and not verify.ok else EXIT_OK


def main(argv: list[str] | None = None) -> int:
    from loadtest.amqp_client import AMQPClosed

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["bench"], ["report"], ["memory"]):  # the bench, the Spark report, a tree's memory
        import importlib

        return int(importlib.import_module(f"loadtest.{argv[0]}").main(argv[1:]) or 0)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.protocol == "amqp" and args.command == "throughput":
            return cmd_amqp_throughput(args, sink=args.sink)
        if args.protocol == "amqp" and args.command == "sink-ceiling":
            return cmd_amqp_throughput(args, sink=True)
        if args.protocol == "amqp":
            return cmd_scenario(args)
        return cmd_mqtt_throughput(args)
    except ValueError as exc:
        print(f"shardmq-perf: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (AMQPClosed, OSError, RuntimeError) as exc:
        print(f"shardmq-perf: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
