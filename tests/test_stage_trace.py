"""broker/stage_trace.py (--trace-stages, a debug aid): what a process's trace writes, and when.

The lines are kept in memory and written from a loop timer, never on the path of the message they
time (in a pair the frontend's fe_publish_out and the shard's sh_publish_in are one in-process
hand-over apart, and a write between them was measured as that hop); the frontend's fe_read stage
comes with its fe_publish_out."""

from __future__ import annotations

import asyncio
import io
import zlib

import pytest

from broker import contract, stage_trace
from broker.stage_trace import READ_STAGE, SAMPLE, StageTrace


def _sampled_keys(n: int) -> list[bytes]:
    return [k for k in (i.to_bytes(16, "big") for i in range(100 * SAMPLE)) if zlib.crc32(k) % SAMPLE == 0][:n]


def _publish(body: bytes) -> list:
    return [contract.PUBLISH, "/", ["q"], "", "q", b"\x00\x00", body, False, None, None, None]


def _lines(out: io.StringIO) -> list[list[str]]:
    return [line.split() for line in out.getvalue().splitlines()]


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def test_lines_made_in_a_loop_are_written_by_a_timer_not_at_once(loop):
    key = _sampled_keys(1)[0]
    out = io.StringIO()
    trace = StageTrace(out)
    seen: list[str] = []

    async def go() -> None:
        trace.batch("sh_publish_in", [_publish(key), _publish(b"y" * 16)])
        seen.append(out.getvalue())  # the same turn: nothing written yet
        deadline = loop.time() + 30
        while not out.getvalue() and loop.time() < deadline:  # the timer's write
            await asyncio.sleep(0.01)

    loop.run_until_complete(go())
    assert seen == [""]
    lines = _lines(out)
    assert [line[:2] for line in lines] == [["sh_publish_in", key.hex()]]


def test_a_trace_without_a_running_loop_writes_at_once():
    key = _sampled_keys(1)[0]
    out = io.StringIO()
    StageTrace(out).batch("sh_deliver_out", [[contract.DELIVER, 1, 0, "t", 1, False, "", "q", b"", 0, key]])
    assert [line[:2] for line in _lines(out)] == [["sh_deliver_out", key.hex()]]


def test_fe_read_comes_with_fe_publish_out_and_keeps_the_read_time():
    keys = _sampled_keys(2)
    out = io.StringIO()
    trace = StageTrace(out)
    trace.batch("fe_publish_out", [_publish(keys[0])])  # no read recorded yet: no fe_read line
    trace.read()
    read_at = trace.read_ns
    trace.batch("fe_publish_out", [_publish(keys[1])])
    trace.batch("sh_publish_in", [_publish(keys[1])])  # only the frontend's out stage carries it
    lines = _lines(out)
    assert [line[:2] for line in lines] == [["fe_publish_out", keys[0].hex()], ["fe_publish_out", keys[1].hex()],
                                            [READ_STAGE, keys[1].hex()], ["sh_publish_in", keys[1].hex()]]
    publish_out = int(lines[1][2])
    assert int(lines[2][2]) == read_at <= publish_out


def test_the_lines_left_are_written_at_exit(tmp_path, monkeypatch):
    """The process's trace registers its last write with atexit (the timer may not have fired)."""
    import atexit

    registered: list = []
    monkeypatch.setattr(atexit, "register", registered.append)
    monkeypatch.setattr(stage_trace, "_loaded", False)
    monkeypatch.setattr(stage_trace, "_trace", None)
    monkeypatch.setenv(stage_trace.ENV, str(tmp_path))
    key = _sampled_keys(1)[0]
    loop = asyncio.new_event_loop()
    try:
        async def go() -> StageTrace:
            trace = stage_trace.get("shard")
            assert trace is not None
            trace.batch("sh_publish_in", [_publish(key)])
            return trace

        trace = loop.run_until_complete(go())
    finally:
        loop.close()
    (path,) = tmp_path.glob("shard-*.trace")
    assert path.read_text() == ""  # the timer never ran: the loop stopped first
    assert registered == [trace._write]
    registered[0]()
    trace.out.close()
    assert [line.split()[:2] for line in path.read_text().splitlines()] == [["sh_publish_in", key.hex()]]
