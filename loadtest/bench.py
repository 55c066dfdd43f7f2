"""Side-by-side benchmark: the same perf scenarios against a ShardMQ node and a private RabbitMQ.

    shardmq-perf bench [--scenarios a,b] [--repeats 3] [--results-dir DIR] [--shardmq-args "..."]
    python -m loadtest.bench ...

Runs every scenario ``--repeats`` times against each broker in alternation (ShardMQ, RabbitMQ,
ShardMQ, ...) so slow drift of the machine hits both alike, by invoking the perf tool once per run
(``python -m loadtest.cli amqp ...``). Only the measured broker runs: each run starts its broker on
free loopback ports from an empty temp dir and stops it (by pid, whole tree) when the run ends, before
the other broker starts. An idle broker left running is not idle on a small host (an idle RabbitMQ
used 40-50% of one of 2 cores while ShardMQ was measured: the Erlang schedulers' busy-wait and its
periodic stats), and it holds memory. Restarting was chosen over SIGSTOP/SIGCONT of the other tree:
nothing has to survive a pause (an Erlang VM that wakes to a time jump, timers and heartbeats of
whatever connection is still open, a pause landing mid-shutdown of a worker), and every run starts
from the same empty broker, whatever the runs before it left behind (queues, a backlog, a grown
heap). It costs a broker boot per run (seconds; RabbitMQ's is the longer). Then it aggregates with the Spark report and rewrites
docs/benchmarks.md: the report is merged into docs/benchmarks/results.json (a run of some scenarios
keeps the others' latest numbers; loadtest/bench_doc.py), the plots are redrawn into
docs/benchmarks/ and the page embeds them with the table, the machine and the command. A SIGTERM or Ctrl-C still stops the running broker by pid.

Each run directory the perf tool writes gets a ``bench.json`` (RUN_RECORD) naming the bench invocation
(id, command, commit) and the run's start, end and load average, so ``--from-results`` names the runs
as they were measured even after the checkout moved on or run directories were copied elsewhere. One
invocation is reported at a time: a ``--results-dir`` holding another invocation's runs is refused
unless ``--append``, and ``--from-results`` over several invocations wants ``--invocation ID``.

A ShardMQ run ends when the node has also removed the directories of the queues it deleted (its shards'
reapers do that after the delete-ok; ``ShardMQNode.settle``), so that work is counted in the run that
caused it and never overlaps the next broker's run; ``bench.json`` says how long that took (``settle_s``).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import platform
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from broker.process import raise_nofile_limit
from loadtest import bench_doc
from loadtest.ports import free_port
from loadtest.rabbitmq import PrivateRabbitMQ, package_version
from loadtest.results import list_runs
from shard.segment_dir import TRASH_PREFIX

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DOC = ROOT / "docs" / "benchmarks.md"
DURATION = "{duration}"  # placeholder in scenario argv, replaced by --duration
LATENCY_RATES = (1_000, 10_000, 50_000)  # msg/s of the fixed-rate latency scenarios
SETTLE_TIMEOUT_S = 300.0  # at most this long for a node to remove deleted queues' directories after a run


# Why the brokers are started in their own process group but not their own session: with the
# kernel's autogroup scheduling (sched_autogroup_enabled, on in most distributions) every session
# is one scheduling group that gets one share of the CPU. A broker in a session of its own then
# competed as one group against the perf tool's group (and every other session on the host): a
# 5-process ShardMQ node got about as much CPU as the perf tool's publisher and consumer, the
# publisher ran ahead of the broker and the queue grew (persistent-confirm scenario, 6 alternating
# pairs at load 4.5-6: end-to-end p99 77-1,287 ms in an own session, 54-176 ms in the tool's).
# In one session the broker's threads and the perf tool's share the cores per thread, as without
# autogroup; both brokers are started the same way.
BROKER_SPAWN = {"process_group": 0}


@dataclass(frozen=True)
class Scenario:
    name: str
    argv: tuple[str, ...]  # perf tool arguments after `amqp` (subcommand first)
    measures: str  # what the run's numbers mean, for the doc
    prefill: tuple[str, ...] = ()  # unmeasured perf run before argv (e.g. fill a backlog)
    timeout_s: float = 240.0
    by_default: bool = True  # False: only run when named in --scenarios (too long for every bench)


# Every scenario is bounded: throughput runs by --time (D = --duration), count-bounded runs by a
# --time cap so a slow broker shows up as fewer done in the cap rather than a run that never ends.
SCENARIOS: tuple[Scenario, ...] = (
    Scenario("1p1c-16b-transient-autoack",
             ("throughput", "--publishers", "1", "--consumers", "1", "--size", "16", "--time", DURATION),
             "1 publisher, 1 no-ack consumer, 16 B transient messages, one queue: msgs/s and end-to-end latency"),
    Scenario("publish-only-16b",
             ("throughput", "--publishers", "1", "--consumers", "0", "--size", "16", "--time", DURATION),
             "1 publisher, no consumer, 16 B transient: ingest rate into a growing queue"),
    Scenario("consume-only-drain-1m",
             ("throughput", "--publishers", "0", "--consumers", "1", "--queue", "bench-drain",
              "--cmessages", "1000000", "--time", "60"),
             "a 1M-message backlog (16 B, filled unmeasured beforehand) drained by 1 no-ack consumer: "
             "consume msgs/s = 1M / drain time",
             prefill=("throughput", "--publishers", "1", "--consumers", "0", "--size", "16", "--queue",
                      "bench-drain", "--pmessages", "1000000", "--time", "60", "--keep")),
    Scenario("1p1c-1kib-persistent-confirm1000-ack-prefetch1000",
             ("throughput", "--publishers", "1", "--consumers", "1", "--size", "1024", "--persistent",
              "--confirm", "1000", "--ack-every", "1", "--prefetch", "1000", "--time", DURATION),
             "1 KiB persistent messages into a durable queue, publisher confirms (1000 outstanding), "
             "consumer acks every message with prefetch 1000"),
    Scenario("4p4c-16b-4queues",
             ("throughput", "--publishers", "4", "--consumers", "4", "--size", "16", "--queues", "4",
              "--time", DURATION),
             "4 publishers and 4 no-ack consumers over 4 queues, 16 B transient"),
    Scenario("fanout-4queues",
             ("throughput", "--publishers", "1", "--consumers", "4", "--size", "16", "--queues", "4",
              "--exchange", "bench-fanout", "--exchange-type", "fanout", "--time", DURATION),
             "1 publisher to a fanout exchange bound to 4 queues, 1 no-ack consumer per queue "
             "(consume rate counts every copy)"),
    Scenario("idle-connections-1000",
             ("connection-count", "--count", "1000", "--hold", "5", "--time", "60"),
             "1000 idle AMQP connections held 5 s: broker RSS"),
    Scenario("idle-connections-10000",
             ("connection-count", "--count", "10000", "--hold", "10", "--time", "300"),
             "10,000 idle AMQP connections (handshake + channel.open, heartbeat as the broker proposes) opened "
             "from one asyncio process 100 at a time, held 10 s: the broker's whole-tree RSS and PSS before and "
             "with them, per connection = growth / 10,000",
             timeout_s=600.0),
    Scenario("connection-churn",
             ("connection-churn", "--concurrency", "20", "--time", DURATION),
             "20 concurrent loops (one asyncio process) each opening a connection (TCP, handshake, "
             "channel.open) and closing it (connection.close, close-ok, socket closed): connections/s"),
    Scenario("queues-10000",
             ("queue-count", "--count", "10000", "--time", "60"),
             "declare 10000 queues (capped at 60 s; `queues` shows how many were declared): time, declares/s, RSS"),
    Scenario("queues-20000-durable",
             ("queue-count", "--count", "20000", "--durable", "--time", "120"),
             "declare 20000 durable queues on one channel (capped at 120 s): declares/s overall, in the first "
             "and the last 10% (flat = no growth with the number of queues), then deletes/s",
             timeout_s=400.0),
    Scenario("queues-20000-transient",
             ("queue-count", "--count", "20000", "--time", "120"),
             "the same with transient queues", timeout_s=400.0),
    Scenario("delete-stall-30000",
             ("delete-stall", "--count", "30000", "--time", "300"),
             "declare 30,000 transient queues, then delete them (pipelined queue.delete, 500 in flight) while a "
             "confirming publisher on another queue (one message in flight) times its round trips: worst and "
             "p99 round trip during the delete (`worst_stall_ms`, `probe_during_p99_ms`)",
             timeout_s=600.0),
    Scenario("delete-stall-100000",
             ("delete-stall", "--count", "100000", "--time", "900"),
             "the same with 100,000 transient queues deleted one by one through AMQP (pipelined queue.delete, "
             "500 in flight): the probe's worst and p99 round trip while they go (ShardMQ paces deletions at "
             "--delete-rate, 2,000/s by default: ~50 s; RabbitMQ ~2 min; ~6 min a repeat with the declares, "
             "so it runs only when named)",
             timeout_s=1800.0, by_default=False),
    Scenario("confirm-rtt-transient",
             ("confirm-rtt", "--time", DURATION),
             "one publisher with confirms and one 16 B transient message in flight (a synchronous publisher, "
             "as pika's BlockingConnection with confirm_delivery): confirm round trip p50/p99, confirms/s"),
    Scenario("confirm-rtt-persistent",
             ("confirm-rtt", "--durable", "--time", DURATION),
             "the same with persistent messages to a durable queue: each confirm waits for the disk"),
    Scenario("bindings-per-second",
             ("bind-churn", "--time", DURATION),
             "queue.bind + queue.unbind round trips on one channel: bindings/s"),
    *(Scenario(f"latency-{rate // 1000}k-{'autoack' if not ack else 'ack'}",
               ("throughput", "--publishers", "1", "--consumers", "1", "--size", "16", "--rate", str(rate),
                *(("--ack-every", "1", "--prefetch", "1000") if ack else ()), "--time", DURATION),
               f"1P/1C 16 B at a steady {rate:,} msg/s ({'manual ack of every message, prefetch 1000' if ack else 'no-ack'}):"
               " end-to-end latency p50/p99 at a rate both brokers sustain")
      for rate in LATENCY_RATES for ack in (False, True)),
)
BY_NAME = {s.name: s for s in SCENARIOS}


# --------------------------------------------------------------------------- brokers


class ShardMQNode:
    """``python -m broker.cli --data-dir TMP --port FREE` (the checkout's code)`; the node pid's tree is the broker."""

    name = "shardmq"

    def __init__(self, extra_args: list[str], start_timeout: float = 60.0) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="bench-shardmq-"))
        self.port = free_port()
        self.extra_args = extra_args
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self.version = _git_commit()

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}/%2F"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> ShardMQNode:
        # `python -m broker.cli` from this checkout, not the `shardmq` console script: worktrees share
        # one venv whose script imports whichever tree it was installed from.
        # Every listener the defaults turn on runs (they are part of the node a user gets, and of its
        # RSS), each on a free port so the bench never collides with another node on this host.
        ports = [(flag, str(free_port())) for flag in ("--mqtt-port", "--ws-port", "--http-port", "--prometheus-port")]
        self.http_port = int(dict(ports)["--http-port"])
        cmd = [sys.executable, "-m", "broker.cli", "--data-dir", str(self.dir / "data"), "--bind", "127.0.0.1",
               "--port", str(self.port), *(a for pair in ports for a in pair), *self.extra_args]
        log = open(self.dir / "node.log", "wb")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                     **BROKER_SPAWN)
        log.close()
        try:
            _wait_amqp(self.url, self.start_timeout, lambda: self.proc.poll() is None, self.log_tail)
        except BaseException:
            self.stop()
            raise
        return self

    def log_tail(self, n: int = 2000) -> str:
        try:
            return (self.dir / "node.log").read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def queue_dirs(self) -> tuple[int, int]:
        """(queue directories, trash directories) in the node's data dir: ``<data>/<sha1 vhost>/<sha1 queue>/``
        per queue, and ``deleted-*`` beside them while a shard's reaper removes deleted queues' directories
        (shard/segment_dir.py)."""
        queues = trash = 0
        try:
            vhosts = [e for e in os.scandir(self.dir / "data") if e.is_dir() and _is_sha1(e.name)]
        except FileNotFoundError:
            return 0, 0
        for vhost in vhosts:
            try:
                for e in os.scandir(vhost.path):
                    if e.name.startswith(TRASH_PREFIX):
                        trash += 1
                    elif e.is_dir() and _is_sha1(e.name):
                        queues += 1
            except FileNotFoundError:  # a deleted vhost's directory, gone meanwhile
                continue
        return queues, trash

    def queue_count(self) -> int:
        """The node's queues (management API ``object_totals``)."""
        req = urllib.request.Request(f"http://127.0.0.1:{self.http_port}/api/overview",
                                     headers={"Authorization": "Basic " + base64.b64encode(b"guest:guest").decode()})
        with urllib.request.urlopen(req, timeout=10) as resp:
            return int(json.loads(resp.read())["object_totals"]["queues"])

    def settle(self, timeout: float = SETTLE_TIMEOUT_S) -> dict:
        """Wait until the node has removed the directories of the queues the run deleted: its shards'
        reapers do that after the delete-ok (a niced ``rm -rf``), and 20,000 of them take seconds, which
        would otherwise overlap whatever the host does next (the next broker's boot and run, on the same
        disk). Done = no trash directory left and no queue directory but the node's queues'. What it
        found, and how long it waited, goes into the run's RUN_RECORD."""
        started = time.monotonic()
        deadline = started + timeout
        while True:
            queues, trash = self.queue_dirs()
            try:
                live = self.queue_count()
            except (OSError, ValueError, KeyError):
                live = None
            done = trash == 0 and live is not None and queues <= live
            if done or time.monotonic() >= deadline:
                return {"reaped": done, "settle_s": round(time.monotonic() - started, 3),
                        "queue_dirs": queues, "trash_dirs": trash, "queues": live}
            time.sleep(0.1)

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # the node stops its workers, then exits
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        _kill_group_leftovers(self.proc)
        self.proc = None
        shutil.rmtree(self.dir, ignore_errors=True)


