"""`shardmq-segments`: reading segment files with CRC32 checks (pipeline/segments.py, segments_source.py).

Storage-level tests write files with the project's own stores; the Spark tests read a real node's
data dir after the node stopped, including a corrupted record in both modes.
"""

from __future__ import annotations

import os
import shutil

import pyspark  # noqa: F401  (the spark extra is installed by scripts/test.sh: missing is a failure)
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs
from pamqp import commands

from pipeline import segments
from pipeline.segments import CorruptRecord, ScanStats
from shard import record
from shard.segment import DATA_START
from shard.store import QueueStore, queue_dir
from shard.stream_store import StreamStore
from tests.pipeline_helpers import declare_stream, publish

assert shutil.which("java") is not None, "Spark needs a Java runtime (scripts/test.sh installs one)"

PROPS = commands.Basic.Properties(delivery_mode=2, content_type="text/plain").marshal()


def _stream(tmp_path, n: int, segment_size: int = 4096) -> str:
    qdir = queue_dir(str(tmp_path), "/", "events")
    st = StreamStore(qdir, segment_size=segment_size)
    for i in range(n):
        st.append(1_700_000_000_000 + i, 1, "ex", f"rk.{i % 3}", PROPS, b"body-%05d" % i)
    st.sync()
    st.close()
    return qdir


def _all(path: str, mode: str = "PERMISSIVE", include_acked: bool = False) -> tuple[list, ScanStats]:
    stats = ScanStats()
    out = []
    for seg in segments.plan(path):
        out.extend(segments.read_segment(seg, mode, include_acked, stats))
    return out, stats


def _record_positions(path: str) -> list[int]:
    with open(path, "rb") as f:
        data = f.read()
    return [p for p, _f, _b in record.scan(data, DATA_START, len(data), True, record.ScanResult())]


def test_stream_segments_read_back_in_offset_order(tmp_path):
    _stream(tmp_path, 300)
    files = segments.plan(str(tmp_path))
    assert len(files) > 3 and {f.kind for f in files} == {"stream"}
    rows, stats = _all(str(tmp_path))
    assert [r[0] for r in rows] == list(range(300))
    assert [r[6] for r in rows] == [b"body-%05d" % i for i in range(300)]
    assert rows[7][1:5] == (1_700_000_000_007, 1, "ex", "rk.1")
    assert stats.records == 300 and stats.corrupt == 0


def test_flipped_body_byte_is_skipped_or_fails(tmp_path):
    qdir = _stream(tmp_path, 100)
    msgs = os.path.join(qdir, "msgs.0000000002")
    positions = _record_positions(msgs)
    with open(msgs, "r+b") as f:
        f.seek(positions[1] + 20)  # inside the second record of segment 2
        byte = f.read(1)
        f.seek(positions[1] + 20)
        f.write(bytes([byte[0] ^ 0xFF]))
    bad_offset = segments.plan(str(tmp_path))[1].first_offset + 1
    rows, stats = _all(str(tmp_path))
    assert stats.corrupt == 1 and "CRC mismatch" in stats.problems[0]
    # Only that record is gone; the offsets after it are still right.
    assert [r[0] for r in rows] == [i for i in range(100) if i != bad_offset]
    assert all(r[6] == b"body-%05d" % r[0] for r in rows)
    with pytest.raises(CorruptRecord, match="CRC mismatch"):
        _all(str(tmp_path), mode="FAILFAST")


def test_stream_repaired_by_the_node_reads_with_the_same_offsets(tmp_path):
    qdir = _stream(tmp_path, 100)
    with open(os.path.join(qdir, "msgs.0000000002"), "r+b") as f:
        f.seek(DATA_START + 20)  # the first record of segment 2 (sealed)
        byte = f.read(1)
        f.seek(DATA_START + 20)
        f.write(bytes([byte[0] ^ 0xFF]))
    bad_offset = segments.plan(str(tmp_path))[1].first_offset
    st = StreamStore(qdir, segment_size=4096)  # what a node does: reading repairs it (a filler record)
    c = st.cursor("first")
    while st.read(c) is not None:
        pass
    assert st.damaged_records == 1
    st.sync()
    st.close()
    rows, stats = _all(str(tmp_path))  # the filler is neither delivered nor counted, offsets stay
    assert [r[0] for r in rows] == [i for i in range(100) if i != bad_offset]
    assert all(r[6] == b"body-%05d" % r[0] for r in rows)
    assert stats.corrupt == 0 and stats.records == 99


