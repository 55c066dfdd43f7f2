"""On-disk results format of ``shardmq-perf`` runs (read by loadtest/report.py and loadtest/bench.py).

Layout, one directory per run::

    RESULTS_DIR/<run_id>/run.json
    RESULTS_DIR/<run_id>/rates.jsonl
    RESULTS_DIR/<run_id>/latency.jsonl

``run.json`` -- one JSON object::

    {
      "run_id": "20240101T120000Z-shardmq-throughput-1a2b3c",   # also the directory name
      "broker": "shardmq",            # --broker-name (free text: "shardmq", "rabbitmq", "sink", ...)
      "scenario": "1p1c-16b",         # --scenario (free text), defaults to the subcommand name
      "params": {...},                # the command's options (publishers, consumers, size, confirm, ...)
      "started_at": "2024-01-01T12:00:00.123456+00:00",   # ISO 8601, UTC
      "duration_s": 10.02,            # float seconds of the measured phase
      "published": 123456,            # messages written by all publishers
      "consumed": 123000,             # deliveries received by all consumers
      "confirmed": 123456,            # publisher confirms received (0 without -c)
      "publish_rate": 12345.6,        # published / duration_s (msgs/s)
      "consume_rate": 12300.0,        # consumed / duration_s (msgs/s)
      "latency_us": {"min": 12, "p50": 80, "p95": 200, "p99": 400, "max": 9000},
                                      # end-to-end, integer microseconds; every value null when no
                                      # message was consumed
      "broker_rss_bytes": 123456789   # int, or null when --broker-pid was not given
    }

Subcommands other than throughput (queue-count, connection-count, bind-churn,
connection-churn) write the same ``run.json`` keys (counts they do not measure are 0, the
latency values null) plus an ``"extra"`` object with their own measurements.

``rates.jsonl`` -- one line per second of the run (``t`` = whole seconds since start, 1-based:
the line with t=1 counts what happened in [0 s, 1 s))::

    {"t": 1, "published": 10234, "consumed": 10100}

``latency.jsonl`` -- per-message end-to-end latency samples, at most ``MAX_LATENCY_SAMPLES``
lines per run (uniformly sampled over all consumed messages)::

    {"t": 0.532, "latency_us": 87}

``t`` is float seconds since the run started at which the message was consumed.
"""

from __future__ import annotations

import json
import math
import os
import random
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

MAX_LATENCY_SAMPLES = 100_000
RUN_FILE = "run.json"
RATES_FILE = "rates.jsonl"
LATENCY_FILE = "latency.jsonl"


@dataclass
class RunResult:
    """Everything ``run.json`` holds, plus the series written next to it."""

    broker: str
    scenario: str
    params: dict[str, Any]
    started_at: str
    duration_s: float
    published: int = 0
    consumed: int = 0
    confirmed: int = 0
    latency_us: dict[str, int | None] = field(default_factory=lambda: empty_latency())
    broker_rss_bytes: int | None = None
    run_id: str = ""
    extra: dict[str, Any] | None = None
    # per-second series and latency samples are written to the jsonl files, not run.json
    rates: list[tuple[int, int, int]] = field(default_factory=list, repr=False)
    latency_samples: list[tuple[float, int]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if not self.run_id:
            self.run_id = make_run_id(self.broker, self.scenario)

    @property
    def publish_rate(self) -> float:
        return self.published / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def consume_rate(self) -> float:
        return self.consumed / self.duration_s if self.duration_s > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        """The ``run.json`` object."""
        d = asdict(self)
        del d["rates"], d["latency_samples"]
        if d["extra"] is None:
            del d["extra"]
        d["duration_s"] = round(self.duration_s, 6)
        d["publish_rate"] = round(self.publish_rate, 1)
        d["consume_rate"] = round(self.consume_rate, 1)
        order = ["run_id", "broker", "scenario", "params", "started_at", "duration_s", "published",
                 "consumed", "confirmed", "publish_rate", "consume_rate", "latency_us", "broker_rss_bytes"]
        return {k: d[k] for k in order + [k for k in d if k not in order]}


def empty_latency() -> dict[str, int | None]:
    return {"min": None, "p50": None, "p95": None, "p99": None, "max": None}


def now_iso() -> str:
    return datetime.now(UTC).isoformat()


def make_run_id(broker: str, scenario: str) -> str:
    """Sortable, unique, filesystem-safe id: UTC timestamp, broker, scenario, random suffix."""
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in f"{broker}-{scenario}")
    return f"{stamp}-{safe}-{secrets.token_hex(3)}"