def _is_sha1(name: str) -> bool:
    return len(name) == 40 and all(c in "0123456789abcdef" for c in name)


def _kill_group_leftovers(proc: subprocess.Popen[bytes] | None) -> None:
    """A worker that outlived its node (the node was SIGKILLed) would keep running into the next run:
    the node was started in its own process group, so its group id is its pid."""
    if proc is None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class RabbitMQBroker:
    name = "rabbitmq"

    def __init__(self) -> None:
        self.node = PrivateRabbitMQ()

    @property
    def url(self) -> str:
        return self.node.url

    @property
    def pid(self) -> int | None:
        return self.node.pid

    @property
    def version(self) -> str | None:
        return self.node.server_version or package_version()

    def start(self) -> RabbitMQBroker:
        self.node.start()
        return self

    def stop(self) -> None:
        self.node.stop()


def _wait_amqp(url: str, timeout: float, alive, log_tail) -> None:  # noqa: ANN001
    """Ready = an AMQP handshake succeeds (a listening socket alone can precede readiness)."""
    import pika

    params = pika.URLParameters(url)
    params.connection_attempts = 1
    params.socket_timeout = 2
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError(f"broker exited while starting: {log_tail()}")
        try:
            pika.BlockingConnection(params).close()
            return
        except Exception as e:  # still starting
            last = e
            time.sleep(0.3)
    raise RuntimeError(f"broker at {url} not ready after {timeout:.0f}s ({last}): {log_tail()}")