def test_garbage_length_resyncs_at_the_next_valid_record(tmp_path):
    qdir = _stream(tmp_path, 40, segment_size=1 << 20)
    msgs = os.path.join(qdir, "msgs.0000000001")
    positions = _record_positions(msgs)
    with open(msgs, "r+b") as f:
        f.seek(positions[10])
        f.write(b"\xff\xff\xff\x7f")  # a length running past the end of the file
    rows, stats = _all(str(tmp_path))
    bodies = [r[6] for r in rows]
    assert b"body-00010" not in bodies and len(bodies) == 39 and stats.corrupt == 1
    assert bodies[10] == b"body-00011"


def test_classic_queue_acked_records(tmp_path):
    qdir = queue_dir(str(tmp_path), "vh", "work")
    st = QueueStore(qdir, segment_size=4096)
    for i in range(50):
        st.append(1_700_000_000_000 + i, 1, "", "work", PROPS, b"job-%03d" % i)
    for _ in range(20):
        msg = st.shift()
        if int(msg[7][4:]) % 2 == 0:
            st.ack(msg[0])  # the even ones of the first 20 are done
    st.flush_acks()
    st.sync()
    st.close()
    live, stats = _all(str(tmp_path))
    assert [r[6] for r in live] == [b"job-%03d" % i for i in range(50) if i >= 20 or i % 2]
    assert stats.acked == 10 and all(r[0] is None and not r[8] for r in live)
    every, _ = _all(str(tmp_path), include_acked=True)
    assert [(r[6], r[8]) for r in every] == [(b"job-%03d" % i, i < 20 and i % 2 == 0) for i in range(50)]
    assert {f.vhost for f in segments.plan(str(tmp_path))} == {"vh"}


def test_reading_never_changes_the_files(tmp_path):
    qdir = _stream(tmp_path, 60)
    with open(os.path.join(qdir, "msgs.0000000001"), "ab") as f:
        f.write(b"\x01\x02")  # a torn tail: the node's recovery would cut it, a reader must not
    before = {n: os.path.getsize(os.path.join(qdir, n)) for n in os.listdir(qdir)}
    _all(str(tmp_path))
    assert {n: os.path.getsize(os.path.join(qdir, n)) for n in os.listdir(qdir)} == before


def test_plan_refuses_a_directory_without_queues(tmp_path):
    with pytest.raises(ValueError, match="not a ShardMQ data dir"):
        segments.plan(str(tmp_path))
    with pytest.raises(FileNotFoundError):
        segments.plan(str(tmp_path / "missing"))


# --------------------------------------------------------------------------- Spark, a real node


@pytest.fixture(scope="module")
def stopped_node_dir(node_factory_module):
    """A node's data dir with a stream (1500 messages) and a classic queue (30, 10 acked), node stopped."""
    node = node_factory_module(name="segnode", frontends=1, shards=2,
                               extra_args=["--segment-size", "65536"])
    declare_stream(node.url, "audit")
    publish(node.url, "audit", ((b'{"n": %d}' % i, commands.Basic.Properties(
        delivery_mode=2, message_id=f"m{i}", headers={"region": "eu" if i % 2 else "us"})) for i in range(1500)))
    conn = node.connect()
    ch = conn.channel()
    ch.queue_declare("jobs", durable=True)
    ch.confirm_delivery()
    for i in range(30):
        ch.basic_publish("", "jobs", b"job-%d" % i, pika_persistent())
    for _ in range(10):
        method, _props, _body = ch.basic_get("jobs", auto_ack=False)
        ch.basic_ack(method.delivery_tag)
    conn.close()
    node.stop()
    return node.data_dir


def pika_persistent():
    import pika

    return pika.BasicProperties(delivery_mode=2)


@pytest.fixture(scope="module")
def node_factory_module(tmp_path_factory):
    from tests.harness import NodeFactory

    factory = NodeFactory(tmp_path_factory.mktemp("segments"))
    yield factory
    factory.cleanup()


def test_spark_reads_a_stopped_nodes_data_dir(spark, stopped_node_dir):
    df = spark.read.format("shardmq-segments").load(str(stopped_node_dir))
    audit = df.where("queue = 'audit'").orderBy("offset").collect()
    assert [r.offset for r in audit] == list(range(1500))
    assert audit[3].body == b'{"n": 3}' and audit[3].properties.message_id == "m3"
    assert audit[3].headers == {"region": "eu"} and audit[3].vhost == "/" and audit[3].timestamp is not None
    assert spark.read.format("shardmq-segments").option("queue", "audit").load(
        str(stopped_node_dir)).select("segment").distinct().count() > 1
    jobs = df.where("queue = 'jobs'").orderBy("position").collect()
    assert [r.body for r in jobs] == [b"job-%d" % i for i in range(10, 30)]
    every = (spark.read.format("shardmq-segments").option("includeAcked", "true").option("queue", "jobs")
             .load(str(stopped_node_dir)).orderBy("position").collect())
    assert [(r.body, r.acked) for r in every] == [(b"job-%d" % i, i < 10) for i in range(30)]
    parsed = (spark.read.format("shardmq-segments").option("queue", "audit").option("bodyFormat", "json")
              .option("bodySchema", "n long").load(str(stopped_node_dir)))
    assert parsed.selectExpr("sum(n)").first()[0] == sum(range(1500))


