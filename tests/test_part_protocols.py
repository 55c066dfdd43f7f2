"""The Protocols in which a part describes what it uses of its holder name only what the holder has.

They are annotations (no type checker runs in CI), so a renamed attribute of ShardWorker, FrontendWorker,
AMQPConnection, Channel or Queue would leave them stale without this check; the calls themselves are
covered by the behaviour tests. docs/architecture.md, "Import direction".
"""

from __future__ import annotations

import ast
import inspect
import textwrap

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


def instance_attributes(cls: type) -> set[str]:
    """Names a class's methods assign on ``self`` (``self.x = ...``, tuples too), and its slots, up its MRO.

    Read from the source, so no holder has to be built (a worker wants a running node around it).
    """
    names: set[str] = set()
    for klass in cls.__mro__[:-1]:
        names.update(getattr(klass, "__slots__", ()))
        for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(klass)))):
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
            for target in targets:
                for t in ast.walk(target):
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                        names.add(t.attr)
    return names


def missing(protocol: type, holder: type) -> set[str]:
    return {name for name in members(protocol) if not hasattr(holder, name)} - instance_attributes(holder)


class _Holder:
    __slots__ = ("slot",)

    def __init__(self) -> None:
        self.timers, self.other = None, None


def test_the_check_sees_attributes_methods_and_what_is_missing():
    assert members(stream_queue.StreamShard) == {"timers", "mark_dirty"}
    assert missing(stream_queue.StreamShard, _Holder) == {"mark_dirty"}
    assert instance_attributes(_Holder) == {"slot", "timers", "other"}
    assert missing(channel.ChannelConnection, AMQPConnection) == set()


SHARD_PROTOCOLS = (ack_timeouts.TimeoutsShard, admin.AdminShard, dead_letter_forwards.ForwardsShard,
                   dedup.DedupShard, delayed.DelayShard, feature_queue.FeatureShard, kvstore.KVShard,
                   stats.StatsShard, stream_queue.StreamShard)
FRONTEND_PROTOCOLS = (frontend_stats.StatsFrontend, ws.WSFrontend, ws_listener.ListenerFrontend,
                      channel.ChannelConnection, shard_loss.LosingConnection, dedup_publish.DedupConnection,
                      dedup_publish.DedupChannel)


def test_shard_parts_describe_shard_worker():
    for protocol in SHARD_PROTOCOLS:
        assert missing(protocol, ShardWorker) == set(), protocol.__name__
    for queue_class in (Queue, feature_queue.FeatureQueue):
        assert missing(consumer_order.OrderedQueue, queue_class) == set(), queue_class.__name__


def test_frontend_parts_describe_their_holders():
    for protocol in (frontend_stats.StatsFrontend, ws.WSFrontend, ws_listener.ListenerFrontend):
        assert missing(protocol, FrontendWorker) == set(), protocol.__name__
    for protocol in (channel.ChannelConnection, shard_loss.LosingConnection, dedup_publish.DedupConnection):
        assert missing(protocol, AMQPConnection) == set(), protocol.__name__
    assert missing(dedup_publish.DedupChannel, channel.Channel) == set()


def test_protocols_name_only_public_members():
    """A part uses its holder through what the holder offers: a Protocol naming a private member
    (``_publish``) would make the holder's internals a contract no rename can see."""
    for protocol in (*SHARD_PROTOCOLS, consumer_order.OrderedQueue, *FRONTEND_PROTOCOLS):
        assert {name for name in members(protocol) if name.startswith("_")} == set(), protocol.__name__