# --------------------------------------------------------------------------- runs


@dataclass
class RunOutcome:
    scenario: str
    broker: str
    repeat: int
    ok: bool
    seconds: float
    detail: str = ""
    load1: float | None = None  # the host's 1-minute load average when the run started


def scenario_argv(s: Scenario, args: tuple[str, ...], duration: float) -> list[str]:
    return [f"{duration:g}" if a == DURATION else a for a in args]


def perf_command(args: list[str], url: str) -> list[str]:
    return [sys.executable, "-m", "loadtest.cli", "amqp", args[0], "--uri", url, *args[1:]]


def run_perf(cmd: list[str], timeout: float, log: Path) -> tuple[int, str]:
    with open(log, "ab") as out:
        out.write(("$ " + shlex.join(cmd) + "\n").encode())
        out.flush()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, timeout=timeout)
        except subprocess.TimeoutExpired:
            return -1, f"timed out after {timeout:.0f}s"
    text = log.read_text(errors="replace").splitlines()
    return proc.returncode, " / ".join(text[-3:])


def run_one(s: Scenario, broker, repeat: int, results_dir: Path, duration: float, log: Path,  # noqa: ANN001
            invocation: dict | None = None) -> RunOutcome:
    """One perf run (after its unmeasured prefill). The run directory it writes gets a RUN_RECORD:
    ``invocation`` (the bench's id, command, commit) plus this run's own times and load average."""
    before = set(list_runs(results_dir))
    started_at = datetime.now(UTC)
    started = time.monotonic()
    load1 = os.getloadavg()[0]
    ok, detail = False, "interrupted"
    settled: dict = {}
    try:
        ok, detail = _perf(s, broker, results_dir, duration, log)
        settle = getattr(broker, "settle", None)  # ShardMQ: its reaper's work is part of the run, not the next one's
        if settle is not None:
            settled = settle()
            if not settled["reaped"]:
                print(f"  {s.name}: the node had not removed its deleted queues' directories after "
                      f"{settled['settle_s']:.0f} s: {settled}", file=sys.stderr)
    finally:
        if invocation is not None:
            record = {**invocation, "broker": broker.name, "broker_version": broker.version, "repeat": repeat,
                      "started_at": started_at.isoformat(), "ended_at": datetime.now(UTC).isoformat(),
                      "load1_start": round(load1, 2), "load1_end": round(os.getloadavg()[0], 2), **settled}
            for run_dir in set(list_runs(results_dir)) - before:
                (run_dir / RUN_RECORD).write_text(json.dumps(record, indent=2) + "\n")
    return RunOutcome(s.name, broker.name, repeat, ok, time.monotonic() - started, detail, load1)


