"""The definitions entities: vhosts, users, exchanges, queues, bindings, and the fixed names."""

from __future__ import annotations

import zlib
from collections.abc import Sequence

from broker.dedup import dedup_settings
from broker.policies import Policy, effective_exchange_arguments
from broker.routing import DELAYED_TYPE, EMPTY_TABLE_KEY, _norm, new_table, routing_type

ACCESS_REFUSED = 403
NOT_FOUND = 404
RESOURCE_LOCKED = 405
PRECONDITION_FAILED = 406
COMMAND_INVALID = 503
NOT_ALLOWED = 530

# (class_id, method_id) of the methods whose failures the planner reports
EXCHANGE_DECLARE = (40, 10)
EXCHANGE_DELETE = (40, 20)
EXCHANGE_BIND = (40, 30)
EXCHANGE_UNBIND = (40, 40)
QUEUE_DECLARE = (50, 10)
QUEUE_BIND = (50, 20)
QUEUE_DELETE = (50, 40)
QUEUE_UNBIND = (50, 50)

DEFAULT_VHOST = "/"
PREDECLARED = (
    ("", "direct"),
    ("amq.direct", "direct"),
    ("amq.fanout", "fanout"),
    ("amq.topic", "topic"),
    ("amq.headers", "headers"),
    ("amq.match", "headers"),
)
_PREDECLARED_NAMES = frozenset(name for name, _ in PREDECLARED)

BindingKey = tuple  # (source, dest_kind, dest, routing_key, normalized arguments)


class Exchange:
    __slots__ = ("name", "type", "durable", "auto_delete", "internal", "arguments", "table", "alternate",
                 "bindings", "needs_headers", "delayed", "dedup", "extras")

    def __init__(self, name: str, type: str, durable: bool, auto_delete: bool, internal: bool,
                 arguments: dict) -> None:
        self.name = name
        self.type = type
        self.durable = durable
        self.auto_delete = auto_delete
        self.internal = internal
        self.arguments = arguments
        self.table = new_table(type, arguments)
        kind = routing_type(type, arguments)
        # Routing decodes the message headers only for tables that look at them.
        self.needs_headers = kind == "headers" or getattr(self.table, "header", None) is not None
        self.alternate: str | None = None
        self.delayed = False  # messages with an x-delay header wait in a shard first
        self.dedup = dedup_settings(arguments)  # x-message-deduplication: checked in one shard
        self.set_policy({})
        self.bindings: set[BindingKey] = set()  # bindings with this exchange as source

    def set_policy(self, policy: dict) -> None:
        """Recompute what a policy can change: the alternate exchange and delayed routing."""
        eff = effective_exchange_arguments(self.arguments, policy)
        alt = eff.get("alternate-exchange")
        self.alternate = alt if isinstance(alt, str) else None
        # LavinMQ's x-delayed-exchange argument makes any exchange type delayed, as the policy key does.
        self.delayed = (self.type == DELAYED_TYPE or eff.get("delayed-message") is True
                        or eff.get("x-delayed-exchange") is True)
        # One test on the plain publish path covers every exchange feature handled by the frontend.
        self.extras = self.delayed or self.dedup is not None

    def attrs(self) -> dict:
        return {"type": self.type, "durable": self.durable, "auto_delete": self.auto_delete,
                "internal": self.internal, "arguments": self.arguments}


class Queue:
    __slots__ = ("name", "durable", "exclusive_owner", "auto_delete", "arguments", "shard", "route")

    def __init__(self, name: str, durable: bool, exclusive_owner: tuple | None, auto_delete: bool,
                 arguments: dict, shard: int) -> None:
        self.name = name
        self.durable = durable
        self.exclusive_owner = exclusive_owner
        self.auto_delete = auto_delete
        self.arguments = arguments
        self.shard = shard
        self.route = (name,)  # what the default exchange routes to, built once

    @property
    def exclusive(self) -> bool:
        return self.exclusive_owner is not None

    def attrs(self) -> dict:
        owner = list(self.exclusive_owner) if self.exclusive_owner is not None else None
        return {"durable": self.durable, "exclusive_owner": owner, "auto_delete": self.auto_delete,
                "arguments": self.arguments, "shard": self.shard}


class User:
    __slots__ = ("name", "password_hash", "tags")

    def __init__(self, name: str, password_hash: str, tags: Sequence[str]) -> None:
        self.name = name
        self.password_hash = password_hash
        self.tags = list(tags)


class VHost:
    __slots__ = ("name", "exchanges", "queues", "bindings", "by_dest", "policies", "operator_policies", "limits",
                 "metadata", "shard_queues")

    def __init__(self, name: str, metadata: dict | None = None) -> None:
        self.name = name
        self.metadata: dict = dict(metadata or {})  # description, tags, default_queue_type (shown, stored)
        self.policies: dict[str, Policy] = {}
        self.operator_policies: dict[str, Policy] = {}
        self.limits: dict[str, int] = {}  # "max-connections", "max-queues"
        self.exchanges: dict[str, Exchange] = {}
        self.queues: dict[str, Queue] = {}
        self.bindings: dict[BindingKey, dict] = {}  # key -> arguments as given
        self.by_dest: dict[tuple[str, str], set[BindingKey]] = {}
        self.shard_queues: dict[int, int] = {}  # shard -> this vhost's queues on it (placement)
        for xname, xtype in PREDECLARED:
            self.exchanges[xname] = Exchange(xname, xtype, True, False, False, {})


def binding_key(source: str, dest_kind: str, dest: str, routing_key: str, arguments: dict | None) -> BindingKey:
    return (source, dest_kind, dest, routing_key, _norm(arguments) if arguments else EMPTY_TABLE_KEY)


def queue_shard(vhost: str, name: str, shard_count: int) -> int:
    """A queue's home shard by name: the placement of --queue-placement hash, and the tie-break of balanced."""
    return zlib.crc32(f"{vhost}\0{name}".encode()) % max(1, shard_count)


def place_queue(vhost_counts: dict[int, int], node_counts: dict[int, int], home: int, shard_count: int) -> int:
    """The shard a new queue goes to under balanced placement.

    The shard with the fewest queues of its vhost (4 queues on 2 shards: 2 and 2, where the name
    hash put 3 on one shard), then the fewest of the node, then its home shard by name (so the first
    queue of an empty node lands where the hash put it), then the lowest index. The choice is
    recorded in the queue's definition and never recomputed while the shard exists.
    """
    return min(range(max(1, shard_count)),
               key=lambda s: (vhost_counts.get(s, 0), node_counts.get(s, 0), s != home, s))

