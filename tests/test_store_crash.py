"""A process appending to a QueueStore is killed with SIGKILL; the store recovers a clean prefix."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from shard.store import QueueStore

pytestmark = pytest.mark.integration  # SIGKILLs a writer subprocess

CHILD = textwrap.dedent(
    """
    import sys
    from shard.store import QueueStore
    s = QueueStore(sys.argv[1], segment_size=16384)
    i = int(sys.argv[2])
    while True:
        s.append(i, 1, "ex", "rk", b"", b"%d|" % i + b"z" * (i % 300))
        if i % 97 == 0:
            m = s.shift()
            if m is not None:
                s.ack(m[0])
                s.flush_acks()  # what the shard does at the end of each loop turn
        if i % 500 == 0:
            sys.stdout.write("%d\\n" % i)
            sys.stdout.flush()
        i += 1
    """
)


def _run_and_kill(path: str, start: int, until: int) -> int:
    """Run the child from `start` until it reports >= `until` appends; returns the last reported index."""
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, path, str(start)], stdout=subprocess.PIPE, env=env, text=True
    )
    last = -1
    try:
        for line in proc.stdout:
            last = int(line)
            if last >= until:
                break
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        proc.stdout.close()
    assert last >= until, "child died early"
    return last


def test_sigkill_mid_append_loop(tmp_path):
    path = str(tmp_path)
    start = 0
    for _ in range(3):
        reported = _run_and_kill(path, start, start + 4000)
        s = QueueStore(path, segment_size=16384)
        seen = []
        while (m := s.shift()) is not None:
            i = int(m[7].split(b"|")[0])
            assert m[7] == b"%d|" % i + b"z" * (i % 300)
            seen.append(i)
        # The child acks from the head, so what is left is one unbroken run of appends that
        # includes every append it reported (a torn last record, if any, is cut).
        assert seen == list(range(seen[0], seen[-1] + 1))
        assert seen[0] > 0 and seen[-1] >= reported
        assert s.ready == 0
        s.close()  # the shifted ones are outstanding, ready again on the next open
        start = seen[-1] + 1
