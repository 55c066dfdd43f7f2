"""Resource alarms: free disk space of the data dir and the node's memory, as RabbitMQ's alarms.

The node checks both every CHECK_INTERVAL_S (a ``statvfs`` and a few ``/proc/PID/statm`` reads).
While an alarm is in effect the node tells every frontend (contract ALARMS): each publishing
connection is sent ``connection.blocked`` (when its client announced the capability) and is no
longer read until every alarm has cleared (``connection.unblocked``); consumers keep being read,
so acks get through and the backlog drains. Alarms show in ``node.alarms`` (the health check
``/api/health/checks/alarms``, ``/api/overview``, ``/api/nodes``, the Prometheus alarm gauges) and
are logged when they start and clear.

Limits (RabbitMQ's syntax): ``--disk-free-limit`` is bytes with an optional unit (``50MB`` is
RabbitMQ's default; kB/MB/GB are powers of 1000, kiB/MiB/GiB powers of 1024) or
``mem_relative:F`` (F times the total RAM). ``--vm-memory-high-watermark`` is a fraction of the
total RAM (``0.4``, RabbitMQ's default) or an absolute amount with a unit (``2GB``); it is compared
with the resident memory of all the node's processes together.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable

log = logging.getLogger("shardmq.alarms")

CHECK_INTERVAL_S = 0.25
DISK = "disk"
MEMORY = "memory"
# What connection.blocked says, as RabbitMQ words it.
REASONS = {DISK: "low on disk", MEMORY: "low on memory"}

_UNITS = {"": 1, "b": 1, "k": 1024, "kib": 1024, "kb": 1000, "m": 1024**2, "mib": 1024**2, "mb": 1000**2,
          "g": 1024**3, "gib": 1024**3, "gb": 1000**3, "t": 1024**4, "tib": 1024**4, "tb": 1000**4}
_AMOUNT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def total_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def parse_amount(raw: str) -> int:
    m = _AMOUNT.match(raw)
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(f"invalid amount {raw!r} (bytes with an optional unit: kB, MB, GB, kiB, MiB, GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_disk_limit(raw: str, ram: int | None = None) -> int:
    """Bytes of free disk below which the disk alarm fires."""
    raw = raw.strip()
    if raw.startswith("mem_relative:"):
        try:
            factor = float(raw.split(":", 1)[1])
        except ValueError:
            raise ValueError(f"invalid mem_relative factor in {raw!r}") from None
        if factor < 0:
            raise ValueError(f"mem_relative factor must be >= 0 in {raw!r}")
        return int(factor * (ram if ram is not None else total_memory()))
    return parse_amount(raw)


def parse_memory_watermark(raw: str, ram: int | None = None) -> int:
    """Bytes of resident memory (all processes of the node) above which the memory alarm fires."""
    raw = raw.strip()
    try:
        fraction = float(raw)
    except ValueError:
        return parse_amount(raw)
    if not 0 <= fraction <= 1:
        raise ValueError(f"a relative watermark must be between 0 and 1, got {raw!r}")
    return int(fraction * (ram if ram is not None else total_memory()))


def disk_free(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


class ResourceMonitor:
    """Checks the limits and calls on_change(sorted alarm names) when the set changes."""

    def __init__(self, data_dir: str, disk_limit: int, memory_limit: int, rss: Callable[[], int],
                 on_change: Callable[[list[str]], None]) -> None:
        self.data_dir = data_dir
        self.disk_limit = disk_limit
        self.memory_limit = memory_limit
        self.rss = rss
        self.on_change = on_change
        self.active: set[str] = set()
        self.last_free = -1
        self.last_rss = -1

    def check(self) -> None:
        now: set[str] = set()
        try:
            self.last_free = disk_free(self.data_dir)
            if self.last_free < self.disk_limit:
                now.add(DISK)
        except OSError as exc:
            log.warning("cannot read free disk space of %s: %s", self.data_dir, exc)
            now |= self.active & {DISK}
        self.last_rss = self.rss()
        if self.last_rss > self.memory_limit:
            now.add(MEMORY)
        if now == self.active:
            return
        for name in sorted(now - self.active):
            if name == DISK:
                log.warning("disk resource limit alarm set on %s: free disk space %d bytes < limit %d bytes; "
                            "publishers are blocked", self.data_dir, self.last_free, self.disk_limit)
            else:
                log.warning("memory resource limit alarm set: node memory %d bytes > watermark %d bytes; "
                            "publishers are blocked", self.last_rss, self.memory_limit)
        for name in sorted(self.active - now):
            log.warning("%s resource limit alarm cleared", name)
        self.active = now
        self.on_change(sorted(now))