def _perf(s: Scenario, broker, results_dir: Path, duration: float, log: Path) -> tuple[bool, str]:  # noqa: ANN001
    """The perf tool's prefill (if any) and measured run: (ok, what failed)."""
    if s.prefill:
        scratch = results_dir / "_prefill"
        cmd = perf_command(scenario_argv(s, s.prefill, duration), broker.url) + [
            "--json", "--results-dir", str(scratch), "--broker-name", broker.name, "--scenario", s.name + "-prefill"]
        rc, tail = run_perf(cmd, s.timeout_s, log)
        if rc != 0:
            return False, f"prefill: {tail}"
    cmd = perf_command(scenario_argv(s, s.argv, duration), broker.url) + [
        "--json", "--results-dir", str(results_dir), "--broker-name", broker.name, "--scenario", s.name]
    if broker.pid:
        cmd += ["--broker-pid", str(broker.pid)]
    rc, tail = run_perf(cmd, s.timeout_s, log)
    return rc == 0, "" if rc == 0 else tail


# --------------------------------------------------------------------------- machine and doc


def _git_commit() -> str | None:
    out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True, check=False)
    return out.stdout.strip() or None


def machine_info(rabbitmq_version: str | None = None) -> dict[str, str]:
    cpu = "unknown"
    mem = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = f"{int(line.split()[1]) / 1048576:.1f} GiB"
                break
    except OSError:
        pass
    return {
        "nproc": str(os.cpu_count()),
        "CPU": cpu,
        "RAM": mem,
        "kernel": platform.release(),
        "Python": platform.python_version(),
        "RabbitMQ": rabbitmq_version or package_version() or "not installed",
        "ShardMQ commit": _git_commit() or "unknown",
    }


