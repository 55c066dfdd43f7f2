"""Definitions: vhosts, users, permissions, exchanges, queues, bindings.

The node is the single writer. It validates a request with a ``plan_*``
method, which raises ``AMQPChannelError``/``AMQPConnectionError`` with
RabbitMQ's reply codes and texts, or returns the *ops* that carry it out.
The node applies the ops, persists them (``broker.defstore``) and broadcasts
them; every frontend and shard applies the same ops, in the same order, to its
own copy and routes with it (``route``). ``plan_*`` never changes state.

Ops are plain lists (msgpack/JSON-safe), applied with ``apply(op)``; each
applied op bumps ``version`` by one, so every copy that starts from the same
snapshot and applies the same ops ends at the same version. ``apply`` is safe
to replay: declaring something that exists overwrites its attributes, deleting
or unbinding something missing is a no-op, binding to a missing end is
ignored (that is how bindings of transient entities drop out on boot replay).

==========================================================  ====================================
op                                                          effect
==========================================================  ====================================
``["vhost.put", name]``                                     create a vhost with the predeclared
                                                            exchanges
``["vhost.delete", name]``                                  drop the vhost, its entities and the
                                                            permissions on it
``["user.put", name, {"password_hash", "tags"}]``           create or replace a user
``["user.delete", name]``                                   drop a user and its permissions
``["permission.put", user, vhost, {"configure", "write",    set a user's permissions on a vhost
"read"}]``
``["permission.delete", user, vhost]``                      drop them
``["exchange.declare", vhost, name, {"type", "durable",     create or replace an exchange (its
"auto_delete", "internal", "arguments"}]``                  bindings are kept)
``["exchange.delete", vhost, name]``                        drop it with bindings from and to it
``["queue.declare", vhost, name, {"durable",                create or replace a queue;
"exclusive_owner", "auto_delete", "arguments", "shard"}]``  exclusive_owner is None or
                                                            [frontend_index, conn_id]
``["queue.delete", vhost, name]``                           drop it with the bindings to it
``["queue.shard", vhost, name, shard]``                     move a queue to another shard
``["bind", vhost, source, dest_kind, dest, routing_key,     add a binding; dest_kind is "queue"
arguments]``                                                or "exchange"
``["unbind", vhost, source, dest_kind, dest, routing_key,   remove it
arguments]``
==========================================================  ====================================

Cascades that RabbitMQ performs implicitly (auto-delete exchanges losing their
last binding as source) are emitted by the planner as explicit
``exchange.delete`` ops, so ``apply`` stays simple and every copy agrees.
"""

from __future__ import annotations

import secrets
import zlib
from collections.abc import Iterable, Sequence
from datetime import datetime
from decimal import Decimal
from typing import Any

from broker.amqp.errors import AMQPChannelError, AMQPConnectionError
from broker.dedup import DEDUP_ARGS, dedup_args_error, dedup_settings
from broker.policies import (
    POLICY_OPS,
    Policy,
    best_match,
    effective_exchange_arguments,
    effective_queue_arguments,
    max_age_seconds,
    merge_operator,
    policy_attrs,
)
from broker.routing import (
    DELAYED_TYPE,
    EXCHANGE_TYPES,
    _norm,
    amqp_type_name,
    consistent_hash_weight,
    delayed_type_error,
    new_table,
    routing_type,
    x_match_error,
)

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

# Queue arguments RabbitMQ compares on redeclare (rabbit_amqqueue:declare_args/0);
# any other argument may differ between declarations.
QUEUE_EQUIVALENCE_ARGS = (
    "x-expires",
    "x-message-ttl",
    "x-dead-letter-exchange",
    "x-dead-letter-routing-key",
    "x-max-length",
    "x-max-length-bytes",
    "x-max-in-memory-length",
    "x-max-in-memory-bytes",
    "x-max-priority",
    "x-overflow",
    "x-queue-mode",
    "x-single-active-consumer",
    "x-queue-type",
    "x-quorum-initial-group-size",
    "x-max-age",
    "x-max-segment-size",
    "x-initial-cluster-size",
    "x-queue-leader-locator",
    "x-delivery-limit",
    "x-stream-max-segment-size-bytes",
    *DEDUP_ARGS,  # LavinMQ compares all arguments; a live cache cannot change its settings silently
)
EXCHANGE_EQUIVALENCE_ARGS = ("alternate-exchange", *DEDUP_ARGS)

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
    __slots__ = ("name", "exchanges", "queues", "bindings", "by_dest", "policies", "operator_policies", "limits")

    def __init__(self, name: str) -> None:
        self.name = name
        self.policies: dict[str, Policy] = {}
        self.operator_policies: dict[str, Policy] = {}
        self.limits: dict[str, int] = {}  # "max-connections", "max-queues"
        self.exchanges: dict[str, Exchange] = {}
        self.queues: dict[str, Queue] = {}
        self.bindings: dict[BindingKey, dict] = {}  # key -> arguments as given
        self.by_dest: dict[tuple[str, str], set[BindingKey]] = {}
        for xname, xtype in PREDECLARED:
            self.exchanges[xname] = Exchange(xname, xtype, True, False, False, {})


def binding_key(source: str, dest_kind: str, dest: str, routing_key: str, arguments: dict | None) -> BindingKey:
    return (source, dest_kind, dest, routing_key, _norm(arguments or {}))


