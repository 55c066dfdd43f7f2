"""Summarize the ``*.turns`` files broker/turn_probe.py writes (``SHARDMQ_TEST_TURN_PROBE=DIR``).

    python -m loadtest.turn_report DIR [--top N]

Per process file: the longest turn (loop CPU between two 1 ms ticks), the garbage collections over
200 µs (count, longest, per generation) and the wrapped calls that took the most CPU, grouped by
label. A debug aid: it reads what the probe wrote, nothing else.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path


def summarize(path: Path, top: int = 5) -> list[str]:
    """The report lines of one ``<role>-<pid>.turns`` file."""
    worst_tick = (0, 0)  # (cpu_us, wall_us)
    gcs: dict[str, list[int]] = defaultdict(list)  # generation -> cpu_us of each
    calls: dict[str, list[int]] = defaultdict(list)  # label -> cpu_us of each
    for line in path.read_text().splitlines():
        f = line.split()
        if not f:
            continue
        try:
            if f[0] == "tick" and len(f) == 4:
                worst_tick = max(worst_tick, (int(f[3]), int(f[2])))
            elif f[0] == "gc" and len(f) == 6:
                gcs[f[4]].append(int(f[3]))
            elif f[0] == "call" and len(f) == 5:
                calls[f[1]].append(int(f[4]))
        except ValueError:  # a line cut short by a killed process
            continue
    out = [f"{path.stem}: longest turn {worst_tick[0] / 1000:.1f} ms CPU ({worst_tick[1] / 1000:.1f} ms wall)"]
    for gen in sorted(gcs):
        cpu = gcs[gen]
        out.append(f"  gc gen {gen}: {len(cpu)} over 200 us, longest {max(cpu) / 1000:.1f} ms CPU")
    ranked = sorted(calls.items(), key=lambda kv: max(kv[1]), reverse=True)[:top]
    for label, cpu in ranked:
        out.append(f"  {label}: {len(cpu)} calls over 200 us, longest {max(cpu) / 1000:.1f} ms, "
                   f"total {sum(cpu) / 1000:.1f} ms CPU")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.turn_report", description=__doc__.splitlines()[0])
    p.add_argument("dir", type=Path, help="the directory SHARDMQ_TEST_TURN_PROBE named")
    p.add_argument("--top", type=int, default=5, help="wrapped-call labels listed per process (default 5)")
    args = p.parse_args(argv)
    if args.top < 0:
        p.error("--top must be 0 or more")
    files = sorted(args.dir.glob("*.turns")) if args.dir.is_dir() else []
    if not files:
        p.error(f"no *.turns files in {args.dir}")
    for f in files:
        print("\n".join(summarize(f, args.top)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