def render_doc(machine: dict[str, str], command: str, table: str | None, when: str | None,
               failures: list[RunOutcome], results_dir: str | None, notes: list[str] | None = None,
               results: list[str] | None = None) -> str:
    """The whole benchmarks page; ``notes`` are extra lines printed above the results table;
    ``results`` (bench_doc.results_section: merged runs, plots, table) replaces ``table``."""
    lines = [
        "# Benchmarks: ShardMQ vs RabbitMQ",
        "",
        "Generated by `shardmq-perf bench` (loadtest/bench.py); the table is the Spark report",
        "(loadtest/report.py) of the runs. Re-running the command below rewrites this file.",
        "",
        "## Reproduce",
        "",
        "```sh",
        command,
        "```",
        "",
        "(`python -m loadtest.bench` takes the same arguments; without `--scenarios` it runs every scenario",
        "below but those marked \"only when named\", and `--from-results DIR` re-renders this page from the runs already in DIR.)",
        "Each run's directory records the bench invocation that made it (`bench.json`: command, commit, the",
        "run's start, end and load average), and the page names the invocation from those records. A",
        "`--results-dir` that already holds another invocation's runs is refused unless `--append` (the report",
        "and the page then use the new invocation's runs only); `--from-results` renders one invocation",
        "(`--invocation ID` when DIR holds several).",
        "",
        "Both brokers run on the same host on free loopback ports, each from an empty temp dir: ShardMQ as",
        "`python -m broker.cli --data-dir TMP --port FREE` (the checkout's code), RabbitMQ as Debian's `rabbitmq-server` with its own",
        "mnesia/log dirs, node name and epmd. Every scenario runs `--repeats` times per broker, alternating",
        "ShardMQ, RabbitMQ, ShardMQ, ... Each run is one `python -m loadtest.cli amqp ...` invocation against",
        "a broker started for that run and stopped after it: only the measured broker runs. Brokers run in",
        "their own process group inside the bench's session (one autogroup with the perf tool; see",
        "`BROKER_SPAWN` in loadtest/bench.py). A ShardMQ node is stopped only once it has removed the",
        "directories of the queues the run deleted (`bench.json`'s `settle_s`), so that removal never overlaps",
        "the next run.",
        "",
        "## Machine",
        "",
        "| | |",
        "|---|---|",
    ]
    lines += [f"| {k} | {v} |" for k, v in machine.items()]
    lines += ["", "## Scenarios", "", "| scenario | perf tool arguments | measures |", "|---|---|---|"]
    for s in SCENARIOS:
        argv = " ".join(s.argv).replace(DURATION, "D")
        pre = f" (prefill: `{' '.join(s.prefill)}`)" if s.prefill else ""
        lines.append(f"| {s.name} | `amqp {argv}`{pre} | {s.measures} |")
    lines += ["", "`D` is `--duration` (seconds, default 15).", "", "## Results", ""]
    if results is not None:
        lines += [*(notes or []), *([""] if notes else []), *results]
    elif table:
        lines += [f"Measured {when}; raw results in `{results_dir}`.", ""]
        lines += [*(notes or []), *([""] if notes else []), table.rstrip(), ""]
    else:
        lines += ["**Not yet measured.** No numbers have been recorded on this machine yet; run the command",
                  "above to fill this section.", ""]
    if failures:
        lines += ["### Runs that failed", "", "| scenario | broker | repeat | detail |", "|---|---|---|---|"]
        lines += [f"| {f.scenario} | {f.broker} | {f.repeat} | {f.detail.replace('|', '/')[:300]} |"
                  for f in failures]
        lines.append("")
    lines += [
        "## Notes",
        "",
        "- Rates are each run's total messages / measured seconds; the table shows the median over runs and",
        "  (min–max). Latency is end-to-end (publisher stamp to consumer receipt, same host clock),",
        "  percentiles over all samples of all runs of a scenario.",
        "- With publisher confirms (`--confirm`) the `confirm_latency_*_us` rows are publish -> `basic.ack` as the",
        "  publisher sees it (each burst timed from its send to the confirm covering it, weighted by messages), the",
        "  median over runs of each run's percentile. The latency rows stay end-to-end: they include the time a",
        "  message waits in the queue for the consumer, which a confirm does not.",
        "- Peak RSS is the summed resident memory of the broker pid and its descendants (perf tool `--broker-pid`): the",
        "  beam.smp process tree for RabbitMQ, the node process with all its frontends and shards for",
        "  ShardMQ.",
        "- Publishers in the throughput scenarios are not rate-limited, so queues grow while they run and the",
        "  latency there is mostly time spent waiting in the queue at saturation, not the broker's latency",
        "  at a sustainable rate.",
        "- Only the measured broker runs (each run starts its broker fresh and stops it after; runs recorded",
        "  by commits before 1b02f24 had the other broker running idle beside it); the perf tool runs on the same",
        "  cores, so absolute numbers are lower than on a dedicated client host. Compare the ratio.",
        "",
    ]
    return "\n".join(lines)


RUN_INFO = "bench-run.json"  # benches before RUN_RECORD kept one per results dir (still read for their runs)
RUN_RECORD = "bench.json"  # in each run's directory: the bench invocation that made it, its times and load
UNRECORDED = "unrecorded"  # the --invocation name of runs without a RUN_RECORD (older benches)
KEEP_MARKER = "<!-- kept by shardmq-perf bench: everything below is carried over when the page is rewritten -->"


def kept_tail(old_doc: str) -> str:
    """The hand-written part of the page (analyses, traces, memory) below KEEP_MARKER, marker included."""
    at = old_doc.find(KEEP_MARKER)
    return "" if at < 0 else old_doc[at:]


def _report_table(report_md: Path) -> str:
    """The report's table and its notes, without the plots line (PNGs stay next to the results)."""
    text = report_md.read_text()
    return "\n".join(line for line in text.splitlines() if not line.startswith("Plots:")).strip() + "\n"


# --------------------------------------------------------------------------- invocations


