"""Debug aid: which single piece of event-loop work in a node process is long (off unless asked for).

Wall-clock gaps on a shared machine follow the load; the CPU a process's loop thread spends
between two of its own turns does not. With ``SHARDMQ_TEST_TURN_PROBE=DIR`` in the environment
(a node passes its environment on to its workers) the node and every worker append lines to
``DIR/<role>-<pid>.turns``, all times CLOCK_MONOTONIC (``time.monotonic_ns``, the clock the perf
tool's probe uses too, so its worst round trips line up with these lines):

- ``tick END_NS WALL_US CPU_US``: a 1 ms timer measures the loop thread's CPU time
  (``time.thread_time``) between two of its firings. The loop runs it once per turn at most,
  so CPU_US bounds the longest turn in that interval (plus the 1 ms); WALL_US minus CPU_US is
  time the thread was not running: waiting for a core, blocked in a system call, or for the GIL.
  Written when CPU_US > 500 or WALL_US > 3,000.
- ``gc START_NS WALL_US CPU_US GEN COLLECTED``: every cyclic garbage collection over 200 µs.
- ``call LABEL START_NS WALL_US CPU_US``: the synchronous methods named in
  ``SHARDMQ_TEST_TURN_PROBE_WRAP`` (``module:Class.method,...``; wrapped once the process has
  imported the module: at start, else looked for again every second), each call over 200 µs; when its last argument is a list whose first
  element is an int or a str (a contract item), LABEL ends with ``[that element]``.
- ``pace NS RATE LATE_US``: the node's delete pacer's rate (broker/delete_pacer.py) after a window
  whose wake-ups came LATE_US late on average (one line per window while deletes wait).

``python -m loadtest.turn_report DIR`` summarizes them. A debug aid only: nothing here runs
unless the variable is set, and nothing crosses a process boundary.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import gc
import importlib
import inspect
import os
import sys
import time
from threading import get_ident as _get_ident
from typing import IO, Any

ENV = "SHARDMQ_TEST_TURN_PROBE"
WRAP_ENV = "SHARDMQ_TEST_TURN_PROBE_WRAP"
TICK_S = 0.001
TICK_CPU_US = 500  # a tick line when the loop thread ran more than this between two ticks
TICK_WALL_US = 3000  # ... or when the ticks were this far apart
PIECE_US = 200  # gc and call lines over this

_installed: list[TurnProbe] = []


class TurnProbe:
    """One process's probe: the tick timer, the GC callback and the wrapped methods."""

    def __init__(self, loop: asyncio.AbstractEventLoop, out: IO[str]) -> None:
        self.loop = loop
        self.out = out
        self._lines: list[str] = []
        self._wall = time.monotonic_ns()
        self._cpu = time.thread_time_ns()
        self._gc_start = (0, 0)
        self._last_flush = self._wall
        self._thread = None
        self._handle: asyncio.TimerHandle | None = None
        self.unwrapped: list[str] = []  # SHARDMQ_TEST_TURN_PROBE_WRAP entries whose module is not imported yet

    def start(self) -> None:
        self._thread = _get_ident()
        gc.callbacks.append(self._on_gc)
        self._handle = self.loop.call_later(TICK_S, self._tick)

    def _tick(self) -> None:
        wall, cpu = time.monotonic_ns(), time.thread_time_ns()
        wall_us, cpu_us = (wall - self._wall) // 1000, (cpu - self._cpu) // 1000
        if cpu_us > TICK_CPU_US or wall_us > TICK_WALL_US:
            self._lines.append(f"tick {wall} {wall_us} {cpu_us}\n")
        if wall - self._last_flush > 1_000_000_000:
            self.flush()
            if self.unwrapped:  # modules a worker imports once it runs (its sessions)
                self.unwrapped = [spec for spec in self.unwrapped if not _wrap(self, spec)]
        # Measured after the bookkeeping, so the probe's own writes are not counted as a turn's work.
        self._wall, self._cpu = time.monotonic_ns(), time.thread_time_ns()
        self._handle = self.loop.call_later(TICK_S, self._tick)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if _get_ident() != self._thread:
            return
        if phase == "start":
            self._gc_start = (time.monotonic_ns(), time.thread_time_ns())
            return
        start, cpu0 = self._gc_start
        wall_us = (time.monotonic_ns() - start) // 1000
        if wall_us > PIECE_US:
            cpu_us = (time.thread_time_ns() - cpu0) // 1000
            self._lines.append(f"gc {start} {wall_us} {cpu_us} {info.get('generation')} {info.get('collected')}\n")

    def call(self, label: str, start: int, cpu0: int, args: tuple) -> None:
        wall_us = (time.monotonic_ns() - start) // 1000
        if wall_us > PIECE_US:
            last = args[-1] if args else None
            if isinstance(last, list) and last and isinstance(last[0], (int, str)):
                label = f"{label}[{last[0]}]"  # an item's kind (a contract item is [kind, ...])
            self._lines.append(f"call {label} {start} {wall_us} {(time.thread_time_ns() - cpu0) // 1000}\n")

    def pace(self, rate: float, late_s: float) -> None:
        self._lines.append(f"pace {time.monotonic_ns()} {rate:.0f} {late_s * 1e6:.0f}\n")

    def flush(self) -> None:
        self._last_flush = time.monotonic_ns()
        if self._lines:
            self.out.write("".join(self._lines))
            self._lines.clear()
            self.out.flush()


