"""broker/turn_probe.py (a debug aid): with SHARDMQ_TEST_TURN_PROBE a process records the loop
thread's CPU between two turns, a wrapped method's long calls (with the kind of the item it got)
and its garbage collections, on the clock the perf tool's probe uses."""

from __future__ import annotations

import asyncio
import gc
import time

from broker import turn_probe


class Busy:
    def work(self, item: list) -> None:
        end = time.thread_time() + 0.006
        while time.thread_time() < end:
            pass


def test_the_probe_records_a_long_turn_a_long_call_and_a_collection(tmp_path, monkeypatch):
    monkeypatch.setenv(turn_probe.ENV, str(tmp_path))
    monkeypatch.setenv(turn_probe.WRAP_ENV, f"{__name__}:Busy.work,no.such.module:X.y")
    original = Busy.work
    loop = asyncio.new_event_loop()
    try:
        probe = turn_probe.install(loop, "node")
        assert probe is not None and probe.unwrapped == ["no.such.module:X.y"]

        async def main() -> float:
            await asyncio.sleep(0.01)
            started = time.monotonic_ns()
            Busy().work([20, "payload"])  # one turn of ~6 ms of CPU
            await asyncio.sleep(0.01)
            probe.pace(1000.0, 0.0031)  # the node's delete pacer after one of its windows
            keep = [[] for _ in range(200_000)]  # a full collection walks them: well over 200 µs
            gc.collect()
            del keep
            await asyncio.sleep(0.01)
            return started

        started = loop.run_until_complete(main())
        probe.flush()
        gc.callbacks.remove(probe._on_gc)
    finally:
        Busy.work = original
        loop.close()
    lines = [line.split() for line in next(tmp_path.glob("node-*.turns")).read_text().splitlines()]
    calls = [x for x in lines if x[0] == "call"]
    assert [x[1] for x in calls] == ["Busy.work[20]"] and int(calls[0][4]) >= 5000
    assert int(calls[0][2]) >= started
    assert any(x[0] == "tick" and int(x[3]) >= 5000 for x in lines)  # that turn's CPU
    assert any(x[0] == "gc" and x[4] == "2" for x in lines)
    assert [x[2:] for x in lines if x[0] == "pace"] == [["1000", "3100"]]


def test_the_report_names_the_longest_turn_collections_and_calls(tmp_path, capsys):
    from loadtest import turn_report

    (tmp_path / "shard-7.turns").write_text(
        "tick 1 4000 2500\ntick 2 9000 6100\ngc 3 900 800 2 10\ngc 4 300 250 1 5\n"
        "call ShardWorker._handle[20] 5 7000 6900\ncall ShardWorker._handle[20] 6 300 300\n"
        "call ShardWorker._on_control[4] 7 900 850\ncall cut\n")
    assert turn_report.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "shard-7: longest turn 6.1 ms CPU (9.0 ms wall)"
    assert "  gc gen 2: 1 over 200 us, longest 0.8 ms CPU" in out
    assert out[-2] == "  ShardWorker._handle[20]: 2 calls over 200 us, longest 6.9 ms, total 7.2 ms CPU"
    assert out[-1].startswith("  ShardWorker._on_control[4]: 1 calls")


def test_the_report_of_a_dir_without_turns_files_is_an_error_naming_it(tmp_path, capsys):
    import pytest

    from loadtest import turn_report

    with pytest.raises(SystemExit) as e:
        turn_report.main([str(tmp_path)])
    assert e.value.code == 2 and f"no *.turns files in {tmp_path}" in capsys.readouterr().err