@dataclass
class Invocation:
    """The runs one bench invocation left in a results dir, and what the page says about them."""

    id: str
    runs: list[Path]
    info: dict  # commit, command, when, load1 ([min, max] at the runs' starts), rabbitmq (its version)
    started: datetime | None = None


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def new_invocation(argv: list[str]) -> dict:
    """What every run of this bench invocation records (RUN_RECORD) besides its own times and load."""
    return {"invocation": datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ-") + secrets.token_hex(3),
            "command": _reproduce_command(argv), "commit": _git_commit() or "unknown"}


def invocations(results_dir: Path) -> list[Invocation]:
    """The runs of ``results_dir`` grouped by the bench invocation that made them, oldest first; runs
    of older benches (no RUN_RECORD) form one group named UNRECORDED, described by the dir's RUN_INFO."""
    groups: dict[str, list[tuple[Path, dict | None]]] = {}
    for run_dir in list_runs(results_dir):
        record = _read_json(run_dir / RUN_RECORD)
        key = str(record["invocation"]) if record and record.get("invocation") else UNRECORDED
        groups.setdefault(key, []).append((run_dir, record))
    out = [_invocation(results_dir, key, runs) for key, runs in groups.items()]
    return sorted(out, key=lambda inv: inv.started or datetime.min.replace(tzinfo=UTC))


def _invocation(results_dir: Path, key: str, runs: list[tuple[Path, dict | None]]) -> Invocation:
    paths = [run_dir for run_dir, _ in runs]
    records = [record for _, record in runs if record and key != UNRECORDED]
    if not records:
        legacy = _read_json(results_dir / RUN_INFO) or {}
        started = min(filter(None, (_run_started(p) for p in paths)), default=None)
        info = {"commit": legacy.get("commit", "not recorded"),
                "command": legacy.get("command", f"(runs in {results_dir}; command not recorded)"),
                "load1": legacy.get("load1"), "rabbitmq": legacy.get("rabbitmq"), "when": _when_text(started, None)}
        return Invocation(key, paths, info, started)
    started = min(datetime.fromisoformat(r["started_at"]) for r in records)
    ended = max(datetime.fromisoformat(r["ended_at"]) for r in records)
    loads = [r["load1_start"] for r in records if r.get("load1_start") is not None]
    info = {"commit": records[0].get("commit", "unknown"), "command": records[0].get("command", "?"),
            "load1": [min(loads), max(loads)] if loads else None,
            "rabbitmq": next((r.get("broker_version") for r in records if r.get("broker") == "rabbitmq"), None),
            "when": _when_text(started, ended)}
    return Invocation(key, paths, info, started)


def _run_started(run_dir: Path) -> datetime | None:
    try:
        return datetime.fromisoformat((_read_json(run_dir / "run.json") or {})["started_at"])
    except (KeyError, TypeError, ValueError):
        return None


def _when_text(started: datetime | None, ended: datetime | None) -> str:
    if started is None:
        return "not recorded"
    a = started.astimezone(UTC)
    if ended is None:
        return f"{a:%Y-%m-%d %H:%M} UTC"
    b = ended.astimezone(UTC)
    return f"{a:%Y-%m-%d %H:%M}–{b:%H:%M} UTC" if a.date() == b.date() else f"{a:%Y-%m-%d %H:%M} – {b:%Y-%m-%d %H:%M} UTC"


def describe(groups: list[Invocation]) -> str:
    """One line per invocation, for the CLI's errors."""
    return "\n".join(f"  {g.id}: {len(g.runs)} run{'' if len(g.runs) == 1 else 's'}, commit {g.info['commit']}, {g.info['when']}: {g.info['command']}"
                     for g in groups)


def _report_source(results_dir: Path, runs: list[Path]) -> Path:
    """``results_dir`` when ``runs`` are all of its runs, else a temp dir of links to just those (the
    report reads every run below the directory it is given)."""
    if set(runs) == set(list_runs(results_dir)):
        return results_dir
    view = Path(tempfile.mkdtemp(prefix="bench-runs-"))
    for run_dir in runs:
        (view / run_dir.name).symlink_to(run_dir, target_is_directory=True)
    return view


