"""RabbitMQ's definitions JSON (``GET/POST /api/definitions``): export and import.

Export writes RabbitMQ 3.13's shape (users with ``rabbit_password_hashing_sha256`` hashes, vhosts,
permissions, topic_permissions, parameters with the vhost limits, policies, queues, exchanges,
bindings; durable objects only, predeclared exchanges left out), so a RabbitMQ node or ShardMQ
imports it as is. Import merges into what exists (RabbitMQ's behaviour: nothing is deleted);
each object is planned with the same validation as an AMQP declare, so a bad entry fails the
whole import with a message naming it, and nothing is applied.
"""

from __future__ import annotations

from typing import Any

from broker.amqp.errors import AMQPError
from broker.definitions import PREDECLARED, Definitions

HASHING = "rabbit_password_hashing_sha256"
_PREDECLARED_NAMES = frozenset(n for n, _ in PREDECLARED)


def export(defs: Definitions, vhost: str | None = None, version: str = "3.13.0") -> dict:
    """The definitions as RabbitMQ exports them (one vhost's objects only when vhost is given)."""
    vnames = [vhost] if vhost is not None else sorted(defs.vhosts)
    out: dict[str, Any] = {"rabbit_version": version, "rabbitmq_version": version, "product_name": "ShardMQ",
                           "product_version": version}
    if vhost is None:
        out["users"] = [{"name": u.name, "password_hash": u.password_hash, "hashing_algorithm": HASHING,
                         "tags": list(u.tags), "limits": {}} for u in sorted(defs.users.values(), key=lambda u: u.name)]
        out["vhosts"] = [{"name": vn, "description": defs.vhosts[vn].metadata.get("description", ""),
                          "tags": list(defs.vhosts[vn].metadata.get("tags", [])),
                          "metadata": {"description": defs.vhosts[vn].metadata.get("description", ""),
                                       "tags": list(defs.vhosts[vn].metadata.get("tags", []))}}
                         for vn in vnames]
        out["permissions"] = [{"user": u, "vhost": vn, **p} for u, by_vhost in sorted(defs.permissions.items())
                              for vn, p in sorted(by_vhost.items())]
        out["topic_permissions"] = [{"user": u, "vhost": vn, "exchange": x, **p}
                                    for u, by_vhost in sorted(defs.topic_permissions.items())
                                    for vn, xs in sorted(by_vhost.items()) for x, p in sorted(xs.items())]
        out["global_parameters"] = []
    out["parameters"] = [{"vhost": vn, "component": "vhost-limits", "name": "limits", "value": defs.vhost_limits(vn)}
                         for vn in vnames if defs.vhost_limits(vn)]
    out["parameters"] += [{"vhost": vn, "component": "operator_policy", "name": n, "value": a}
                          for vn in vnames for n, a in sorted(defs.policies(vn, operator=True).items())]
    out["policies"] = [{"vhost": vn, "name": n, "pattern": a["pattern"], "apply-to": a.get("apply-to", "all"),
                        "definition": a.get("definition", {}), "priority": a.get("priority", 0)}
                       for vn in vnames for n, a in sorted(defs.policies(vn).items())]
    queues, exchanges, bindings = [], [], []
    for vn in vnames:
        v = defs.vhosts[vn]
        queues += [{"name": q.name, "vhost": vn, "durable": True, "auto_delete": q.auto_delete,
                    "arguments": q.arguments} for q in v.queues.values() if q.durable and not q.exclusive]
        exchanges += [{"name": x.name, "vhost": vn, "type": x.type, "durable": True, "auto_delete": x.auto_delete,
                       "internal": x.internal, "arguments": x.arguments}
                      for x in v.exchanges.values() if x.durable and x.name not in _PREDECLARED_NAMES]
        for src, kind, dst, rk, args in defs.bindings(vn):
            ends = v.queues if kind == "queue" else v.exchanges
            if v.exchanges[src].durable and dst in ends and ends[dst].durable:
                bindings.append({"source": src, "vhost": vn, "destination": dst, "destination_type": kind,
                                 "routing_key": rk, "arguments": args})
    out.update(queues=queues, exchanges=exchanges, bindings=bindings)
    return out


def _tags(value: Any) -> list[str]:
    if isinstance(value, str):
        return [t.strip() for t in value.split(",") if t.strip()]
    return [str(t) for t in value or []]


