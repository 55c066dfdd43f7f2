"""A shard that is still starting gets data from frontends (they learn its new epoch as soon as the
old shard dies): those batches must be handled once its snapshot is loaded, not dropped while
PROCESSED is answered (which left a confirming publisher waiting forever).

Drives a real ShardWorker over the real contract (broker/contract.py; the node's control socket,
broker/unixio.py, and the data plane of each --ipc-transport, broker/data_sockets.py): the test plays
the node (its listening end answering HELLO with SNAPSHOT, deliberately late) and a frontend (a data-plane connection that sends a
confirmed PUBLISH before the shard has its snapshot)."""

from __future__ import annotations

import asyncio
import os

import pytest

from broker import contract, data_sockets
from broker.definitions import Definitions
from broker.defs_fence import FenceWord
from broker.unixio import UnixRouter
from shard.worker import ShardWorker
from tests.harness import async_wait_until


@pytest.mark.parametrize("transport", ["unix", "zmq"])
def test_a_publish_sent_before_the_snapshot_is_stored_and_confirmed(tmp_path, monkeypatch, transport):
    monkeypatch.setenv(data_sockets.ENV, transport)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    data_dir = tmp_path / "data"
    defs = Definitions()
    ops, _name = defs.plan_queue_declare("/", "q", False, True, False, False, {}, None, 1)
    defs.apply_all(ops)
    epoch = 3

    async def scenario() -> list:
        loop = asyncio.get_running_loop()
        from_shard: asyncio.Queue = asyncio.Queue()
        node = UnixRouter(loop, contract.node_stream_path(str(run_dir)),
                          lambda ident, _header, items: from_shard.put_nowait((ident, items)))
        answers: list = []
        # The frontend's publish lane, created and written to before the shard exists (its batch waits
        # until the shard listens).
        fe = data_sockets.shard_connection(loop, str(run_dir), 0, contract.worker_id("frontend", 0),
                                           lambda _ident, _header, items: answers.extend(items),
                                           lambda _dest: [epoch, 1])
        fe.put(None, [contract.PUBLISH, "/", ["q"], "", "q", b"\x00\x00", b"early", True, 1, 1, 7])
        FenceWord(str(run_dir))  # the node creates the definitions fence before it spawns workers
        shard = ShardWorker(0, str(run_dir), loop)
        start = loop.create_task(shard.start())
        ident, items = await asyncio.wait_for(from_shard.get(), 10)
        assert items[0][0] == contract.HELLO
        # The SNAPSHOT goes only once the shard holds the early batch (what the test is about).
        await async_wait_until(lambda: shard._early, 10, "the early batch at the shard")
        settings = {"data_dir": str(data_dir), "segment_size": 1 << 20, "sync": "fsync", "shards": 1,
                    "consumer_timeout": 0}
        node.send_now(ident, [[contract.SNAPSHOT, defs.version, defs.to_dict(), {0: epoch}, settings]])
        await asyncio.wait_for(start, 10)
        await async_wait_until(lambda: any(a[0] == contract.CONFIRM for a in answers), 10, "a confirm")
        await shard.stop()
        fe.close()
        node.close()
        return answers

    answers = asyncio.run(scenario())
    kinds = [a[0] for a in answers]
    assert [a for a in answers if a[0] == contract.CONFIRM] == [[contract.CONFIRM, 1, 1, [7]]]
    assert [contract.PROCESSED, 1] in answers and contract.CONFIRM_NACK not in kinds
    qdir = [os.path.join(r, d) for r, ds, _f in os.walk(data_dir) for d in ds if len(d) == 40]
    assert qdir, "the queue directory was not created"
