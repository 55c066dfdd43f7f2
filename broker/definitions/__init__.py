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
``["vhost.put", name(, metadata)]``                         create a vhost with the predeclared
                                                            exchanges (or set its metadata)
``["vhost.delete", name]``                                  drop the vhost, its entities and the
                                                            permissions on it
``["user.put", name, {"password_hash", "tags"}]``           create or replace a user
``["user.delete", name]``                                   drop a user and its permissions
``["permission.put", user, vhost, {"configure", "write",    set a user's permissions on a vhost
"read"}]``
``["permission.delete", user, vhost]``                      drop them
``["topic_permission.put", user, vhost, exchange,           set a user's topic permissions
{"write", "read"}]``                                        (routing-key patterns) on an exchange
``["topic_permission.delete", user, vhost, exchange]``      drop them (exchange None: all of the
                                                            vhost's)
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

from collections.abc import Iterable, Sequence
from typing import Protocol

from broker.definitions.entities import (  # noqa: F401  (re-exported: the package's public names)
    _PREDECLARED_NAMES,
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
    PREDECLARED,
    QUEUE_BIND,
    QUEUE_DECLARE,
    QUEUE_DELETE,
    QUEUE_UNBIND,
    RESOURCE_LOCKED,
    BindingKey,
    Exchange,
    Queue,
    User,
    VHost,
    binding_key,
    place_queue,
    queue_shard,
)
from broker.definitions.plan import PlanMixin
from broker.definitions.policies import PolicyMixin
from broker.definitions.routing import RoutingMixin
from broker.definitions.validation import (  # noqa: F401  (re-exported)
    EXCHANGE_EQUIVALENCE_ARGS,
    QUEUE_EQUIVALENCE_ARGS,
    plain,
)
from broker.policies import POLICY_OPS


class DeletedQueues(Protocol):
    """What Definitions tells of deleted queues and asks at placement (broker/queue_leftovers.py)."""

    def deleted(self, vhost: str, name: str, shard: int, version: int) -> None: ...

    def shard_of(self, vhost: str, name: str) -> int | None: ...


class Definitions(RoutingMixin, PolicyMixin, PlanMixin):
    """The definitions state of one process, plus the node's validation.

    The state, its lookups, ``apply`` and the (de)serialization live here; routing
    (``routing.py``), policies (``policies.py``) and planning (``plan.py``) are mixins.
    """


    def __init__(self) -> None:
        self.version = 0
        self.vhosts: dict[str, VHost] = {DEFAULT_VHOST: VHost(DEFAULT_VHOST)}
        self.users: dict[str, User] = {}
        self.permissions: dict[str, dict[str, dict]] = {}  # user -> vhost -> {configure, write, read}
        # user -> vhost -> exchange -> {write, read}: routing-key patterns (RabbitMQ's topic permissions)
        self.topic_permissions: dict[str, dict[str, dict[str, dict]]] = {}
        self.loopback_users: tuple[str, ...] = ("guest",)
        # Where new queues go (config --queue-placement, set by the node): "balanced" or "hash".
        self.placement = "balanced"
        self.shard_queues: dict[int, int] = {}  # shard -> queues on it, all vhosts (placement)
        # The node's only (broker/queue_leftovers.py): where a deleted queue's directory may still be,
        # so that a queue of the same name declared meanwhile goes to that shard (place_queue).
        self.leftovers: DeletedQueues | None = None

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
        metadata = op[2] if len(op) > 2 else None
        v = self.vhosts.get(op[1])
        if v is None:
            self.vhosts[op[1]] = VHost(op[1], metadata)
        elif metadata is not None:
            v.metadata = dict(metadata)

    def _apply_vhost_delete(self, op: Sequence) -> None:
        v = self.vhosts.pop(op[1], None)
        if v is not None:
            if self.leftovers is not None:  # queues declared while its queues were deleted go with it
                for q in v.queues.values():
                    self.leftovers.deleted(v.name, q.name, q.shard, self.version + 1)
            for shard, n in v.shard_queues.items():
                self.shard_queues[shard] -= n
        for perms in self.permissions.values():
            perms.pop(op[1], None)
        for tperms in self.topic_permissions.values():
            tperms.pop(op[1], None)

    def _apply_user_put(self, op: Sequence) -> None:
        attrs = op[2]
        self.users[op[1]] = User(op[1], attrs["password_hash"], attrs.get("tags", ()))

    def _apply_user_delete(self, op: Sequence) -> None:
        self.users.pop(op[1], None)
        self.permissions.pop(op[1], None)
        self.topic_permissions.pop(op[1], None)

    def _apply_permission_put(self, op: Sequence) -> None:
        perm = op[3]
        self.permissions.setdefault(op[1], {})[op[2]] = {
            "configure": perm.get("configure", ".*"), "write": perm.get("write", ".*"),
            "read": perm.get("read", ".*")}

    def _apply_permission_delete(self, op: Sequence) -> None:
        perms = self.permissions.get(op[1])
        if perms is not None:
            perms.pop(op[2], None)

    def _apply_topic_permission_put(self, op: Sequence) -> None:
        perm = op[4]
        self.topic_permissions.setdefault(op[1], {}).setdefault(op[2], {})[op[3]] = {
            "write": perm.get("write", ""), "read": perm.get("read", "")}

    def _apply_topic_permission_delete(self, op: Sequence) -> None:
        by_vhost = self.topic_permissions.get(op[1], {})
        if op[3] is None:
            by_vhost.pop(op[2], None)
        elif op[2] in by_vhost:
            by_vhost[op[2]].pop(op[3], None)
            if not by_vhost[op[2]]:
                del by_vhost[op[2]]

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
            self._count_queue(v, old.shard, -1)
        v.queues[name] = q
        self._count_queue(v, q.shard, 1)

    def _apply_queue_delete(self, op: Sequence) -> None:
        v = self.vhosts.get(op[1])
        if v is None or op[2] not in v.queues:
            return
        for key in list(v.by_dest.get(("queue", op[2]), ())):
            self._remove_binding(v, key)
        q = v.queues.pop(op[2])
        self._count_queue(v, q.shard, -1)
        if self.leftovers is not None:
            self.leftovers.deleted(v.name, q.name, q.shard, self.version + 1)  # this op's version

    def _apply_queue_shard(self, op: Sequence) -> None:
        v = self.vhosts.get(op[1])
        q = v.queues.get(op[2]) if v is not None else None
        if q is not None:
            self._count_queue(v, q.shard, -1)
            q.shard = int(op[3])
            self._count_queue(v, q.shard, 1)

    def _count_queue(self, v: VHost, shard: int, n: int) -> None:
        v.shard_queues[shard] = v.shard_queues.get(shard, 0) + n
        self.shard_queues[shard] = self.shard_queues.get(shard, 0) + n

    def place_queue(self, vhost: str, name: str, shard_count: int) -> int:
        """The shard a queue declared now goes to (see --queue-placement); the shard of a deleted
        queue of that name whose directory may still be there, whatever the placement."""
        if self.leftovers is not None:
            shard = self.leftovers.shard_of(vhost, name)
            if shard is not None and 0 <= shard < shard_count:
                return shard
        home = queue_shard(vhost, name, shard_count)
        v = self.vhosts.get(vhost)
        if self.placement == "hash" or v is None:
            return home
        return place_queue(v.shard_queues, self.shard_queues, home, shard_count)

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
    def to_dict(self, durable_only: bool = False, queue_columns: bool = False) -> dict:
        """Plain-typed snapshot. durable_only keeps what survives a restart.

        queue_columns (the workers' SNAPSHOT, never a file): each vhost's queues as
        ``"queue_columns"``, six parallel lists (names, durable, exclusive_owner, auto_delete,
        arguments, shard) instead of ``"queues"``, a map of one attributes map per queue. Decoding
        100,000 of those maps made that many short-lived dicts among the long-lived queue objects,
        and the holes they left kept a worker 25 MB bigger after a boot than after declaring the
        same queues live (CPython returns a 1 MiB arena to the system only when all of it is free);
        from columns a worker allocates little besides what it keeps, and the names are list
        items, not map keys, which msgpack would intern (100,000 entries in the interned table).
        The lists share the queues' arguments maps: for packing, not for another copy in-process."""
        vhosts = {}
        for vname, v in self.vhosts.items():
            exchanges = {
                n: x.attrs() for n, x in v.exchanges.items()
                if n not in _PREDECLARED_NAMES and (x.durable or not durable_only)
            }
            if queue_columns:
                queues = None
                qs = [q for q in v.queues.values() if q.durable or not durable_only]
                columns = [[q.name for q in qs], [q.durable for q in qs],
                           [q.exclusive_owner for q in qs], [q.auto_delete for q in qs],
                           [q.arguments for q in qs], [q.shard for q in qs]]
            else:
                queues = {n: q.attrs() for n, q in v.queues.items() if q.durable or not durable_only}
            bindings = []
            for key, args in v.bindings.items():
                if durable_only:
                    src = v.exchanges[key[0]]
                    dst = (v.queues if key[1] == "queue" else v.exchanges)[key[2]]
                    if not (src.durable and dst.durable):
                        continue
                bindings.append([key[0], key[1], key[2], key[3], args])
            vd = {"exchanges": exchanges, "queues": queues, "bindings": bindings,
                  "policies": {n: p.attrs() for n, p in v.policies.items()},
                  "operator_policies": {n: p.attrs() for n, p in v.operator_policies.items()},
                  "limits": dict(v.limits), "metadata": dict(v.metadata)}
            if queues is None:
                del vd["queues"]
                vd["queue_columns"] = columns
            vhosts[vname] = vd
        return {
            "version": self.version,
            "vhosts": vhosts,
            "users": {n: {"password_hash": u.password_hash, "tags": list(u.tags)} for n, u in self.users.items()},
            "permissions": {u: {vh: dict(p) for vh, p in perms.items()} for u, perms in self.permissions.items()},
            "topic_permissions": {u: {vh: {x: dict(p) for x, p in xs.items()} for vh, xs in by_vhost.items()}
                                  for u, by_vhost in self.topic_permissions.items()},
            "loopback_users": list(self.loopback_users),
        }

    def _load_queue_columns(self, v: VHost, columns: list) -> None:
        """The queues of to_dict(queue_columns=True): as many queue.declare ops, without them."""
        counts: dict[int, int] = {}
        queues = v.queues
        for name, durable, owner, auto_delete, arguments, shard in zip(*columns, strict=True):
            # The decoded arguments map is the queue's own (a declare copies the op's).
            queues[name] = Queue(name, bool(durable), tuple(owner) if owner is not None else None,
                                 bool(auto_delete), arguments if arguments is not None else {}, int(shard))
            counts[shard] = counts.get(shard, 0) + 1
        for shard, n in counts.items():
            self._count_queue(v, shard, n)

    @classmethod
    def from_dict(cls, d: dict) -> Definitions:
        defs = cls()
        defs.vhosts = {}
        for vname, vd in d.get("vhosts", {}).items():
            defs._apply_vhost_put(["vhost.put", vname, vd.get("metadata") or {}])
            for pname, attrs in vd.get("policies", {}).items():
                defs._apply_policy(["policy.put", vname, pname, attrs])
            for pname, attrs in vd.get("operator_policies", {}).items():
                defs._apply_policy(["operator_policy.put", vname, pname, attrs])
            defs._apply_vhost_limits(["vhost.limits", vname, vd.get("limits", {})])
            for xname, attrs in vd.get("exchanges", {}).items():
                defs._apply_exchange_declare(["exchange.declare", vname, xname, attrs])
            for qname, attrs in vd.get("queues", {}).items():
                defs._apply_queue_declare(["queue.declare", vname, qname, attrs])
            if "queue_columns" in vd:
                defs._load_queue_columns(defs.vhosts[vname], vd["queue_columns"])
            for b in vd.get("bindings", []):
                defs._apply_bind(["bind", vname, *b])
        for uname, attrs in d.get("users", {}).items():
            defs._apply_user_put(["user.put", uname, attrs])
        for uname, perms in d.get("permissions", {}).items():
            for vname, perm in perms.items():
                defs._apply_permission_put(["permission.put", uname, vname, perm])
        for uname, by_vhost in d.get("topic_permissions", {}).items():
            for vname, xs in by_vhost.items():
                for xname, perm in xs.items():
                    defs._apply_topic_permission_put(["topic_permission.put", uname, vname, xname, perm])
        defs.loopback_users = tuple(d.get("loopback_users", ("guest",)))
        defs.version = int(d.get("version", 0))
        return defs


_APPLY = {
    "vhost.put": Definitions._apply_vhost_put,
    "vhost.delete": Definitions._apply_vhost_delete,
    "user.put": Definitions._apply_user_put,
    "user.delete": Definitions._apply_user_delete,
    "permission.put": Definitions._apply_permission_put,
    "permission.delete": Definitions._apply_permission_delete,
    "topic_permission.put": Definitions._apply_topic_permission_put,
    "topic_permission.delete": Definitions._apply_topic_permission_delete,
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