def plan_import(defs: Definitions, data: dict, shard_count: int, vhost: str | None = None) -> list[list]:
    """Ops merging data into defs; ValueError naming the bad entry (then nothing must be applied)."""
    if not isinstance(data, dict):
        raise ValueError("definitions must be a JSON object")
    scratch = Definitions.from_dict(defs.to_dict())
    scratch.placement = defs.placement  # imported queues spread like declared ones
    # ... and follow a deleted queue's leftover directory as they do (read only: an import deletes nothing).
    scratch.leftovers = defs.leftovers
    ops: list[list] = []

    def add(new: list[list]) -> None:
        scratch.apply_all(new)
        ops.extend(new)

    def where(entry: dict, kind: str) -> str:
        return f"{kind} '{entry.get('name', entry.get('user', '?'))}' in vhost '{entry.get('vhost', vhost or '/')}'"

    try:
        if vhost is None:
            for v in data.get("vhosts") or []:
                meta = {k: v[k] for k in ("description", "default_queue_type") if k in v}
                if "tags" in v:
                    meta["tags"] = _tags(v["tags"])
                add(scratch.plan_vhost_put(v["name"], meta))
            for u in data.get("users") or []:
                algo = u.get("hashing_algorithm", HASHING)
                if algo != HASHING:
                    raise ValueError(f"user '{u.get('name')}': unsupported hashing_algorithm '{algo}'")
                add(scratch.plan_user_put(u["name"], tags=_tags(u.get("tags")),
                                          password_hash=u.get("password_hash") or ""))
            for p in data.get("permissions") or []:
                add(scratch.plan_permission_put(p["user"], p["vhost"], p.get("configure", ""), p.get("write", ""),
                                                p.get("read", "")))
            for p in data.get("topic_permissions") or []:
                add(scratch.plan_topic_permission_put(p["user"], p["vhost"], p["exchange"], p.get("write", ""),
                                                      p.get("read", "")))
        elif vhost not in scratch.vhosts:
            raise ValueError(f"vhost '{vhost}' does not exist")

        def vh(entry: dict) -> str:
            return vhost if vhost is not None else entry.get("vhost", "/")

        for p in data.get("parameters") or []:
            if p.get("component") == "vhost-limits":
                add(scratch.plan_vhost_limits(vh(p), {**scratch.vhost_limits(vh(p)), **(p.get("value") or {})}))
            elif p.get("component") == "operator_policy":
                val = p.get("value") or {}
                add(scratch.plan_policy_put(vh(p), p["name"], val["pattern"], val.get("definition") or {},
                                            int(val.get("priority", 0)), val.get("apply-to", "all"), True))
        for p in data.get("policies") or []:
            add(scratch.plan_policy_put(vh(p), p["name"], p["pattern"], p.get("definition") or {},
                                        int(p.get("priority", 0)), p.get("apply-to", "all")))
        for x in data.get("exchanges") or []:
            try:
                add(scratch.plan_exchange_declare(vh(x), x["name"], x.get("type", "direct"), False,
                                                  bool(x.get("durable", True)), bool(x.get("auto_delete", False)),
                                                  bool(x.get("internal", False)), x.get("arguments") or {}))
            except AMQPError as exc:
                raise ValueError(f"{where(x, 'exchange')}: {exc.text}") from None
        for q in data.get("queues") or []:
            try:
                new, _name = scratch.plan_queue_declare(vh(q), q["name"], False, bool(q.get("durable", True)), False,
                                                        bool(q.get("auto_delete", False)), q.get("arguments") or {},
                                                        None, shard_count)
            except AMQPError as exc:
                raise ValueError(f"{where(q, 'queue')}: {exc.text}") from None
            add(new)
        for b in data.get("bindings") or []:
            try:
                add(scratch.plan_bind(vh(b), b["source"], b.get("destination_type", "queue"), b["destination"],
                                      b.get("routing_key", ""), b.get("arguments") or {}, None))
            except AMQPError as exc:
                raise ValueError(f"binding from '{b.get('source')}' to '{b.get('destination')}': {exc.text}") from None
    except KeyError as exc:
        raise ValueError(f"missing or unknown {exc}") from None
    except (TypeError, AttributeError) as exc:
        raise ValueError(f"malformed entry: {exc}") from None
    return ops
