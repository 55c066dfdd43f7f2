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

- ``fe_publish_out``: a frontend sends the PUBLISH batch holding it to the shard (end of the loop
  turn that read it from the client);
- ``sh_publish_in``: the shard received that batch;
- ``sh_deliver_out``: the shard sends the DELIVER batch holding it (appended, delivered, turn ended);
- ``fe_deliver_in``: a frontend received that batch;
- ``fe_write``: the frontend writes the frames to the client socket (end of that loop turn).

The hooks are per batch (``BatchSocket``) and per frontend loop turn, so with the trace off the
cost is one ``is None`` test per batch.
"""

from __future__ import annotations

import os
import time
import zlib
from typing import IO

from broker import contract

ENV = "SHARDMQ_TRACE_STAGES"
SAMPLE = 64  # trace 1 message in SAMPLE
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

    def batch(self, stage: str, items: list, keep: bool = False) -> None:
        """Record ``stage`` for the sampled PUBLISH/DELIVER bodies of one batch."""
        now = time.monotonic_ns()
        lines = []
        for item in items:
            if item and item[0] == _PUBLISH_RUN:  # every body of a run is a message
                for body in item[6]:
                    key = sampled(body)
                    if key is not None:
                        lines.append(f"{stage} {key.hex()} {now}\n")
                        if keep:
                            self._pending.append(key)
                continue
            at = _BODY_AT.get(item[0]) if item else None
            if at is None or len(item) <= at or not isinstance(item[at], bytes | bytearray | memoryview):
                continue
            key = sampled(item[at])
            if key is not None:
                lines.append(f"{stage} {key.hex()} {now}\n")
                if keep:
                    self._pending.append(key)
        if lines:
            self.out.write("".join(lines))

    def mark_pending(self, stage: str) -> None:
        """Record ``stage`` for the keys kept since the last call (the frontend's end of turn)."""
        if self._pending:
            now = time.monotonic_ns()
            self.out.write("".join(f"{stage} {key.hex()} {now}\n" for key in self._pending))
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
            _trace = StageTrace(open(os.path.join(where, name), "a", buffering=1))  # noqa: SIM115 (process-long)
    return _trace