# --------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardmq-perf bench",
                                description="Run the benchmark scenarios against ShardMQ and RabbitMQ, one broker at a time, "
                                            "alternating.")
    p.add_argument("--scenarios", default=",".join(s.name for s in SCENARIOS if s.by_default),
                   help="comma-separated scenario names (default: all but "
                        + ", ".join(s.name for s in SCENARIOS if not s.by_default) + "): " + ", ".join(BY_NAME))
    p.add_argument("--repeats", type=int, default=3, help="runs per scenario and broker (default 3)")
    p.add_argument("--results-dir", default=None,
                   help="where runs are written (default: bench-results/<UTC timestamp>)")
    p.add_argument("--shardmq-args", default="", help="extra arguments for the shardmq node, one string")
    p.add_argument("--brokers", default="shardmq,rabbitmq", help="which brokers to run (default: both)")
    p.add_argument("--duration", type=float, default=15.0, help="seconds per time-bounded run (default 15)")
    p.add_argument("--master", default="local[*]", help="Spark master for the report")
    p.add_argument("--doc", default=str(DEFAULT_DOC),
                   help="Markdown file to (re)write, with its plots and merged results in the directory of the "
                        "same name (docs/benchmarks/); '' to skip")
    p.add_argument("--no-merge", action="store_true",
                   help="the page shows only this run's scenarios (default: it keeps the latest numbers of the "
                        "scenarios this run did not measure)")
    p.add_argument("--from-results", metavar="DIR", default=None,
                   help="run nothing: report the runs already in DIR and rewrite the page from them")
    p.add_argument("--invocation", metavar="ID", default=None,
                   help="with --from-results: only the runs of this bench invocation (DIR holding runs of several "
                        f"is refused without it; '{UNRECORDED}' names runs of benches that recorded none)")
    p.add_argument("--append", action="store_true",
                   help="run even though --results-dir already holds runs of earlier bench invocations (refused "
                        "without it); the report and the page use this invocation's runs only")
    return p


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _reproduce_command(argv: list[str]) -> str:
    return "shardmq-perf bench" + ("" if not argv else " " + shlex.join(argv))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        print(f"shardmq-perf bench: unknown scenario(s): {', '.join(unknown)}; known: {', '.join(BY_NAME)}",
              file=sys.stderr)
        return 2
    wanted = [b.strip() for b in args.brokers.split(",") if b.strip()]
    if not wanted or set(wanted) - {"shardmq", "rabbitmq"} or args.repeats < 1:
        print("shardmq-perf bench: --brokers takes shardmq and/or rabbitmq; --repeats >= 1", file=sys.stderr)
        return 2
    if args.invocation is not None and args.from_results is None:
        print("shardmq-perf bench: --invocation goes with --from-results", file=sys.stderr)
        return 2
    if args.from_results is not None:
        if not Path(args.from_results).is_dir():
            print(f"shardmq-perf bench: --from-results: no such directory: {args.from_results}", file=sys.stderr)
            return 2
        results_dir = Path(args.from_results).resolve()
        groups = invocations(results_dir)
        if args.invocation is not None:
            groups = [g for g in groups if g.id == args.invocation]
            if not groups:
                print(f"shardmq-perf bench: --invocation {args.invocation}: no such bench invocation in {results_dir}:\n"
                      + describe(invocations(results_dir)), file=sys.stderr)
                return 2
        elif len(groups) > 1:
            print(f"shardmq-perf bench: --from-results {results_dir} holds the runs of {len(groups)} bench "
                  "invocations; pass --invocation ID to render one of them:\n" + describe(groups), file=sys.stderr)
            return 2
        if not groups:
            print(f"shardmq-perf bench: --from-results: no runs in {results_dir}", file=sys.stderr)
            return 2
        runs, run_info = groups[0].runs, groups[0].info
        outcomes: list[RunOutcome] = []
        rabbit_version = run_info.get("rabbitmq")
    else:
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        results_dir = Path(args.results_dir or Path("bench-results") / stamp).resolve()
        earlier = invocations(results_dir) if results_dir.is_dir() else []
        if earlier and not args.append:
            print(f"shardmq-perf bench: --results-dir {results_dir} already holds runs of another bench "
                  "invocation; the report and the page would mix them with this one's. Pass --append to add this "
                  "invocation's runs beside them (the report and the page then use this invocation's runs only), "
                  "or choose an empty --results-dir:\n" + describe(earlier), file=sys.stderr)
            return 2
        results_dir.mkdir(parents=True, exist_ok=True)
        invocation = new_invocation(argv)
        print(f"bench invocation {invocation['invocation']}", file=sys.stderr)
        outcomes, rabbit_version = _run_all(args, names, wanted, results_dir, invocation)
        mine = [g for g in invocations(results_dir) if g.id == invocation["invocation"]]
        runs = mine[0].runs if mine else []
        run_info = mine[0].info if mine else {"commit": invocation["commit"], "command": invocation["command"],
                                              "load1": _load_range(outcomes)}
        rabbit_version = run_info.get("rabbitmq") or rabbit_version

    shutil.rmtree(results_dir / "_prefill", ignore_errors=True)
    failures = [o for o in outcomes if not o.ok]
    table: str | None = None
    summary: dict | None = None
    if runs and (args.from_results is not None or any(o.ok for o in outcomes)):
        source = _report_source(results_dir, runs)
        try:
            rc = report(source, results_dir / "report", args.master)
        finally:
            if source != results_dir:
                shutil.rmtree(source, ignore_errors=True)  # the links only
        if rc == 0:
            table = _report_table(results_dir / "report" / "report.md")
            summary = json.loads((results_dir / "report" / "summary.json").read_text())
            print(table, end="")
        else:
            print(f"shardmq-perf bench: the Spark report failed (exit {rc})", file=sys.stderr)
    if args.doc:
        write_doc(Path(args.doc), argv, summary, outcomes, failures, results_dir, rabbit_version, args.no_merge,
                  run_info)
    if args.from_results is not None:
        return 0 if summary is not None else 1
    if failures:
        print(f"{len(failures)} of {len(outcomes)} runs failed", file=sys.stderr)
    return 0 if outcomes and not failures else 1


def report(source: Path, out: Path, master: str) -> int:
    """The Spark report (loadtest/report.py) of the runs under ``source`` into ``out``; its exit status."""
    return subprocess.run([sys.executable, "-m", "loadtest.report", str(source), "--master", master,
                           "--out", str(out)], cwd=ROOT, stdout=subprocess.DEVNULL, check=False).returncode


def _new_broker(name: str, args: argparse.Namespace):  # noqa: ANN202
    return ShardMQNode(shlex.split(args.shardmq_args)) if name == "shardmq" else RabbitMQBroker()