def queue_shard(vhost: str, name: str, shard_count: int) -> int:
    """Stable placement of a queue: the same on every boot and every process."""
    return zlib.crc32(f"{vhost}\0{name}".encode()) % max(1, shard_count)


def plain(value: Any) -> Any:
    """Field-table values as msgpack/JSON-friendly plain types (text stays text)."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return raw
    if isinstance(value, Decimal):
        return float(value)
    if isinstance(value, datetime):
        return int(value.timestamp())
    return value


def _rs(kind: str, name: str, vhost: str) -> str:
    return f"{kind} '{name}' in vhost '{vhost}'"


def _val(value: Any) -> str:
    """Erlang-style rendering of a field value in 'inequivalent arg' texts."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def _arg_val(value: Any, present: bool) -> str:
    if not present:
        return "none"
    return f"the value '{_val(value)}' of type '{amqp_type_name(value)}'"


def _same_arg(a: Any, b: Any) -> bool:
    return _norm(a) == _norm(b)


def _channel(code: int, text: str, method: tuple[int, int]) -> AMQPChannelError:
    return AMQPChannelError(code, text, method[0], method[1])


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_queue_args(name: str, vhost: str, args: dict, durable: bool = True, exclusive: bool = False,
                      auto_delete: bool = False) -> None:
    """A subset of rabbit_amqqueue:check_declare_arguments/2 (406 on bad values)."""

    def fail(key: str, err: str) -> None:
        raise _channel(PRECONDITION_FAILED, f"invalid arg '{key}' for {_rs('queue', name, vhost)}: {err}",
                       QUEUE_DECLARE)

    for key in ("x-max-length", "x-max-length-bytes", "x-max-priority", "x-message-ttl", "x-expires",
                "x-delivery-limit", "x-consumer-timeout"):
        if key in args:
            v = args[key]
            if not _is_int(v):
                fail(key, '{unacceptable_type,"expected integer"}')
            if v < 0:
                fail(key, f"{{value_negative,{v}}}")
            if key == "x-expires" and v == 0:
                fail(key, f"{{value_zero,{v}}}")
            if key == "x-max-priority" and v > 255:
                fail(key, f"{{max_value_exceeded,{v}}}")
    for key in ("x-dead-letter-exchange", "x-dead-letter-routing-key"):
        if key in args and not isinstance(args[key], str):
            raise _channel(PRECONDITION_FAILED,
                           f"invalid type '{amqp_type_name(args[key])}' for arg '{key}' in "
                           f"{_rs('queue', name, vhost)}", QUEUE_DECLARE)
    if "x-dead-letter-routing-key" in args and "x-dead-letter-exchange" not in args:
        fail("x-dead-letter-routing-key", "routing_key_but_no_dlx_defined")
    if "x-overflow" in args and args["x-overflow"] not in ("drop-head", "reject-publish", "reject-publish-dlx"):
        fail("x-overflow", "invalid_overflow")
    if "x-single-active-consumer" in args and not isinstance(args["x-single-active-consumer"], bool):
        fail("x-single-active-consumer", f"{{unacceptable_type,{amqp_type_name(args['x-single-active-consumer'])}}}")
    dedup_err = dedup_args_error(args)
    if dedup_err is not None:
        fail(*dedup_err)
    qtype = args.get("x-queue-type", "classic")
    if qtype not in ("classic", "quorum", "stream"):
        fail("x-queue-type", f"unsupported queue type '{_val(qtype)}'")
    if qtype == "stream":
        _check_stream_args(name, vhost, args, fail)
    if qtype in ("quorum", "stream"):
        # A quorum queue here is a durable classic queue with delivery counting (shard/feature_queue.py);
        # the properties RabbitMQ refuses for quorum and stream queues are refused the same way.
        for prop, bad in (("exclusive-owner", exclusive), ("auto-delete", auto_delete), ("non-durable", not durable)):
            if bad:
                raise _channel(PRECONDITION_FAILED, f"invalid property '{prop}' for {_rs('queue', name, vhost)}",
                               QUEUE_DECLARE)


# Arguments RabbitMQ refuses on a stream ("invalid arg ... of queue type rabbit_stream_queue").
_NOT_FOR_STREAMS = ("x-message-ttl", "x-expires", "x-dead-letter-exchange", "x-dead-letter-routing-key",
                    "x-max-priority", "x-overflow", "x-delivery-limit", "x-single-active-consumer",
                    "x-consumer-timeout")


def _check_stream_args(name: str, vhost: str, args: dict, fail: Any) -> None:
    for key in _NOT_FOR_STREAMS:
        if key in args:
            raise _channel(PRECONDITION_FAILED, f"invalid arg '{key}' for {_rs('queue', name, vhost)} of queue "
                           "type rabbit_stream_queue", QUEUE_DECLARE)
    if "x-max-age" in args:
        try:
            max_age_seconds(args["x-max-age"])
        except ValueError:
            fail("x-max-age", f"{{invalid_max_age,{_val(args['x-max-age'])}}}")
    key = "x-stream-max-segment-size-bytes"
    if key in args:
        v = args[key]
        if not _is_int(v):
            fail(key, '{unacceptable_type,"expected integer"}')
        if v <= 0:
            fail(key, f"{{value_not_positive,{v}}}")


_decode_headers = None


