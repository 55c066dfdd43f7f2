"""One bad byte never costs a stream more than the damaged records, and never moves an offset (issue #9).

A real node, real stream queues filled by pika with confirms, segment files damaged on disk while
the node is stopped: at the head, middle and tail of sealed segments (verified lazily, when a
consumer first reads them), in a length field, across a segment boundary, and in the write segment.
Consumers then see every other message at the offset it had before, by "first" and by offset.
"""

from __future__ import annotations

import base64
import json
import os
import struct
import subprocess
import sys
import time
import urllib.request

import pika

from shard import synced_mark
from shard.segment import DATA_START
from shard.store import queue_dir
from tests.test_feature_stream import read
from tests.test_metrics import scrape, value

N = 100
STREAM = {"x-queue-type": "stream", "x-stream-max-segment-size-bytes": 4096}


def _segments(qdir: str) -> list[list[int]]:
    """Record start positions of each msgs file, in segment order."""
    out = []
    for name in sorted(n for n in os.listdir(qdir) if n.startswith("msgs.") and len(n) == 15):
        data = open(os.path.join(qdir, name), "rb").read()
        starts, pos = [], DATA_START
        while pos + 8 <= len(data) and (length := struct.unpack_from("<I", data, pos)[0]):
            starts.append(pos)
            pos += 8 + length
        out.append(starts)
    return out


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))


def _damage(qdir: str, case: str) -> set[int]:
    """Damage the stream's files as `case` says; returns the offsets that must be lost."""
    segs = _segments(qdir)
    assert len(segs) >= 4 and sum(map(len, segs)) == N, [len(s) for s in segs]
    firsts = [sum(map(len, segs[:i])) for i in range(len(segs))]

    def path(i: int) -> str:
        return os.path.join(qdir, f"msgs.{i + 1:010d}")

    def body_byte(i: int, j: int) -> None:  # a byte inside record j of segment i: its CRC catches it
        _flip(path(i), segs[i][j] + 40)

    if case == "head":  # first record of the stream (sealed segment 1, smeta valid: verified on read)
        body_byte(0, 0)
        return {0}
    if case == "middle":
        j = len(segs[1]) // 2
        body_byte(1, j)
        return {firsts[1] + j}
    if case == "length":  # a length field: the count comes from the segment's smeta
        j = len(segs[1]) // 2
        with open(path(1), "r+b") as f:
            f.seek(segs[1][j])
            f.write(struct.pack("<I", 3000))
        return {firsts[1] + j}
    if case == "tail":  # the last record of a sealed segment: damage, not a torn tail
        body_byte(1, len(segs[1]) - 1)
        return {firsts[2] - 1}
    if case == "boundary":  # last record of segment 2 and first of segment 3
        body_byte(1, len(segs[1]) - 1)
        body_byte(2, 0)
        return {firsts[2] - 1, firsts[2]}
    if case == "write":  # the middle of the write segment (valid records follow)
        last = len(segs) - 1
        j = len(segs[last]) // 2
        body_byte(last, j)
        return {firsts[last] + j}
    if case == "write-last":  # the last record of the write segment, synced (confirmed): damage
        last = len(segs) - 1
        assert synced_mark.read(qdir) == (last + 1, segs[last][-1] + (segs[last][-1] - segs[last][-2]))
        body_byte(last, len(segs[last]) - 1)
        return {N - 1}
    if case == "torn":  # an append past the synced mark that a crash cut short: a tail, nothing lost
        no, end = synced_mark.read(qdir)
        with open(os.path.join(qdir, f"msgs.{no:010d}"), "r+b") as f:
            f.seek(end)
            f.write(struct.pack("<II", 400, 12345) + b"y" * 60)
        return set()
    raise AssertionError(case)


def _queue_doc(node, name: str) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{node.http_port}/api/queues/%2F/{name}")
    req.add_header("Authorization", "Basic " + base64.b64encode(b"guest:guest").decode())
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def _verify(node) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "broker.cli", "verify", str(node.data_dir)],
                          capture_output=True, text=True, timeout=60)


def _check_all(conn, name: str, lost: set[int], total: int = N) -> None:
    """Every message but the lost ones, each at its own offset (the body says which it was)."""
    got = read(conn, name, total - len(lost), {"x-stream-offset": "first"}, wait_more=0.2)
    assert [o for o, _ in got] == [i for i in range(total) if i not in lost], name
    assert all(int(body[:6]) == o for o, body in got), name


def test_stream_damage_costs_only_the_damaged_records_and_keeps_offsets(node_factory):
    node = node_factory(frontends=1, shards=1, extra_args=["--stats-interval", "200"])
    cases = ("head", "middle", "length", "tail", "boundary", "write", "write-last", "torn")
    conn = node.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    for case in cases:
        ch.queue_declare(f"s-{case}", durable=True, arguments=STREAM)
        for i in range(N):
            ch.basic_publish("", f"s-{case}", b"%06d" % i + b"x" * 94, pika.BasicProperties(delivery_mode=2))
    conn.close()
    node.stop()
    lost = {case: _damage(queue_dir(str(node.data_dir), "/", f"s-{case}"), case) for case in cases}
    check = _verify(node)  # the offline check sees the damage in sealed segments too
    assert check.returncode == 1, check.stdout + check.stderr
    assert check.stdout.count("damaged: ") >= len(cases) - 1, check.stdout
    assert "before the synced mark" in check.stdout and "torn-tail: " in check.stdout

    node.start()
    conn = node.connect()
    for case in cases:
        _check_all(conn, f"s-{case}", lost[case])
    # Addressing by offset: a lost offset starts at the next one kept; others are exact.
    gone = min(lost["middle"])
    assert read(conn, "s-middle", 1, {"x-stream-offset": gone})[0][0] == gone + 1
    assert read(conn, "s-middle", 1, {"x-stream-offset": gone - 1})[0][0] == gone - 1
    assert read(conn, "s-boundary", 1, {"x-stream-offset": min(lost["boundary"])})[0][0] == max(lost["boundary"]) + 1
    assert read(conn, "s-write", 3, {"x-stream-offset": 90})[:3] == [(i, b"%06d" % i + b"x" * 94) for i in (90, 91, 92)]
    # New publishes continue after the last offset.
    ch = conn.channel()
    ch.confirm_delivery()
    ch.basic_publish("", "s-middle", b"%06d" % N, pika.BasicProperties(delivery_mode=2))
    assert read(conn, "s-middle", 1, {"x-stream-offset": N}, wait_more=0.1) == [(N, b"%06d" % N)]
    conn.close()
    log = node.log_text()
    assert "damaged bytes" in log and "offsets" in log and "lost" in log
    for case in cases:
        assert _queue_doc(node, f"s-{case}")["damaged_records"] == len(lost[case]), case
    # And in Prometheus: the node total and one series per damaged queue.
    total = sum(map(len, lost.values()))
    deadline = time.monotonic() + 10
    while value(scrape(node)["shardmq_damaged_records"]) != total:
        assert time.monotonic() < deadline, scrape(node)["shardmq_damaged_records"]
        time.sleep(0.05)
    per = scrape(node, "/metrics/per-object")
    assert value(per["shardmq_queue_damaged_records"], vhost="/", queue="s-boundary") == 2

    # The repair is durable: the next start finds clean segments, the same offsets, no new loss.
    node.stop()
    check = _verify(node)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "set-aside: " in check.stdout
    node.start()
    conn = node.connect()
    for case in cases:
        _check_all(conn, f"s-{case}", lost[case], N + 1 if case == "middle" else N)
    conn.close()
    assert _queue_doc(node, "s-middle")["damaged_records"] == 0