def test_spark_corrupt_record_permissive_and_failfast(spark, stopped_node_dir, tmp_path):
    copy = tmp_path / "backup"
    shutil.copytree(stopped_node_dir, copy, ignore=shutil.ignore_patterns("run"))
    files = [f for f in segments.plan(str(copy), queue="audit")]
    target = files[1]
    pos = _record_positions(target.path)[0]
    with open(target.path, "r+b") as f:
        f.seek(pos + 40)
        b = f.read(1)
        f.seek(pos + 40)
        f.write(bytes([b[0] ^ 0x55]))
    reader = spark.read.format("shardmq-segments").option("queue", "audit")
    offsets = [r.offset for r in reader.load(str(copy)).orderBy("offset").select("offset").collect()]
    assert offsets == [i for i in range(1500) if i != target.first_offset]
    with pytest.raises(Exception, match="CRC mismatch"):
        reader.option("mode", "FAILFAST").load(str(copy)).count()
    with pytest.raises(Exception, match="mode must be PERMISSIVE or FAILFAST"):
        reader.option("mode", "DROPALL").load(str(copy)).count()


@settings(max_examples=60, deadline=None)
@given(n=hs.integers(0, 14), rows=hs.integers(1, 5),
       flips=hs.lists(hs.tuples(hs.integers(0, 2000), hs.integers(1, 255)), max_size=3), cut=hs.integers(0, 2000))
def test_columnar_reader_takes_exactly_the_records_scan_does(n, rows, flips, cut):
    """pipeline.segment_columns (CRC loop + numpy field checks + Arrow views) against shard.record.scan/read."""
    import numpy as np
    import pyarrow as pa

    from pipeline import segment_columns

    buf = bytearray(4096)
    pos = DATA_START
    for i in range(n):  # bodies around the 12 bytes Arrow stores inline in a view; a non-ASCII name
        payload = record.encode_payload(1_700_000_000_000 + i, i & 1, "éx".encode() * (i % 3), b"rk.%d" % i,
                                        PROPS if i % 4 else b"", b"b" * (i * 3 % 29))
        pos += record.write(buf, pos, payload)
    for at, x in flips:
        buf[at % len(buf)] ^= x
    data = bytes(buf)
    end = DATA_START + cut % (len(data) - DATA_START)
    want = record.ScanResult()
    plain = [p for p, _f, _b in record.scan(data, DATA_START, end, True, want)]
    a, pbuf, mv = np.frombuffer(data, np.uint8), pa.py_buffer(data), memoryview(data)
    got: list[int] = []
    pos = DATA_START
    while True:
        positions, stop = segment_columns.crc_run(data, mv, pos, end, rows)
        good = 0
        if positions:
            run, good = segment_columns.decode_run(a, pbuf, positions)
            for i, p in enumerate(run.position.tolist()):
                ts, flags, ex, rk, props, body, _ = record.read(data, p)
                assert (int(run.ts[i]), int(run.flags[i]), run.exchange[i].as_py(), run.routing_key[i].as_py(),
                        run.props[i].as_py(), run.body[i].as_py()) == (ts, flags, ex, rk, props, body)
            got += positions[:good]
            if good == rows:
                pos = stop
                continue
        at = positions[good] if good < len(positions) else stop
        break
    rest = record.ScanResult()
    assert next(record.scan(data, at, end, True, rest), None) is None
    assert got == plain and (rest.end, rest.reason) == (want.end, want.reason)


def test_filler_records_are_never_returned(tmp_path):
    """A record the node's damage recovery wrote over bad bytes (record.filler) is not a message."""
    qdir = _stream(tmp_path, 30, segment_size=1 << 20)
    msgs = os.path.join(qdir, "msgs.0000000001")
    positions = _record_positions(msgs)
    with open(msgs, "r+b") as f:
        f.seek(positions[4])
        f.write(record.filler(positions[5] - positions[4]))
    rows, stats = _all(str(tmp_path))
    assert [r[0] for r in rows] == [i for i in range(30) if i != 4]  # its offset stays taken
    assert stats.corrupt == 0 and stats.records == 29
    assert all(r[6] == b"body-%05d" % r[0] for r in rows)
