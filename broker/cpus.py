"""How many cores the node may use, and the default frontend and shard counts for that many.

The defaults are chosen by measurement (docs/benchmarks.md, "Default process counts", re-measured
2026-11-26 with the node in the tool's session, 8 scenarios including bind and connection churn):
on 1 core 1x1, 1x2 and 2x1, on 2 cores 1x1, 1x2, 2x1 and 2x2, alternating under the same load; the
counts for more cores are extrapolated from those two points (no bigger machine was measured).
What counts as a core: the ones this process may run on, not the host's (``available_cpus``).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_cpu_limit(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """The CPU quota of this process's cgroup in cores (``docker --cpus 1.5`` -> 1.5), None if unlimited.

    cgroup v2 keeps it in ``cpu.max`` ("QUOTA PERIOD" or "max PERIOD"), v1 in
    ``cpu/cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (-1 = unlimited). The process's own cgroup is
    looked up first (/proc/self/cgroup), then the root of the mount (what a container sees).
    """
    v2_dirs, v1_dirs = [], []
    try:
        for line in proc_cgroup.read_text().splitlines():
            hier, controllers, path = line.split(":", 2)
            rel = path.lstrip("/")
            if hier == "0" and controllers == "":
                v2_dirs.append(root / rel)
            elif "cpu" in controllers.split(","):
                v1_dirs.append(root / "cpu" / rel)
    except (OSError, ValueError):
        pass
    for d in [*v2_dirs, root]:
        try:
            quota, period = (d / "cpu.max").read_text().split()[:2]
        except (OSError, ValueError):
            continue
        return None if quota == "max" else int(quota) / int(period)
    for d in [*v1_dirs, root / "cpu"]:
        try:
            quota_us = int((d / "cpu.cfs_quota_us").read_text())
            period_us = int((d / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
        return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us
    return None


def available_cpus() -> int:
    """Cores this process may run on: its CPU affinity (``taskset``, a cpuset), capped by a cgroup
    CPU quota rounded up (a container limited to 1.5 CPUs counts 2); at least 1.

    ``os.cpu_count()`` is the host's count whatever the process is allowed to use, so a node pinned
    to one core or in a 2-CPU container on a 64-core host would start 64 of each process.
    """
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        n = os.cpu_count() or 1
    limit = cgroup_cpu_limit()
    if limit is not None:
        n = min(n, math.ceil(limit))
    return max(1, n)


def default_frontends(cores: int) -> int:
    """Frontend processes for ``cores``: one per two cores, at least 1 (frontends + shards = cores).

    Measured on the tree with the 16000-credit window and balanced placement (2026-11-26, docs/
    benchmarks.md "Default process counts"). 2 cores: 1F x 1S against 2F x 2S, medians of 3
    alternating runs: 1P/1C 152k vs 143k msg/s (5.9 vs 6.0 µs CPU/msg), 4P/4C 205k vs 163k (6.2 vs
    6.9), persistent confirms 46k vs 38k (19.4 vs 20.6), fanout 149k vs 162k (5.9 vs 6.8), latency
    at 10k msg/s p50 203 vs 209 µs, bind+unbind 2,572 vs 1,608 pairs/s (299 vs 559 µs CPU: every
    worker applies every definition change). 1 core: CPU per message the same for 1x1, 1x2, 2x1
    (16 B 5.7-6.4 µs); 1x1 has the cheapest bind round trip (392 µs against 487 and 505) and the
    fewest processes. Beyond 2 cores (2+2 on 4, 4+4 on 8): extrapolated, not measured."""
    return max(1, cores // 2)


def default_shards(cores: int) -> int:
    """Shard processes for ``cores``: one per two cores, at least 1, measured with
    ``default_frontends`` as pairs (see there). Beyond 2 cores: extrapolated, not measured."""
    return max(1, cores // 2)


# --colocate auto pairs frontend K with shard K when the node may use at most this many cores
# (docs/benchmarks.md, "Frontend and shard in one process").
COLOCATE_AUTO_MAX_CORES = 2.0


def colocated_pairs(colocate: str, frontends: int, shards: int, cores: float | None = None) -> int:
    """How many (frontend K, shard K) pairs run in one process each for ``--colocate``: ``off`` none,
    ``on`` min(frontends, shards), ``auto`` as ``on`` on at most COLOCATE_AUTO_MAX_CORES cores. A
    cluster member too: a fenced leader stops a pair's frontend part alone and its shard part lives on
    (broker/supervisor.py stop_frontends_now)."""
    if colocate == "off":
        return 0
    if colocate == "auto":
        if cores is None:
            cores = available_cpus()
        if cores > COLOCATE_AUTO_MAX_CORES:
            return 0
    return min(frontends, shards)
