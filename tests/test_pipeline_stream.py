"""`spark.readStream.format("shardmq")`: following a stream queue with offsets in Spark's checkpoint.

Exactly-once into a file sink is checked by reading the sink with Spark (which honours the sink's
`_spark_metadata` log, so files of a batch that never committed do not count): every offset once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from tests.harness import REPO_ROOT, group_members
from tests.helpers import uid
from tests.pipeline_helpers import declare_stream, publish, wait_for


def _stream(spark, node, queue, **options):
    r = spark.readStream.format("shardmq").option("uri", node.url).option("queue", queue)
    for k, v in options.items():
        r = r.option(k, str(v))
    return r.load()


def _start(df, out, checkpoint):
    return (df.selectExpr("offset", "CAST(body AS STRING) AS body").writeStream.format("parquet")
            .option("path", str(out)).option("checkpointLocation", str(checkpoint)).start())


def _sink(spark, out):
    if not os.path.exists(os.path.join(out, "_spark_metadata")):
        return []
    return [r.offset for r in spark.read.schema("offset long, body string").parquet(str(out)).select("offset").collect()]


def test_stop_and_restart_resumes_where_it_committed(spark, shared_node, tmp_path):
    q = uid("follow")
    declare_stream(shared_node.url, q)
    publish(shared_node.url, q, ((b"a%d" % i, None) for i in range(500)))
    out, ck = tmp_path / "out", tmp_path / "ck"
    query = _start(_stream(spark, shared_node, q, startingOffset="first", maxRecordsPerTrigger=200), out, ck)
    try:
        query.processAllAvailable()
        sizes = [p["numInputRows"] for p in query.recentProgress if p["numInputRows"]]
        assert sum(sizes) == 500 and max(sizes) <= 200 and len(sizes) >= 3
    finally:
        query.stop()
    publish(shared_node.url, q, ((b"b%d" % i, None) for i in range(300)))
    # Restarted on the same checkpoint: startingOffset no longer matters, the checkpoint does.
    query = _start(_stream(spark, shared_node, q, startingOffset="first"), out, ck)
    try:
        query.processAllAvailable()
    finally:
        query.stop()
    got = _sink(spark, str(out))
    assert sorted(got) == list(range(800))
    bodies = dict(spark.read.parquet(str(out)).select("offset", "body").collect())
    assert bodies[499] == "a499" and bodies[500] == "b0"


def test_new_query_starts_at_next_by_default(spark, shared_node, tmp_path):
    q = uid("next")
    declare_stream(shared_node.url, q)
    publish(shared_node.url, q, ((b"old", None) for _ in range(10)))
    out, ck = tmp_path / "out", tmp_path / "ck"
    query = _start(_stream(spark, shared_node, q), out, ck)
    try:
        query.processAllAvailable()
        publish(shared_node.url, q, ((b"new", None) for _ in range(5)))
        query.processAllAvailable()
    finally:
        query.stop()
    assert sorted(_sink(spark, str(out))) == list(range(10, 15))


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the query's python and its Spark JVM
    except ProcessLookupError:
        pass
    proc.wait()
    wait_for(lambda: not group_members(proc.pid), 15, what="the killed query's JVM to exit")


def _committed_offset(checkpoint: str) -> int:
    """The source offset of the query's last committed batch, read from its checkpoint files.

    Spark writes a batch's offsets to `offsets/N`, then the sink's files and its `_spark_metadata`
    entry, and `commits/N` last; the third line of `offsets/N` is this source's {"offset": next}.
    Read from disk, not by a Spark job on the sink: polling the sink ran a job every poll.
    """
    try:
        done = [int(n) for n in os.listdir(os.path.join(checkpoint, "commits")) if n.isdigit()]
    except FileNotFoundError:
        return 0
    if not done:
        return 0
    with open(os.path.join(checkpoint, "offsets", str(max(done)))) as f:
        return json.loads(f.read().splitlines()[2])["offset"]


def test_query_process_killed_and_restarted_keeps_exactly_once(spark, shared_node, tmp_path):
    q = uid("killed")
    declare_stream(shared_node.url, q)
    publish(shared_node.url, q, ((b"m%d" % i, None) for i in range(3000)))
    out, ck = str(tmp_path / "out"), str(tmp_path / "ck")
    # 100 per batch: 30 batches, so the kill after the first commit lands mid-stream.
    argv = [sys.executable, "-m", "tests.pipeline_query", shared_node.url, q, out, ck, "100"]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    with open(tmp_path / "query.log", "ab") as log:
        proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            # A new Spark JVM per query process: on a loaded 2-core machine its first batch took over 120 s once.
            wait_for(lambda: _committed_offset(ck) >= 100, 300, interval=0.05, what="the query to commit a batch")
        finally:
            _kill_group(proc)  # kill -9 of the query's python and JVM, mid-stream
    first_run = _committed_offset(ck)
    assert 100 <= first_run < 3000
    publish(shared_node.url, q, ((b"m%d" % i, None) for i in range(3000, 4000)))
    # Restarted in another process (this session's JVM) on the killed query's checkpoint.
    query = _start(_stream(spark, shared_node, q, startingOffset="first", maxRecordsPerTrigger=1000), out, ck)
    try:
        query.processAllAvailable()
    finally:
        query.stop()
    got = _sink(spark, out)
    assert len(got) == 4000 and sorted(got) == list(range(4000))


def test_retention_past_the_checkpoint_fails_unless_told_otherwise(spark, shared_node, tmp_path):
    q = uid("lossy")
    declare_stream(shared_node.url, q, {"x-max-length": 200, "x-stream-max-segment-size-bytes": 4096})
    publish(shared_node.url, q, ((b"x%d" % i, None) for i in range(100)))
    out, ck = tmp_path / "out", tmp_path / "ck"
    query = _start(_stream(spark, shared_node, q, startingOffset="first"), out, ck)
    try:
        query.processAllAvailable()
    finally:
        query.stop()
    assert sorted(_sink(spark, str(out))) == list(range(100))
    publish(shared_node.url, q, ((b"y%d" % i, None) for i in range(1000)), wait=False)
    wait_for(lambda: _first_offset(shared_node.url, q) > 100, what="retention to drop offset 100")
    query = _start(_stream(spark, shared_node, q), out, ck)
    with pytest.raises(Exception, match="removed by retention"):
        query.processAllAvailable()
    query.stop()
    query = _start(_stream(spark, shared_node, q, failOnDataLoss="false"), out, ck)
    try:
        query.processAllAvailable()
    finally:
        query.stop()
    got = sorted(_sink(spark, str(out)))
    first = _first_offset(shared_node.url, q)
    assert got[:100] == list(range(100)) and got[100:] == list(range(first, 1100))


def _first_offset(url: str, queue: str) -> int:
    from loadtest.amqp_client import AMQPClient
    from pipeline.offsets import bounds

    with AMQPClient(url).connect() as c:
        return bounds(c, queue).first
