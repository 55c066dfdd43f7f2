"""Planning: validate a request and return the ops that carry it out (a mixin of ``Definitions``).

``plan_*`` never changes state; the node applies the returned ops (``Definitions.apply``).
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Sequence

from broker.amqp.errors import AMQPConnectionError
from broker.dedup import dedup_args_error
from broker.definitions.entities import (
    ACCESS_REFUSED,
    COMMAND_INVALID,
    DEFAULT_VHOST,
    EXCHANGE_BIND,
    EXCHANGE_DECLARE,
    EXCHANGE_DELETE,
    EXCHANGE_UNBIND,
    NOT_ALLOWED,
    NOT_FOUND,
    PRECONDITION_FAILED,
    QUEUE_BIND,
    QUEUE_DECLARE,
    QUEUE_DELETE,
    QUEUE_UNBIND,
    RESOURCE_LOCKED,
    Queue,
    VHost,
    binding_key,
)
from broker.definitions.validation import (
    EXCHANGE_EQUIVALENCE_ARGS,
    QUEUE_EQUIVALENCE_ARGS,
    _arg_val,
    _channel,
    _check_queue_args,
    _rs,
    _same_arg,
    _val,
    plain,
)
from broker.passwords import hash_password
from broker.routing import (
    DELAYED_TYPE,
    EXCHANGE_TYPES,
    amqp_type_name,
    consistent_hash_weight,
    delayed_type_error,
    routing_type,
    x_match_error,
)


class PlanMixin:
    """The node's planners; expects ``self.vhosts``, ``self.users``, ``self.permissions`` (``Definitions``)."""

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
        default_type = v.metadata.get("default_queue_type")
        if "x-queue-type" not in args and default_type in ("quorum", "stream"):
            if q is not None:
                # The type a queue got from the vhost's default is not "inequivalent" to an omitted one.
                args["x-queue-type"] = q.arguments.get("x-queue-type", "classic")
            elif eff_durable and not exclusive and not auto_delete:
                # RabbitMQ 3.11+: a declare without x-queue-type gets the vhost's default_queue_type;
                # exclusive, auto-delete and non-durable queues stay classic (as RabbitMQ 4 does;
                # a quorum or stream queue cannot be any of them).
                args["x-queue-type"] = default_type
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
                 "shard": self.place_queue(vhost, name, shard_count)}
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
        """Ops removing a binding; [] when it, its source or its destination does not exist.

        RabbitMQ answers unbind-ok for all of these (unbind is idempotent: aio-pika's RPC
        pattern unbinds from an auto-delete exchange that may already be gone); only the
        default exchange (403) and another connection's exclusive queue (405) are refused.
        """
        v = self._vhost(vhost)
        method = QUEUE_UNBIND if dest_kind == "queue" else EXCHANGE_UNBIND
        dests = v.queues if dest_kind == "queue" else v.exchanges
        if source and (dest or dest_kind == "queue") and (source not in v.exchanges or dest not in dests):
            return []
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
        """Re-place the queues whose shard is gone (a restart with fewer shards); applies and returns the ops.

        Every other queue keeps the shard recorded in its definition, whatever the shard count: its
        data dir does not depend on it, and moving queues that are already placed would undo the
        balance they were declared with. Queues are re-placed one by one, each op applied before the
        next placement, so they spread like new declares.
        """
        ops = []
        for v in self.vhosts.values():
            for q in list(v.queues.values()):
                if not 0 <= q.shard < shard_count:
                    op = ["queue.shard", v.name, q.name, self.place_queue(v.name, q.name, shard_count)]
                    self.apply(op)
                    ops.append(op)
        return ops

    # ------------------------------------------------ vhosts, users (management)
    def plan_vhost_put(self, name: str, metadata: dict | None = None) -> list[list]:
        if metadata is not None:
            v = self.vhosts.get(name)
            return [] if v is not None and v.metadata == metadata else [["vhost.put", name, dict(metadata)]]
        return [] if name in self.vhosts else [["vhost.put", name]]

    def plan_vhost_delete(self, name: str) -> list[list]:
        """Ops deleting a vhost: its queues one by one first (so their shards delete their data),
        then the vhost; frontends should close its connections (CLOSE_CONNECTIONS)."""
        v = self.vhosts.get(name)
        if v is None:
            return []
        return [*(["queue.delete", name, q] for q in v.queues), ["vhost.delete", name]]

    def plan_user_put(self, name: str, password: str | None = None, tags: Sequence[str] = (),
                      password_hash: str | None = None) -> list[list]:
        """Create or replace a user from a password (hashed here) or an existing hash."""
        if password_hash is None:
            if password is None:
                raise ValueError("a password or a password_hash is required")

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

    def plan_topic_permission_put(self, user: str, vhost: str, exchange: str, write: str = "",
                                  read: str = "") -> list[list]:
        if user not in self.users:
            raise KeyError(f"no user '{user}'")
        if vhost not in self.vhosts:
            raise KeyError(f"no vhost '{vhost}'")
        return [["topic_permission.put", user, vhost, exchange, {"write": write, "read": read}]]

    def plan_topic_permission_delete(self, user: str, vhost: str, exchange: str | None = None) -> list[list]:
        have = self.topic_permissions.get(user, {}).get(vhost, {})
        if not have or (exchange is not None and exchange not in have):
            return []
        return [["topic_permission.delete", user, vhost, exchange]]

    def default_user_ops(self, user: str = "guest", password: str = "guest") -> list[list]:
        """Ops creating the default administrator with full permissions on '/'."""

        return [
            ["user.put", user, {"password_hash": hash_password(password), "tags": ["administrator"]}],
            ["permission.put", user, DEFAULT_VHOST, {"configure": ".*", "write": ".*", "read": ".*"}],
        ]