def _headers_of(props_raw: bytes) -> dict | None:
    global _decode_headers
    if _decode_headers is None:
        from broker.amqp.properties import decode_headers

        _decode_headers = decode_headers
    try:
        return _decode_headers(props_raw)
    except ValueError:
        return None  # a malformed header table matches like an absent one


class Definitions:
    """The definitions state of one process, plus the node's validation."""

    def __init__(self) -> None:
        self.version = 0
        self.vhosts: dict[str, VHost] = {DEFAULT_VHOST: VHost(DEFAULT_VHOST)}
        self.users: dict[str, User] = {}
        self.permissions: dict[str, dict[str, dict]] = {}  # user -> vhost -> {configure, write, read}
        self.loopback_users: tuple[str, ...] = ("guest",)

    # ------------------------------------------------------------------ lookups
    def exchange(self, vhost: str, name: str) -> Exchange | None:
        v = self.vhosts.get(vhost)
        return v.exchanges.get(name) if v is not None else None

    def queue(self, vhost: str, name: str) -> Queue | None:
        v = self.vhosts.get(vhost)
        return v.queues.get(name) if v is not None else None

    def bindings(self, vhost: str) -> list[tuple[str, str, str, str, dict]]:
        v = self.vhosts.get(vhost)
        if v is None:
            return []
        return [(k[0], k[1], k[2], k[3], args) for k, args in v.bindings.items()]

    def exchange_for_publish(self, vhost: str, name: str) -> Exchange:
        """The exchange a basic.publish targets, or the channel error RabbitMQ raises."""
        x = self.exchange(vhost, name)
        if x is None:
            raise AMQPChannelError(NOT_FOUND, f"no {_rs('exchange', name, vhost)}", 60, 40)
        if x.internal:
            raise AMQPChannelError(ACCESS_REFUSED,
                                   f"cannot publish to internal {_rs('exchange', name, vhost)}", 60, 40)
        return x

    def route(self, vhost: str, exchange: str, routing_key: str, props_raw: bytes = b"") -> Sequence[str]:
        """Names of the queues a message reaches, deduplicated.

        Follows exchange-to-exchange bindings and alternate exchanges, each
        exchange visited once. The result may be a shared cached tuple: do not
        mutate it.
        """
        v = self.vhosts.get(vhost)
        if v is None:
            return ()
        if not exchange:
            q = v.queues.get(routing_key)
            return q.route if q is not None else ()
        x = v.exchanges.get(exchange)
        if x is None:
            return ()
        if x.needs_headers:
            entry = x.table.match(routing_key, _headers_of(props_raw))
        else:
            entry = x.table.match(routing_key)
        queues, exchanges = entry
        if not exchanges and (queues or x.alternate is None):
            return queues
        return self._route_walk(v, x, queues, exchanges, routing_key, props_raw)

    def _route_walk(self, v: VHost, x: Exchange, queues: tuple, exchanges: tuple, routing_key: str,
                    props_raw: bytes) -> list[str]:
        found = dict.fromkeys(queues)
        seen = {x.name}
        work = list(exchanges)
        if not queues and not exchanges and x.alternate is not None:
            work.append(x.alternate)
        headers: Any = seen  # sentinel: not decoded yet
        while work:
            name = work.pop()
            if name in seen:
                continue
            seen.add(name)
            x2 = v.exchanges.get(name)
            if x2 is None or not name:
                continue
            if x2.needs_headers:
                if headers is seen:
                    headers = _headers_of(props_raw)
                q2, e2 = x2.table.match(routing_key, headers)
            else:
                q2, e2 = x2.table.match(routing_key)
            for qn in q2:
                found[qn] = None
            work.extend(e2)
            if not q2 and not e2 and x2.alternate is not None:
                work.append(x2.alternate)
        return list(found)

    # ----------------------------------------------------------------- policies
    @staticmethod
    def _policy_of(v: VHost, kind: str, name: str) -> dict:
        """The merged policy definition applying to an entity (operator policies on top, queues only)."""
        p = best_match(v.policies.values(), kind, name)
        definition = p.definition if p is not None else {}
        if kind == "queue" and v.operator_policies:
            op = best_match(v.operator_policies.values(), kind, name)
            if op is not None:
                definition = merge_operator(definition, op.definition)
        return definition

    def effective_policy(self, vhost: str, kind: str, name: str) -> dict:
        """The merged policy definition (policy keys, no x- prefix) for a "queue" or "exchange"."""
        v = self.vhosts.get(vhost)
        return self._policy_of(v, kind, name) if v is not None else {}

    def effective_arguments(self, vhost: str, kind: str, name: str) -> dict:
        """Arguments of a queue or exchange with the applying policies combined in.

        Queues: the declared arguments plus the policy keys under their ``x-``
        names (``x-max-length``, ``x-message-ttl``, ``x-expires``,
        ``x-overflow``, ``x-dead-letter-exchange``, ``x-dead-letter-routing-key``,
        ``x-delivery-limit``, ``x-max-age``); numeric limits take the smaller
        value, other keys the queue's own argument. Exchanges: the arguments
        plus ``alternate-exchange``/``delayed-message`` from the policy when
        the argument is absent. {} when the entity does not exist.
        """
        v = self.vhosts.get(vhost)
        if v is None:
            return {}
        if kind == "queue":
            q = v.queues.get(name)
            if q is None:
                return {}
            return effective_queue_arguments(q.arguments, self._policy_of(v, "queue", name))
        x = v.exchanges.get(name)
        if x is None:
            return {}
        return effective_exchange_arguments(x.arguments, self._policy_of(v, "exchange", name))

    def policies(self, vhost: str, operator: bool = False) -> dict[str, dict]:
        v = self.vhosts.get(vhost)
        if v is None:
            return {}
        table = v.operator_policies if operator else v.policies
        return {n: p.attrs() for n, p in table.items()}

    def vhost_limits(self, vhost: str) -> dict[str, int]:
        v = self.vhosts.get(vhost)
        return dict(v.limits) if v is not None else {}

    def plan_policy_put(self, vhost: str, name: str, pattern: str, definition: dict, priority: int = 0,
                        apply_to: str = "all", operator: bool = False) -> list[list]:
        """Ops setting a (operator) policy; raises ValueError on an invalid one, KeyError on no vhost."""
        if vhost not in self.vhosts:
            raise KeyError(f"no vhost '{vhost}'")
        attrs = policy_attrs(pattern, plain(definition), priority, apply_to, operator)
        return [["operator_policy.put" if operator else "policy.put", vhost, name, attrs]]

    def plan_policy_delete(self, vhost: str, name: str, operator: bool = False) -> list[list]:
        v = self.vhosts.get(vhost)
        table = (v.operator_policies if operator else v.policies) if v is not None else {}
        if name not in table:
            return []
        return [["operator_policy.delete" if operator else "policy.delete", vhost, name]]

    def plan_vhost_limits(self, vhost: str, limits: dict) -> list[list]:
        """Ops setting a vhost's limits (max-connections, max-queues; a negative value removes one)."""
        if vhost not in self.vhosts:
            raise KeyError(f"no vhost '{vhost}'")
        clean = {}
        for key, value in limits.items():
            if key not in ("max-connections", "max-queues"):
                raise ValueError(f"unknown vhost limit '{key}'")
            if not _is_int(value):
                raise ValueError(f"vhost limit '{key}' must be an integer, got {value!r}")
            if value >= 0:
                clean[key] = value
        return [["vhost.limits", vhost, clean]]

    def _apply_policy(self, op: Sequence) -> None:
        v = self.vhosts.get(op[1])
        if v is None:
            return
        table = v.operator_policies if op[0].startswith("operator_") else v.policies
        if op[0].endswith(".put"):
            table[op[2]] = Policy.from_attrs(op[2], op[3])
        else:
            table.pop(op[2], None)
        for x in v.exchanges.values():
            x.set_policy(self._policy_of(v, "exchange", x.name))

    def _apply_vhost_limits(self, op: Sequence) -> None:
        v = self.vhosts.get(op[1])
        if v is not None:
            v.limits = {k: int(n) for k, n in (op[2] or {}).items()}

    # -------------------------------------------------------------------- apply
    def apply(self, op: Sequence) -> None:
        """Apply one op (see the module docstring). Safe to replay."""
        kind = op[0]
        handler = _APPLY.get(kind)
        if handler is None:
            raise ValueError(f"unknown definitions op {kind!r}")
        handler(self, op)
        self.version += 1

    def apply_all(self, ops: Iterable[Sequence]) -> None:
        for op in ops:
            self.apply(op)

    def _apply_vhost_put(self, op: Sequence) -> None:
        if op[1] not in self.vhosts:
            self.vhosts[op[1]] = VHost(op[1])

    def _apply_vhost_delete(self, op: Sequence) -> None:
        self.vhosts.pop(op[1], None)
        for perms in self.permissions.values():
            perms.pop(op[1], None)

    def _apply_user_put(self, op: Sequence) -> None:
        attrs = op[2]
        self.users[op[1]] = User(op[1], attrs["password_hash"], attrs.get("tags", ()))

    def _apply_user_delete(self, op: Sequence) -> None:
        self.users.pop(op[1], None)
        self.permissions.pop(op[1], None)

    def _apply_permission_put(self, op: Sequence) -> None:
        perm = op[3]
        self.permissions.setdefault(op[1], {})[op[2]] = {
            "configure": perm.get("configure", ".*"), "write": perm.get("write", ".*"),
            "read": perm.get("read", ".*")}

    def _apply_permission_delete(self, op: Sequence) -> None:
        perms = self.permissions.get(op[1])
        if perms is not None:
            perms.pop(op[2], None)

    def _apply_exchange_declare(self, op: Sequence) -> None:
        v = self.vhosts.get(op[1])
        if v is None:
            return
        name, a = op[2], op[3]
        old = v.exchanges.get(name)
        x = Exchange(name, a["type"], bool(a.get("durable")), bool(a.get("auto_delete")),
                     bool(a.get("internal")), dict(a.get("arguments") or {}))
        v.exchanges[name] = x
        x.set_policy(self._policy_of(v, "exchange", name))
        if old is not None:
            x.bindings = old.bindings
            for key in old.bindings:
                x.table.add((key[1], key[2]), key[3], v.bindings[key])

    def _apply_exchange_delete(self, op: Sequence) -> None:
        v = self.vhosts.get(op[1])
        name = op[2]
        if v is None or name not in v.exchanges or name in _PREDECLARED_NAMES:
            return
        x = v.exchanges[name]
        for key in list(x.bindings):
            self._remove_binding(v, key)
        for key in list(v.by_dest.get(("exchange", name), ())):
            self._remove_binding(v, key)
        del v.exchanges[name]

    def _apply_queue_declare(self, op: Sequence) -> None:
        v = self.vhosts.get(op[1])
        if v is None:
            return
        name, a = op[2], op[3]
        owner = a.get("exclusive_owner")
        q = Queue(name, bool(a.get("durable")), tuple(owner) if owner is not None else None,
                  bool(a.get("auto_delete")), dict(a.get("arguments") or {}), int(a.get("shard", 0)))
        old = v.queues.get(name)
        if old is not None:
            q.route = old.route
        v.queues[name] = q

    def _apply_queue_delete(self, op: Sequence) -> None:
        v = self.vhosts.get(op[1])
        if v is None or op[2] not in v.queues:
            return
        for key in list(v.by_dest.get(("queue", op[2]), ())):
            self._remove_binding(v, key)
        del v.queues[op[2]]

    def _apply_queue_shard(self, op: Sequence) -> None:
        q = self.queue(op[1], op[2])
        if q is not None:
            q.shard = int(op[3])

    def _apply_bind(self, op: Sequence) -> None:
        _, vhost, source, dest_kind, dest, routing_key, arguments = op
        v = self.vhosts.get(vhost)
        if v is None:
            return
        x = v.exchanges.get(source)
        ends = v.queues if dest_kind == "queue" else v.exchanges
        if x is None or not source or dest not in ends:
            return
        args = dict(arguments or {})
        key = binding_key(source, dest_kind, dest, routing_key, args)
        if key in v.bindings:
            return
        v.bindings[key] = args
        v.by_dest.setdefault((dest_kind, dest), set()).add(key)
        x.bindings.add(key)
        x.table.add((dest_kind, dest), routing_key, args)

    def _apply_unbind(self, op: Sequence) -> None:
        _, vhost, source, dest_kind, dest, routing_key, arguments = op
        v = self.vhosts.get(vhost)
        if v is not None:
            self._remove_binding(v, binding_key(source, dest_kind, dest, routing_key, arguments))

    @staticmethod
    def _remove_binding(v: VHost, key: BindingKey) -> None:
        args = v.bindings.pop(key, None)
        if args is None:
            return
        dest = (key[1], key[2])
        keys = v.by_dest.get(dest)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del v.by_dest[dest]
        x = v.exchanges.get(key[0])
        if x is not None:
            x.bindings.discard(key)
            x.table.remove(dest, key[3], args)

    # ------------------------------------------------------------ serialization
    def to_dict(self, durable_only: bool = False) -> dict:
        """Plain-typed snapshot. durable_only keeps what survives a restart."""
        vhosts = {}
        for vname, v in self.vhosts.items():
            exchanges = {
                n: x.attrs() for n, x in v.exchanges.items()
                if n not in _PREDECLARED_NAMES and (x.durable or not durable_only)
            }
            queues = {n: q.attrs() for n, q in v.queues.items() if q.durable or not durable_only}
            bindings = []
            for key, args in v.bindings.items():
                if durable_only:
                    src = v.exchanges[key[0]]
                    dst = (v.queues if key[1] == "queue" else v.exchanges)[key[2]]
                    if not (src.durable and dst.durable):
                        continue
                bindings.append([key[0], key[1], key[2], key[3], args])
            vhosts[vname] = {"exchanges": exchanges, "queues": queues, "bindings": bindings,
                             "policies": {n: p.attrs() for n, p in v.policies.items()},
                             "operator_policies": {n: p.attrs() for n, p in v.operator_policies.items()},
                             "limits": dict(v.limits)}
        return {
            "version": self.version,
            "vhosts": vhosts,
            "users": {n: {"password_hash": u.password_hash, "tags": list(u.tags)} for n, u in self.users.items()},
            "permissions": {u: {vh: dict(p) for vh, p in perms.items()} for u, perms in self.permissions.items()},
            "loopback_users": list(self.loopback_users),
        }

    @classmethod
    def from_dict(cls, d: dict) -> Definitions:
        defs = cls()
        defs.vhosts = {}
        for vname, vd in d.get("vhosts", {}).items():
            defs._apply_vhost_put(["vhost.put", vname])
            for pname, attrs in vd.get("policies", {}).items():
                defs._apply_policy(["policy.put", vname, pname, attrs])
            for pname, attrs in vd.get("operator_policies", {}).items():
                defs._apply_policy(["operator_policy.put", vname, pname, attrs])
            defs._apply_vhost_limits(["vhost.limits", vname, vd.get("limits", {})])
            for xname, attrs in vd.get("exchanges", {}).items():
                defs._apply_exchange_declare(["exchange.declare", vname, xname, attrs])
            for qname, attrs in vd.get("queues", {}).items():
                defs._apply_queue_declare(["queue.declare", vname, qname, attrs])
            for b in vd.get("bindings", []):
                defs._apply_bind(["bind", vname, *b])
        for uname, attrs in d.get("users", {}).items():
            defs._apply_user_put(["user.put", uname, attrs])
        for uname, perms in d.get("permissions", {}).items():
            for vname, perm in perms.items():
                defs._apply_permission_put(["permission.put", uname, vname, perm])
        defs.loopback_users = tuple(d.get("loopback_users", ("guest",)))
        defs.version = int(d.get("version", 0))
        return defs

    # ----------------------------------------------------------------- planning
    def _vhost(self, vhost: str) -> VHost:
        v = self.vhosts.get(vhost)
        if v is None:
            raise AMQPConnectionError(NOT_ALLOWED, f"vhost {vhost} not found")
        return v

    def plan_exchange_declare(self, vhost: str, name: str, type: str, passive: bool, durable: bool,
                              auto_delete: bool, internal: bool, arguments: dict | None) -> list[list]:
        v = self._vhost(vhost)
        method = EXCHANGE_DECLARE
        if passive:
            if not name:
                raise _channel(ACCESS_REFUSED, "operation not permitted on the default exchange", method)
            if name not in v.exchanges:
                raise _channel(NOT_FOUND, f"no {_rs('exchange', name, vhost)}", method)
            return []
        if type not in EXCHANGE_TYPES:
            raise AMQPConnectionError(COMMAND_INVALID, f"unknown exchange type '{type}'", *method)
        if not name:
            raise _channel(ACCESS_REFUSED, "operation not permitted on the default exchange", method)
        args = plain(arguments or {})
        x = v.exchanges.get(name)
        if x is not None:
            where = _rs("exchange", name, vhost)
            for field, have, want in (("type", x.type, type), ("durable", x.durable, bool(durable)),
                                      ("auto_delete", x.auto_delete, bool(auto_delete)),
                                      ("internal", x.internal, bool(internal))):
                if have != want:
                    raise _channel(PRECONDITION_FAILED, f"inequivalent arg '{field}' for {where}: "
                                   f"received '{_val(want)}' but current is '{_val(have)}'", method)
            self._check_args_equivalence(x.arguments, args, where, EXCHANGE_EQUIVALENCE_ARGS, method)
            return []
        if name.startswith("amq."):
            raise _channel(ACCESS_REFUSED, f"exchange name '{name}' contains reserved prefix 'amq.*'", method)
        if type == DELAYED_TYPE:
            err = delayed_type_error(args)
            if err is not None:
                raise _channel(PRECONDITION_FAILED, err, method)
        dedup_err = dedup_args_error(args)
        if dedup_err is not None:
            raise _channel(PRECONDITION_FAILED, f"invalid arg '{dedup_err[0]}' for "
                           f"{_rs('exchange', name, vhost)}: {dedup_err[1]}", method)
        ae = args.get("alternate-exchange")
        if ae is not None and not isinstance(ae, str):
            raise _channel(PRECONDITION_FAILED, f"invalid type '{amqp_type_name(ae)}' for arg "
                           f"'alternate-exchange' in {_rs('exchange', name, vhost)}", method)
        return [["exchange.declare", vhost, name, {"type": type, "durable": bool(durable),
                                                   "auto_delete": bool(auto_delete),
                                                   "internal": bool(internal), "arguments": args}]]

    @staticmethod
    def _check_args_equivalence(have: dict, want: dict, where: str, keys: Iterable[str],
                                method: tuple[int, int]) -> None:
        for key in keys:
            h_in, w_in = key in have, key in want
            if not h_in and not w_in:
                continue
            if h_in and w_in and _same_arg(have[key], want[key]):
                continue
            if key == "x-queue-type" and {have.get(key, "classic"), want.get(key, "classic")} == {"classic"}:
                continue  # a classic queue may or may not carry x-queue-type
            raise _channel(PRECONDITION_FAILED, f"inequivalent arg '{key}' for {where}: received "
                           f"{_arg_val(want.get(key), w_in)} but current is {_arg_val(have.get(key), h_in)}",
                           method)

    def plan_exchange_delete(self, vhost: str, name: str, if_unused: bool) -> list[list]:
        v = self._vhost(vhost)
        method = EXCHANGE_DELETE
        if not name:
            raise _channel(ACCESS_REFUSED, "operation not permitted on the default exchange", method)
        if name.startswith("amq."):
            raise _channel(ACCESS_REFUSED, f"deletion of system {_rs('exchange', name, vhost)} not allowed",
                           method)
        x = v.exchanges.get(name)
        if x is None:
            return []
        if if_unused and x.bindings:
            raise _channel(PRECONDITION_FAILED, f"{_rs('exchange', name, vhost)} in use", method)
        ops: list[list] = [["exchange.delete", vhost, name]]
        removed = set(x.bindings) | set(v.by_dest.get(("exchange", name), ()))
        self._auto_delete_cascade(v, removed, {name}, ops)
        return ops

    def _auto_delete_cascade(self, v: VHost, removed: set, deleted: set[str], ops: list[list]) -> None:
        """Emit deletes of auto-delete exchanges whose last source binding is in removed."""
        pending = [key[0] for key in removed]
        while pending:
            source = pending.pop()
            if source in deleted:
                continue
            x = v.exchanges.get(source)
            if x is None or not x.auto_delete or not x.bindings or not x.bindings <= removed:
                continue
            deleted.add(source)
            ops.append(["exchange.delete", v.name, source])
            for key in v.by_dest.get(("exchange", source), ()):
                if key not in removed:
                    removed.add(key)
                    pending.append(key[0])

    def plan_queue_declare(self, vhost: str, name: str, passive: bool, durable: bool, exclusive: bool,
                           auto_delete: bool, arguments: dict | None, owner: Sequence | None,
                           shard_count: int) -> tuple[list[list], str]:
        """Ops and the (possibly server-generated) queue name. owner = [frontend_index, conn_id]."""
        v = self._vhost(vhost)
        method = QUEUE_DECLARE
        owner_t = tuple(owner) if owner is not None else None
        if passive:
            q = v.queues.get(name)
            if q is None:
                raise _channel(NOT_FOUND, f"no {_rs('queue', name, vhost)}", method)
            self._check_exclusive(q, owner_t, vhost, method, strict=False)
            return [], name
        if not name:
            name = self._server_name(v)
        elif name.startswith("amq."):
            raise _channel(ACCESS_REFUSED, f"queue name '{name}' contains reserved prefix 'amq.*'", method)
        if exclusive and owner_t is None:
            raise ValueError("an exclusive queue needs an owner")
        want_owner = owner_t if exclusive else None
        eff_durable = bool(durable) and not exclusive
        args = plain(arguments or {})
        q = v.queues.get(name)
        if q is not None:
            self._check_exclusive(q, want_owner, vhost, method, strict=True)
            where = _rs("queue", name, vhost)
            for field, have, want in (("durable", q.durable, eff_durable),
                                      ("auto_delete", q.auto_delete, bool(auto_delete))):
                if have != want:
                    raise _channel(PRECONDITION_FAILED, f"inequivalent arg '{field}' for {where}: "
                                   f"received '{_val(want)}' but current is '{_val(have)}'", method)
            self._check_args_equivalence(q.arguments, args, where, QUEUE_EQUIVALENCE_ARGS, method)
            return [], name
        _check_queue_args(name, vhost, args, eff_durable, exclusive, bool(auto_delete))
        limit = v.limits.get("max-queues")
        if limit is not None and len(v.queues) >= limit:
            raise _channel(PRECONDITION_FAILED, f"cannot declare queue '{name}': queue limit in vhost "
                           f"'{vhost}' ({limit}) is reached", method)
        attrs = {"durable": eff_durable, "exclusive_owner": list(want_owner) if want_owner else None,
                 "auto_delete": bool(auto_delete), "arguments": args,
                 "shard": queue_shard(vhost, name, shard_count)}
        return [["queue.declare", vhost, name, attrs]], name

    @staticmethod
    def _server_name(v: VHost) -> str:
        while True:
            name = "amq.gen-" + secrets.token_urlsafe(16)
            if name not in v.queues:
                return name

    @staticmethod
    def _check_exclusive(q: Queue, owner: tuple | None, vhost: str, method: tuple[int, int],
                         strict: bool) -> None:
        """RabbitMQ's check_exclusive_access: strict on declare, lax elsewhere.

        owner None on a lax check means an administrative caller (the node, the
        management API), which may touch any queue.
        """
        if q.exclusive_owner == owner:
            return
        if not strict and (q.exclusive_owner is None or owner is None):
            return
        raise _channel(RESOURCE_LOCKED, f"cannot obtain exclusive access to locked {_rs('queue', q.name, vhost)}. "
                       "It could be originally declared on another connection or the exclusive property value "
                       "does not match that of the original declaration.", method)

    def plan_queue_delete(self, vhost: str, name: str, if_unused: bool, if_empty: bool, owner: Sequence | None,
                          consumers: int, messages: int) -> list[list]:
        """Ops deleting a queue; [] when it does not exist (reply delete-ok with 0).

        consumers/messages are the queue's current counts, asked of its shard.
        """
        v = self._vhost(vhost)
        method = QUEUE_DELETE
        q = v.queues.get(name)
        if q is None:
            return []
        self._check_exclusive(q, tuple(owner) if owner is not None else None, vhost, method, strict=False)
        if if_unused and consumers > 0:
            raise _channel(PRECONDITION_FAILED, f"{_rs('queue', name, vhost)} in use", method)
        if if_empty and messages > 0:
            raise _channel(PRECONDITION_FAILED, f"{_rs('queue', name, vhost)} not empty", method)
        return self._queue_delete_ops(v, name)

    def _queue_delete_ops(self, v: VHost, name: str) -> list[list]:
        ops: list[list] = [["queue.delete", v.name, name]]
        self._auto_delete_cascade(v, set(v.by_dest.get(("queue", name), ())), set(), ops)
        return ops

    def _check_binding_ends(self, v: VHost, source: str, dest_kind: str, dest: str, owner: tuple | None,
                            method: tuple[int, int]) -> None:
        if not source or (dest_kind == "exchange" and not dest):
            raise _channel(ACCESS_REFUSED, "operation not permitted on the default exchange", method)
        if source not in v.exchanges:
            raise _channel(NOT_FOUND, f"no {_rs('exchange', source, v.name)}", method)
        if dest_kind == "queue":
            q = v.queues.get(dest)
            if q is None:
                raise _channel(NOT_FOUND, f"no {_rs('queue', dest, v.name)}", method)
            self._check_exclusive(q, owner, v.name, method, strict=False)
        elif dest_kind == "exchange":
            if dest not in v.exchanges:
                raise _channel(NOT_FOUND, f"no {_rs('exchange', dest, v.name)}", method)
        else:
            raise ValueError(f"bad destination kind {dest_kind!r}")

    def plan_bind(self, vhost: str, source: str, dest_kind: str, dest: str, routing_key: str,
                  arguments: dict | None, owner: Sequence | None) -> list[list]:
        v = self._vhost(vhost)
        method = QUEUE_BIND if dest_kind == "queue" else EXCHANGE_BIND
        self._check_binding_ends(v, source, dest_kind, dest, tuple(owner) if owner is not None else None, method)
        args = plain(arguments or {})
        kind = routing_type(v.exchanges[source].type, v.exchanges[source].arguments)
        if kind == "headers":
            err = x_match_error(args)
            if err is not None:
                raise _channel(PRECONDITION_FAILED, err, method)
        elif kind == "x-consistent-hash" and consistent_hash_weight(routing_key) is None:
            raise _channel(PRECONDITION_FAILED, f"The binding key must be an integer: '{routing_key}'", method)
        if binding_key(source, dest_kind, dest, routing_key, args) in v.bindings:
            return []
        return [["bind", vhost, source, dest_kind, dest, routing_key, args]]

    def plan_unbind(self, vhost: str, source: str, dest_kind: str, dest: str, routing_key: str,
                    arguments: dict | None, owner: Sequence | None) -> list[list]:
        """Ops removing a binding; [] when it does not exist (RabbitMQ answers unbind-ok)."""
        v = self._vhost(vhost)
        method = QUEUE_UNBIND if dest_kind == "queue" else EXCHANGE_UNBIND
        self._check_binding_ends(v, source, dest_kind, dest, tuple(owner) if owner is not None else None, method)
        args = plain(arguments or {})
        key = binding_key(source, dest_kind, dest, routing_key, args)
        if key not in v.bindings:
            return []
        ops: list[list] = [["unbind", vhost, source, dest_kind, dest, routing_key, args]]
        self._auto_delete_cascade(v, {key}, set(), ops)
        return ops

    def ops_for_owner_gone(self, owner_prefix: Sequence) -> list[list]:
        """Ops deleting the exclusive queues of a connection [fe, conn] or a whole frontend [fe]."""
        prefix = tuple(owner_prefix)
        n = len(prefix)
        ops: list[list] = []
        for v in self.vhosts.values():
            gone = [q.name for q in v.queues.values()
                    if q.exclusive_owner is not None and q.exclusive_owner[:n] == prefix]
            if not gone:
                continue
            removed: set = set()
            for name in gone:
                ops.append(["queue.delete", v.name, name])
                removed |= v.by_dest.get(("queue", name), set())
            self._auto_delete_cascade(v, removed, set(), ops)
        return ops

    def rebalance(self, shard_count: int) -> list[list]:
        """Place every queue for shard_count shards; applies and returns the ops it applied."""
        ops = [["queue.shard", v.name, q.name, queue_shard(v.name, q.name, shard_count)]
               for v in self.vhosts.values() for q in v.queues.values()
               if q.shard != queue_shard(v.name, q.name, shard_count)]
        self.apply_all(ops)
        return ops

    # ------------------------------------------------ vhosts, users (management)
    def plan_vhost_put(self, name: str) -> list[list]:
        return [] if name in self.vhosts else [["vhost.put", name]]

    def plan_vhost_delete(self, name: str) -> list[list]:
        """Ops deleting a vhost; frontends should close its connections (CLOSE_CONNECTIONS)."""
        return [["vhost.delete", name]] if name in self.vhosts else []

    def plan_user_put(self, name: str, password: str | None = None, tags: Sequence[str] = (),
                      password_hash: str | None = None) -> list[list]:
        """Create or replace a user from a password (hashed here) or an existing hash."""
        if password_hash is None:
            if password is None:
                raise ValueError("a password or a password_hash is required")
            from broker.auth import hash_password

            password_hash = hash_password(password)
        return [["user.put", name, {"password_hash": password_hash, "tags": list(tags)}]]

    def plan_user_delete(self, name: str) -> list[list]:
        return [["user.delete", name]] if name in self.users else []

    def plan_permission_put(self, user: str, vhost: str, configure: str = ".*", write: str = ".*",
                            read: str = ".*") -> list[list]:
        if user not in self.users:
            raise KeyError(f"no user '{user}'")
        if vhost not in self.vhosts:
            raise KeyError(f"no vhost '{vhost}'")
        return [["permission.put", user, vhost, {"configure": configure, "write": write, "read": read}]]

    def plan_permission_delete(self, user: str, vhost: str) -> list[list]:
        return [["permission.delete", user, vhost]] if vhost in self.permissions.get(user, {}) else []

    def default_user_ops(self, user: str = "guest", password: str = "guest") -> list[list]:
        """Ops creating the default administrator with full permissions on '/'."""
        from broker.auth import hash_password

        return [
            ["user.put", user, {"password_hash": hash_password(password), "tags": ["administrator"]}],
            ["permission.put", user, DEFAULT_VHOST, {"configure": ".*", "write": ".*", "read": ".*"}],
        ]


_APPLY = {
    "vhost.put": Definitions._apply_vhost_put,
    "vhost.delete": Definitions._apply_vhost_delete,
    "user.put": Definitions._apply_user_put,
    "user.delete": Definitions._apply_user_delete,
    "permission.put": Definitions._apply_permission_put,
    "permission.delete": Definitions._apply_permission_delete,
    "exchange.declare": Definitions._apply_exchange_declare,
    "exchange.delete": Definitions._apply_exchange_delete,
    "queue.declare": Definitions._apply_queue_declare,
    "queue.delete": Definitions._apply_queue_delete,
    "queue.shard": Definitions._apply_queue_shard,
    "bind": Definitions._apply_bind,
    "unbind": Definitions._apply_unbind,
    "vhost.limits": Definitions._apply_vhost_limits,
    **{name: Definitions._apply_policy for name in POLICY_OPS},
}