def _run_all(args: argparse.Namespace, names: list[str], wanted: list[str],
             results_dir: Path, invocation: dict | None = None) -> tuple[list[RunOutcome], str | None]:
    """Run every scenario --repeats times alternating brokers, each run against a broker started for it
    and stopped right after it, so only the measured broker runs (module docstring says why)."""
    log = results_dir / "bench.log"
    print(f"results: {results_dir}  (perf output: {log})", file=sys.stderr)
    # 10,000 connections need as many descriptors in the perf tool and in each broker: the brokers
    # and the perf runs are children of this process and inherit the limit.
    raise_nofile_limit()
    # A SIGTERM must still reach the finally below that stops the running broker.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    outcomes: list[RunOutcome] = []
    rabbit_version: str | None = None
    broker = None
    try:
        for name in names:
            s = BY_NAME[name]
            for repeat in range(1, args.repeats + 1):
                for broker_name in wanted:
                    broker = _new_broker(broker_name, args)
                    print(f"starting {broker_name} ...", file=sys.stderr)
                    try:
                        broker.start()
                    except Exception as e:  # a broker that cannot start fails this run, not the others
                        broker = None
                        outcomes.append(RunOutcome(name, broker_name, repeat, False, 0.0, f"start: {e}"[:300],
                                                   os.getloadavg()[0]))
                        print(f"  {name} #{repeat} {broker_name}: FAILED to start: {e}", file=sys.stderr)
                        continue
                    print(f"  {broker_name} up at {broker.url} (pid {broker.pid}, version {broker.version})",
                          file=sys.stderr)
                    if broker_name == "rabbitmq":
                        rabbit_version = broker.version
                    try:
                        outcome = run_one(s, broker, repeat, results_dir, args.duration, log, invocation)
                    finally:
                        stopping, broker = broker, None
                        stopping.stop()
                    outcomes.append(outcome)
                    status = "ok" if outcome.ok else f"FAILED: {outcome.detail}"
                    print(f"  {name} #{repeat} {broker_name}: {outcome.seconds:.1f}s (load {outcome.load1:.1f}) "
                          f"{status}", file=sys.stderr)
    except KeyboardInterrupt:
        print("interrupted; stopping the broker", file=sys.stderr)
    finally:
        if broker is not None:
            try:
                broker.stop()
            except Exception as e:
                print(f"stopping {broker.name}: {e}", file=sys.stderr)
    return outcomes, rabbit_version


def _load_range(outcomes: list[RunOutcome]) -> list[float] | None:
    loads = [o.load1 for o in outcomes if o.load1 is not None]
    return [min(loads), max(loads)] if loads else None


def _measured_when(results_dir: Path) -> str:
    """When the runs in ``results_dir`` started (the earliest run.json), else now."""
    started = []
    for run_json in results_dir.glob("*/run.json"):
        try:
            started.append(datetime.fromisoformat(json.loads(run_json.read_text())["started_at"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return (min(started) if started else datetime.now(UTC)).astimezone(UTC).strftime("%Y-%m-%d %H:%M UTC")


def write_doc(doc: Path, argv: list[str], summary: dict | None, outcomes: list[RunOutcome],
              failures: list[RunOutcome], results_dir: Path, rabbit_version: str | None,
              no_merge: bool = False, run_info: dict | None = None) -> None:
    """Merge this run's report into the page's store, redraw the plots, rewrite the page (keeping its
    hand-written tail). ``run_info`` names the run (commit, command); default: this checkout, ``argv``."""
    run_info = run_info or {"commit": _git_commit() or "unknown", "command": _reproduce_command(argv)}
    assets = bench_doc.assets_dir(doc)
    store_path = assets / bench_doc.STORE_NAME
    store = bench_doc.empty_store() if no_merge else bench_doc.load_store(store_path)
    when = run_info.get("when") or _measured_when(results_dir)
    if summary is not None:
        run = {"when": when, "commit": run_info.get("commit") or "unknown", "command": run_info.get("command", "?"),
               "results_dir": str(results_dir), "load1": run_info.get("load1") or _load_range(outcomes)}
        run_id = base = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        n = 1
        while run_id in store["runs"]:  # two runs in one second (tests): both keep their rows
            n += 1
            run_id = f"{base}-{n}"
        store = bench_doc.merge(store, summary, run_id, run, BY_NAME)
        bench_doc.save_store(store_path, store)
    merged = bench_doc.store_summary(store)
    rates = {s.name: r for s in SCENARIOS if (r := bench_doc.fixed_rate(s.argv)) is not None}
    images = bench_doc.write_plots(merged, rates, assets) if store["scenarios"] else []
    results = bench_doc.results_section(store, merged, images, doc.parent, [s.name for s in SCENARIOS], store_path)
    machine = machine_info(run_info.get("rabbitmq") or rabbit_version)
    machine["ShardMQ commit"] = run_info.get("commit") or machine["ShardMQ commit"]  # the run's, not the checkout's
    page = render_doc(machine, run_info.get("command", "?"), None, when, failures,
                      str(results_dir), results=results)
    tail = kept_tail(doc.read_text()) if doc.exists() else ""
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(page + ("\n" + tail if tail else ""))
    print(f"wrote {doc} and {len(images)} plots in {assets}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
