"""Policies, operator policies and vhost limits from a RabbitMQ-style definitions.json.

Understood parts of the file (everything else is ignored):

* ``"vhosts": [{"name": "/"}, ...]`` - created when missing;
* ``"policies": [{"vhost", "name", "pattern", "apply-to", "priority", "definition"}, ...]``;
* ``"operator_policies": [...]`` - same shape (RabbitMQ keeps them in
  ``"parameters"`` with component ``operator_policy``; both are read);
* ``"parameters": [{"vhost", "component": "vhost-limits", "value": {"max-connections": N,
  "max-queues": N}}, ...]``.

The file is the source of truth for policies and limits: on every load,
policies (and operator policies) the file does not have are deleted, and the
limits of every vhost are replaced by the file's (none when it has none).
"""

from __future__ import annotations

import json
from typing import Any

from broker.definitions import Definitions


def read_definitions_file(path: str) -> dict:
    with open(path, encoding="utf-8") as fh:
        data = json.load(fh)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _policy_rows(data: dict) -> tuple[list[dict], list[dict]]:
    policies = list(data.get("policies") or [])
    operator = list(data.get("operator_policies") or [])
    for p in data.get("parameters") or []:
        if p.get("component") == "operator_policy":
            operator.append({"vhost": p.get("vhost", "/"), "name": p.get("name"), **(p.get("value") or {})})
    return policies, operator


def plan_from_file(defs: Definitions, data: dict) -> list[list]:
    """Ops bringing defs in line with the file (raises ValueError on an invalid entry)."""
    ops: list[list] = []
    vhosts: set[str] = set()
    for v in data.get("vhosts") or []:
        name = v.get("name") if isinstance(v, dict) else v
        vhosts.add(name)
        if name not in defs.vhosts:
            ops += defs.plan_vhost_put(name)
    scratch = Definitions.from_dict(defs.to_dict())
    scratch.apply_all(ops)
    vhosts |= set(scratch.vhosts)
    policies, operator = _policy_rows(data)
    for rows, is_op in ((policies, False), (operator, True)):
        wanted: dict[str, set[str]] = {}
        for row in rows:
            vhost = row.get("vhost", "/")
            vhosts.add(vhost)
            wanted.setdefault(vhost, set()).add(row["name"])
            try:
                ops += scratch.plan_policy_put(vhost, row["name"], row["pattern"], row.get("definition") or {},
                                               int(row.get("priority", 0)), row.get("apply-to", "all"), is_op)
            except (KeyError, ValueError) as exc:
                raise ValueError(f"policy '{row.get('name')}' in vhost '{vhost}': {exc}") from None
        for vhost in vhosts:
            for name in scratch.policies(vhost, is_op):
                if name not in wanted.get(vhost, set()):
                    ops += scratch.plan_policy_delete(vhost, name, is_op)
    limits: dict[str, dict[str, Any]] = {}
    for p in data.get("parameters") or []:
        if p.get("component") == "vhost-limits":
            limits.setdefault(p.get("vhost", "/"), {}).update(p.get("value") or {})
    for vhost in vhosts | set(limits):
        new = limits.get(vhost, {})
        if new != scratch.vhost_limits(vhost):
            ops += scratch.plan_vhost_limits(vhost, new)
    return ops
