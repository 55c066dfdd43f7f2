"""Policies and operator policies: validation, matching, and how they combine with arguments.

A policy (RabbitMQ's model) has a name, a regex ``pattern`` matched against
queue/exchange names (``re.search``, like Erlang's ``re:run``), ``apply-to``
(``queues``, ``exchanges`` or ``all``), a ``priority`` and a ``definition``
of keys. Of the policies matching an entity, only the one with the highest
priority applies (ties: the first name in sort order, for determinism).
Operator policies (queues only) are matched the same way and merged on top of
the user policy key by key, the stricter value winning (``merge_operator``).

Queue arguments and the merged policy combine as ``rabbit_amqqueue_process``
does: for the numeric limits the smaller value wins, for everything else the
queue's own argument wins (``effective_queue_arguments``). For exchanges, an
``alternate-exchange`` argument wins over the policy's.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

APPLY_TO = ("queues", "exchanges", "all")

QUEUE_KEYS = ("max-length", "max-length-bytes", "message-ttl", "expires", "overflow", "dead-letter-exchange",
              "dead-letter-routing-key", "delivery-limit", "max-age", "consumer-timeout")
EXCHANGE_KEYS = ("alternate-exchange", "delayed-message")
POLICY_KEYS = QUEUE_KEYS + EXCHANGE_KEYS
OPERATOR_KEYS = ("max-length", "max-length-bytes", "message-ttl", "expires", "delivery-limit", "overflow",
                 "max-age")

# Keys where a queue argument and a policy combine by the smaller value (res_min in RabbitMQ);
# every other queue key takes the queue argument when both are set (res_arg).
MIN_KEYS = frozenset(("max-length", "max-length-bytes", "message-ttl", "expires", "delivery-limit", "max-age",
                      "consumer-timeout"))

_INT_KEYS = {"max-length": 0, "max-length-bytes": 0, "message-ttl": 0, "expires": 1, "delivery-limit": 0,
             "consumer-timeout": 1}
_OVERFLOW = ("drop-head", "reject-publish", "reject-publish-dlx")
_AGE = re.compile(r"^(\d+)([YMDhms])$")
_AGE_SECONDS = {"Y": 365 * 86400, "M": 30 * 86400, "D": 86400, "h": 3600, "m": 60, "s": 1}

POLICY_OPS = ("policy.put", "policy.delete", "operator_policy.put", "operator_policy.delete")


def max_age_seconds(value: str) -> int:
    """Seconds of a RabbitMQ max-age string such as ``7D`` or ``10s``."""
    m = _AGE.match(value) if isinstance(value, str) else None
    if m is None:
        raise ValueError(f"invalid max-age {value!r}: expected a number and one of Y M D h m s")
    return int(m.group(1)) * _AGE_SECONDS[m.group(2)]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def validate_definition(definition: dict, allowed: Iterable[str] = POLICY_KEYS) -> None:
    """Raise ValueError with a reason when a policy definition is not valid."""
    if not isinstance(definition, dict) or not definition:
        raise ValueError("a policy definition must be a non-empty object")
    allowed = tuple(allowed)
    for key, value in definition.items():
        if key not in allowed:
            raise ValueError(f"unrecognised policy key '{key}'")
        if key in _INT_KEYS:
            if not _is_int(value) or value < _INT_KEYS[key]:
                raise ValueError(f"'{key}' must be an integer >= {_INT_KEYS[key]}, got {value!r}")
        elif key == "overflow":
            if value not in _OVERFLOW:
                raise ValueError(f"'overflow' must be one of {', '.join(_OVERFLOW)}, got {value!r}")
        elif key == "max-age":
            max_age_seconds(value)
        elif key == "delayed-message":
            if not isinstance(value, bool):
                raise ValueError(f"'delayed-message' must be a boolean, got {value!r}")
        elif not isinstance(value, str):
            raise ValueError(f"'{key}' must be a string, got {value!r}")
    if "dead-letter-routing-key" in definition and "dead-letter-exchange" not in definition:
        pass  # allowed in a policy: the DLX may come from the queue's arguments


class Policy:
    __slots__ = ("name", "pattern", "apply_to", "priority", "definition", "regex")

    def __init__(self, name: str, pattern: str, apply_to: str, priority: int, definition: dict) -> None:
        self.name = name
        self.pattern = pattern
        self.apply_to = apply_to
        self.priority = priority
        self.definition = definition
        self.regex = re.compile(pattern)

    @classmethod
    def from_attrs(cls, name: str, attrs: dict) -> Policy:
        return cls(name, attrs["pattern"], attrs.get("apply-to", "all"), int(attrs.get("priority", 0)),
                   dict(attrs["definition"]))

    def attrs(self) -> dict:
        return {"pattern": self.pattern, "apply-to": self.apply_to, "priority": self.priority,
                "definition": dict(self.definition)}

    def applies(self, kind: str, name: str) -> bool:
        if self.apply_to != "all" and self.apply_to != kind + "s":
            return False
        return self.regex.search(name) is not None


def policy_attrs(pattern: str, definition: dict, priority: int = 0, apply_to: str = "all",
                 operator: bool = False) -> dict:
    """Validated attributes of a policy (raises ValueError)."""
    if apply_to not in APPLY_TO:
        raise ValueError(f"apply-to must be one of {', '.join(APPLY_TO)}, got {apply_to!r}")
    if operator and apply_to == "exchanges":
        raise ValueError("operator policies apply to queues only")
    try:
        re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"invalid pattern {pattern!r}: {exc}") from None
    if not _is_int(priority):
        raise ValueError(f"priority must be an integer, got {priority!r}")
    validate_definition(definition, OPERATOR_KEYS if operator else POLICY_KEYS)
    return {"pattern": pattern, "apply-to": apply_to, "priority": priority, "definition": dict(definition)}


def best_match(policies: Iterable[Policy], kind: str, name: str) -> Policy | None:
    """The highest-priority policy applying to (kind, name); kind is "queue" or "exchange"."""
    best: Policy | None = None
    for p in policies:
        if not p.applies(kind, name):
            continue
        if best is None or p.priority > best.priority or (p.priority == best.priority and p.name < best.name):
            best = p
    return best


def _stricter(key: str, a: Any, b: Any) -> Any:
    if key == "max-age":
        return a if max_age_seconds(a) <= max_age_seconds(b) else b
    return min(a, b)


def merge_operator(policy: dict, operator: dict) -> dict:
    """rabbit_policies:merge_policy_value: numeric limits take the minimum, overflow the operator's."""
    merged = dict(policy)
    for key, value in operator.items():
        if key in merged and key in MIN_KEYS:
            merged[key] = _stricter(key, merged[key], value)
        else:
            merged[key] = value
    return merged


def effective_queue_arguments(arguments: dict, policy: dict) -> dict:
    """A queue's arguments with the (merged) policy folded in under their ``x-`` names."""
    result = dict(arguments)
    for key, value in policy.items():
        if key not in QUEUE_KEYS:
            continue
        xkey = "x-" + key
        if xkey not in result:
            result[xkey] = value
        elif key in MIN_KEYS:
            try:
                result[xkey] = _stricter(key, result[xkey], value)
            except (TypeError, ValueError):
                pass  # a malformed argument stays as declared
    return result


def effective_exchange_arguments(arguments: dict, policy: dict) -> dict:
    """An exchange's arguments with the policy's keys added where the argument is absent."""
    result = dict(arguments)
    for key, value in policy.items():
        if key in EXCHANGE_KEYS and key not in result:
            result[key] = value
    return result
