"""Where a message's latency goes: join the per-stage trace files of a node and the perf tool.

    python -m loadtest.trace_stages DIR [--json]

DIR holds the ``*.trace`` files that a node run with ``--trace-stages DIR`` (its frontends and
shards, broker/stage_trace.py) and ``shardmq-perf amqp throughput --trace-stages DIR`` (its
consumers) wrote. A message's key starts with the publisher's send time, so its path is
client send -> fe_read -> fe_publish_out -> sh_publish_in -> sh_deliver_out -> fe_deliver_in -> fe_write ->
client_recv; each hop's percentiles (µs) over the messages seen at both of its ends are printed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

STAGES = ("client_send", "fe_read", "fe_publish_out", "sh_publish_in", "sh_deliver_out", "fe_deliver_in", "fe_write",
          "client_recv")
HOPS = {
    "client_send -> fe_read": "client write, kernel, frontend wake-up, its read starts",
    "fe_read -> fe_publish_out": "frontend: parse + route, the PUBLISH batch leaves (end of the read or of the turn)",
    "fe_publish_out -> sh_publish_in": "data plane frontend -> shard (unix: socket write, shard wake-up; zmq: also both I/O threads)",
    "sh_publish_in -> sh_deliver_out": "shard: append, deliver, wait for the turn's end",
    "sh_deliver_out -> fe_deliver_in": "data plane shard -> frontend",
    "fe_deliver_in -> fe_write": "frontend: encode basic.deliver, wait for the turn's end, socket write",
    "fe_write -> client_recv": "kernel, client wake-up and read",
    "client_send -> client_recv": "end to end",
}


def load(directory: Path) -> dict[str, dict[str, int]]:
    paths: dict[str, dict[str, int]] = {}
    for f in sorted(directory.glob("*.trace")):
        for line in f.read_text(errors="replace").splitlines():
            parts = line.split()
            if len(parts) != 3:
                continue
            stage, key, t = parts[0], parts[1], int(parts[2])
            stages = paths.setdefault(key, {})
            if stage not in stages or t < stages[stage]:
                stages[stage] = t
    for key, stages in paths.items():
        stages["client_send"] = int(key[:16], 16)
    return paths


def percentile(values: list[int], q: float) -> int:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def breakdown(paths: dict[str, dict[str, int]]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for hop in HOPS:
        a, b = hop.split(" -> ")
        d = [s[b] - s[a] for s in paths.values() if a in s and b in s]
        if d:
            out[hop] = {"n": len(d), "p50_us": percentile(d, 0.5) / 1000, "p90_us": percentile(d, 0.9) / 1000,
                        "p99_us": percentile(d, 0.99) / 1000, "mean_us": sum(d) / len(d) / 1000}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.trace_stages", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", type=Path)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    result = breakdown(load(args.dir))
    if not result:
        print(f"no traced messages in {args.dir}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{'hop':<36}{'n':>7}{'p50 µs':>10}{'p90 µs':>10}{'p99 µs':>10}{'mean µs':>10}  what")
    for hop, r in result.items():
        print(f"{hop:<36}{r['n']:>7}{r['p50_us']:>10.0f}{r['p90_us']:>10.0f}{r['p99_us']:>10.0f}"
              f"{r['mean_us']:>10.0f}  {HOPS[hop]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
