"""Policies, operator policies and vhost limits (a mixin of ``Definitions``)."""

from __future__ import annotations

from collections.abc import Sequence

from broker.definitions.entities import VHost
from broker.definitions.validation import _is_int, plain
from broker.policies import (
    Policy,
    best_match,
    effective_exchange_arguments,
    effective_queue_arguments,
    merge_operator,
    policy_attrs,
)


class PolicyMixin:
    """Policy lookups, plans and applies; expects ``self.vhosts`` (``Definitions``)."""

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
