"""Per-stage latency trace of messages through a node: a debug aid, off unless asked for.

With ``--trace-stages DIR`` (``SHARDMQ_TRACE_STAGES``; the node exports it to its workers) each
frontend and shard appends ``stage key t_ns`` lines to ``DIR/<role>-<pid>.trace`` for a sample of
the messages it handles (1 in ``SAMPLE``, chosen by a CRC32 of the body's first 16 bytes, so every
process picks the same messages without telling each other anything). ``key`` is those 16 bytes in
hex: the perf tool writes a send timestamp (CLOCK_MONOTONIC ns, the clock used here too) and a
sequence number there, so one message's lines from every process join into its path, and
``python -m loadtest.trace_stages DIR`` prints where the time goes. Nothing crosses a process
boundary for this, so the contract is unchanged.

Stages, in the order a message meets them:

- ``fe_read``: the frontend's last read from a client socket before the PUBLISH batch holding the
  message left (``data_received`` starting; at a steady low rate, the read that carried it);
- ``fe_publish_out``: a frontend sends the PUBLISH batch holding it to the shard (end of the loop
  turn that read it from the client);
- ``sh_publish_in``: the shard received that batch;
- ``sh_deliver_out``: the shard sends the DELIVER batch holding it (appended, delivered, turn ended);
- ``fe_deliver_in``: a frontend received that batch;
- ``fe_write``: the frontend writes the frames to the client socket (end of that loop turn).

The hooks are per batch (``BatchSocket``), per client read and per frontend loop turn, so with the
trace off the cost is one ``is None`` test per batch and per read.

The stages are kept in memory as (stage, key, time) and formatted and written every ``FLUSH_S``
from a loop timer (and at exit), not as they are made: a write (or formatting) on the path of the
message being traced would be measured as one of its hops. In a paired process (``--colocate``) the frontend's ``fe_publish_out`` and the shard's
``sh_publish_in`` are one in-process hand-over apart (~2 us), and a line-buffered write between the
two showed as a 40 us hop (docs/benchmarks.md, "Where a lone message's time goes in a pair").
"""

from __future__ import annotations

import asyncio
import atexit
import os
import time
import zlib
from typing import IO

from broker import contract

ENV = "SHARDMQ_TRACE_STAGES"
SAMPLE = 64  # trace 1 message in SAMPLE
FLUSH_S = 0.5  # lines made are written this long after the first of them (a loop timer), and at exit
READ_STAGE = "fe_read"  # recorded with the frontend's fe_publish_out, from the time of the last client read
_READ_WITH = "fe_publish_out"
_PUBLISH = contract.PUBLISH
_DELIVER = contract.DELIVER
_PUBLISH_RUN = contract.PUBLISH_RUN
_BODY_AT = {contract.PUBLISH: 6, contract.DELIVER: 10}


def sampled(body: bytes) -> bytes | None:
    """The trace key of a body that is in the sample, else None."""
    if len(body) < 16:
        return None
    key = bytes(body[:16])
    return key if zlib.crc32(key) % SAMPLE == 0 else None


class StageTrace:
    """One process's trace file; ``batch`` and ``mark_pending`` are the hooks."""

    def __init__(self, out: IO[str]) -> None:
        self.out = out
        self._pending: list[bytes] = []  # keys received in DELIVERs this turn, for fe_write
        self._lines: list[tuple[str, bytes, int]] = []  # (stage, key, t_ns) made, not written yet (``_write``)
        self._timer = False
        # monotonic ns when the frontend's last client read started (``read``), 0 = none yet
        self.read_ns = 0

    def read(self) -> None:
        """A frontend starts handling a read from a client (``data_received``): fe_read's time."""
        self.read_ns = time.monotonic_ns()

    def _add(self, lines: list[tuple[str, bytes, int]]) -> None:
        self._lines.extend(lines)
        if self._timer:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a unit test's StageTrace): nothing to defer to
            self._write()
            return
        self._timer = True
        loop.call_later(FLUSH_S, self._write)

    def _write(self) -> None:
        self._timer = False
        if self._lines:
            lines = self._lines
            self._lines = []
            self.out.write("".join(f"{stage} {key.hex()} {t}\n" for stage, key, t in lines))
            self.out.flush()

    def batch(self, stage: str, items: list, keep: bool = False) -> None:
        """Record ``stage`` for the sampled PUBLISH/DELIVER bodies of one batch."""
        now = time.monotonic_ns()
        lines: list[tuple[str, bytes, int]] = []
        for item in items:
            if item and item[0] == _PUBLISH_RUN:  # every body of a run is a message
                for body in item[6]:
                    key = sampled(body)
                    if key is not None:
                        self._line(lines, stage, key, now, keep)
                continue
            at = _BODY_AT.get(item[0]) if item else None
            if at is None or len(item) <= at or not isinstance(item[at], bytes | bytearray | memoryview):
                continue
            key = sampled(item[at])
            if key is not None:
                self._line(lines, stage, key, now, keep)
        if lines:
            self._add(lines)

    def _line(self, lines: list[tuple[str, bytes, int]], stage: str, key: bytes, now: int, keep: bool) -> None:
        lines.append((stage, key, now))
        if keep:
            self._pending.append(key)
        if stage == _READ_WITH and self.read_ns:
            lines.append((READ_STAGE, key, self.read_ns))

    def mark_pending(self, stage: str) -> None:
        """Record ``stage`` for the keys kept since the last call (the frontend's end of turn)."""
        if self._pending:
            now = time.monotonic_ns()
            self._add([(stage, key, now) for key in self._pending])
            self._pending = []


_trace: StageTrace | None = None
_loaded = False


def get(role: str = "") -> StageTrace | None:
    """This process's trace, opened on first use when ``SHARDMQ_TRACE_STAGES`` names a directory."""
    global _trace, _loaded
    if not _loaded:
        _loaded = True
        where = os.environ.get(ENV)
        if where:
            os.makedirs(where, exist_ok=True)
            name = f"{role or 'proc'}-{os.getpid()}.trace"
            _trace = StageTrace(open(os.path.join(where, name), "a"))  # noqa: SIM115 (process-long)
            atexit.register(_trace._write)
    return _trace