def _wrap(probe: TurnProbe, spec: str) -> bool:
    """Wrap ``module:Class.method`` (sync methods of an imported module only); False: not imported yet."""
    mod_name, _, attr = spec.partition(":")
    mod = sys.modules.get(mod_name.strip())
    cls_name, _, meth = attr.strip().partition(".")
    cls = getattr(mod, cls_name, None) if mod is not None else None
    fn = getattr(cls, meth, None) if cls is not None else None
    if fn is None:
        return False
    if inspect.iscoroutinefunction(fn) or getattr(fn, "_turn_probe", False):
        return True
    label = f"{cls_name}.{meth}"
    mono, cpu = time.monotonic_ns, time.thread_time_ns

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        start, cpu0 = mono(), cpu()
        try:
            return fn(*args, **kwargs)
        finally:
            probe.call(label, start, cpu0, args)

    timed._turn_probe = True  # type: ignore[attr-defined]
    setattr(cls, meth, timed)
    return True


def install(loop: asyncio.AbstractEventLoop, role: str) -> TurnProbe | None:
    """Start this process's probe if ``SHARDMQ_TEST_TURN_PROBE`` names a directory (call it once the
    process's worker class is imported, so ``SHARDMQ_TEST_TURN_PROBE_WRAP`` can find its methods)."""
    out_dir = os.environ.get(ENV)
    if not out_dir:
        return None
    os.makedirs(out_dir, exist_ok=True)
    out = open(os.path.join(out_dir, f"{role}-{os.getpid()}.turns"), "a", buffering=1 << 16)  # noqa: SIM115
    probe = TurnProbe(loop, out)
    kind = role.split("-")[0]
    packages = {"node": ("broker",), "pair": ("frontend", "shard")}.get(kind, (kind,))
    for spec in filter(None, os.environ.get(WRAP_ENV, "").split(",")):
        mod_name = spec.partition(":")[0].strip()
        if mod_name.split(".")[0] in packages:  # this process's own modules: imported now, wrapped from the start
            importlib.import_module(mod_name)
    probe.unwrapped = [spec for spec in filter(None, os.environ.get(WRAP_ENV, "").split(",")) if not _wrap(probe, spec)]
    probe.start()
    if loop.get_debug():  # PYTHONASYNCIODEBUG=1 as well: the loop logs every callback over 2 ms
        loop.slow_callback_duration = 0.002
    _installed.append(probe)
    atexit.register(probe.flush)
    return probe
