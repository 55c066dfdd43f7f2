"""loadtest/repl_follower_cpu.py: a real receiver (a child process) takes the stand-in leader's
handshake, empty full sync and batches, acks them all, and its CPU per message is reported."""

from __future__ import annotations

import asyncio

from loadtest import repl_follower_cpu as bench


def test_follower_cpu_bench_streams_and_reports(capsys) -> None:
    r = asyncio.run(asyncio.wait_for(bench.measure(bench.REPO_ROOT, batches=30, per=20, size=1100), 60))
    assert r["messages"] == 600
    assert r["cpu_s"] > 0 and r["cpu_us_per_msg"] > 0 and r["msg_per_s"] > 0
    assert bench.main(["--batches", "5", "--per-batch", "10"]) == 0
    assert "follower CPU" in capsys.readouterr().out