def latency_summary(samples_us: Sequence[int]) -> dict[str, int | None]:
    """min/p50/p95/p99/max (nearest-rank) of latency samples in microseconds."""
    if not samples_us:
        return empty_latency()
    s = sorted(samples_us)
    n = len(s)

    def pct(p: float) -> int:
        return int(s[min(n - 1, max(0, math.ceil(p / 100.0 * n) - 1))])

    return {"min": int(s[0]), "p50": pct(50), "p95": pct(95), "p99": pct(99), "max": int(s[-1])}


def downsample(samples: list[Any], limit: int = MAX_LATENCY_SAMPLES, seed: int = 0) -> list[Any]:
    """At most ``limit`` samples, chosen uniformly, order kept."""
    if len(samples) <= limit:
        return samples
    idx = sorted(random.Random(seed).sample(range(len(samples)), limit))
    return [samples[i] for i in idx]


def write_run(results_dir: str | os.PathLike[str], result: RunResult) -> Path:
    """Write run.json, rates.jsonl and latency.jsonl under ``results_dir/<run_id>/``; return that dir."""
    run_dir = Path(results_dir) / result.run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    _write_jsonl(run_dir / RATES_FILE,
                 ({"t": t, "published": p, "consumed": c} for t, p, c in result.rates))
    _write_jsonl(run_dir / LATENCY_FILE,
                 ({"t": round(t, 6), "latency_us": int(us)}
                  for t, us in downsample(result.latency_samples)))
    tmp = run_dir / (RUN_FILE + ".tmp")
    tmp.write_text(json.dumps(result.to_json(), indent=2) + "\n")
    tmp.replace(run_dir / RUN_FILE)  # run.json last: its presence means the run dir is complete
    return run_dir


def _write_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row, separators=(",", ":")))
            f.write("\n")


def read_run(run_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``run.json`` object of one run directory."""
    return json.loads((Path(run_dir) / RUN_FILE).read_text())


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def list_runs(results_dir: str | os.PathLike[str]) -> list[Path]:
    """Complete run directories (those holding run.json), sorted by run_id."""
    root = Path(results_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if (p / RUN_FILE).is_file())


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (from /proc/PID/task/*/children), ``pid`` first."""
    seen: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            pass
    return seen


def broker_rss_bytes(pid: int | None) -> int | None:
    """Summed RSS of ``pid`` and all its descendants from /proc; None when pid is None or gone."""
    if pid is None:
        return None
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    for p in process_tree(pid):
        try:
            with open(f"/proc/{p}/statm") as f:
                total += int(f.read().split()[1]) * page
        except (OSError, ValueError, IndexError):
            if p == pid:
                return None
    return total


def broker_cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU seconds used so far by ``pid`` and its descendants (live ones: a child that
    exited took its time with it); None when pid is None or gone. On a shared machine the CPU a
    fixed amount of work costs moves far less than its rate."""
    if pid is None:
        return None
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for p in process_tree(pid):
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except (OSError, ValueError, IndexError):
            if p == pid:
                return None
    return total / tick


def broker_memory(pid: int | None) -> dict[str, int] | None:
    """Summed ``rss``, ``pss`` and ``uss`` (private pages) in bytes of ``pid``'s process tree, from
    /proc/PID/smaps_rollup; None when pid is None or gone. RSS counts a shared library once per
    process that maps it, PSS divides each shared page among them: the sum of PSS is what the tree
    costs the machine, the sum of USS what it would free by exiting."""
    if pid is None:
        return None
    total = {"rss": 0, "pss": 0, "uss": 0, "processes": 0}
    for p in process_tree(pid):
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                text = f.read()
        except OSError:
            if p == pid:
                return None
            continue
        for line in text.splitlines()[1:]:
            key, _, rest = line.partition(":")
            kib = rest.split()
            if not kib:
                continue
            if key == "Rss":
                total["rss"] += int(kib[0]) * 1024
            elif key == "Pss":
                total["pss"] += int(kib[0]) * 1024
            elif key in ("Private_Clean", "Private_Dirty"):
                total["uss"] += int(kib[0]) * 1024
        total["processes"] += 1
    return total
