"""The Protocols in which a part describes what it uses of its holder name only what the holder has.

They are annotations (no type checker runs in CI), so a renamed attribute of ShardWorker, FrontendWorker,
AMQPConnection, Channel or Queue would leave them stale without this check; the calls themselves are
covered by the behaviour tests. docs/architecture.md, "Import direction".
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from frontend import stats as frontend_stats
from frontend import ws, ws_listener
from frontend.amqp import channel, dedup_publish, shard_loss
from frontend.amqp.connection import AMQPConnection
from frontend.worker import FrontendWorker
from shard import (
    ack_timeouts,
    admin,
    consumer_order,
    dead_letter_forwards,
    dedup,
    delayed,
    feature_queue,
    kvstore,
    stats,
    stream_queue,
)
from shard.queue import Queue
from shard.worker import ShardWorker


def members(protocol: type) -> set[str]:
    """The attributes and methods a Protocol class declares itself."""
    names = set(vars(protocol).get("__annotations__", {}))
    names.update(name for name, value in vars(protocol).items()
                 if not (name.startswith("__") and name.endswith("__"))
                 and (callable(value) or isinstance(value, (property, staticmethod))))
    return names - {"_is_protocol", "_is_runtime_protocol"}


def missing(protocol: type, holder: object) -> set[str]:
    cls = holder if isinstance(holder, type) else type(holder)
    slots = {s for klass in cls.__mro__ for s in getattr(klass, "__slots__", ())}
    return {name for name in members(protocol) if not hasattr(holder, name) and name not in slots}


def test_members_sees_attributes_and_methods():
    assert members(stream_queue.StreamShard) == {"timers", "mark_dirty"}
    assert missing(stream_queue.StreamShard, SimpleNamespace(timers=None)) == {"mark_dirty"}


def test_shard_parts_describe_shard_worker(tmp_path):
    loop = asyncio.new_event_loop()
    worker = ShardWorker(0, str(tmp_path), loop)
    try:
        for protocol in (ack_timeouts.TimeoutsShard, admin.AdminShard, dead_letter_forwards.ForwardsShard,
                         dedup.DedupShard, delayed.DelayShard, feature_queue.FeatureShard, kvstore.KVShard,
                         stats.StatsShard, stream_queue.StreamShard):
            assert missing(protocol, worker) == set(), protocol.__name__
    finally:
        worker.timers.close()
        loop.close()
    for queue_class in (Queue, feature_queue.FeatureQueue):
        assert missing(consumer_order.OrderedQueue, queue_class) == set(), queue_class.__name__


def test_frontend_parts_describe_their_holders(tmp_path):
    loop = asyncio.new_event_loop()
    try:
        worker = FrontendWorker(0, str(tmp_path), loop)
        for protocol in (frontend_stats.StatsFrontend, ws.WSFrontend, ws_listener.ListenerFrontend):
            assert missing(protocol, worker) == set(), protocol.__name__
        conn = AMQPConnection(worker)
        for protocol in (channel.ChannelConnection, shard_loss.LosingConnection, dedup_publish.DedupConnection):
            assert missing(protocol, conn) == set(), protocol.__name__
        assert missing(dedup_publish.DedupChannel, channel.Channel(conn, 1)) == set()
    finally:
        loop.close()
