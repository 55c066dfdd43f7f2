"""One shared copy of equal read-only dicts (a client's connection properties).

10,000 connections from one client library send the same client-properties table: ~1 KB of
nested dicts and strings each, held per connection by the frontend and again by the node. Both keep
one copy per distinct table instead. The holders must treat the dict as read-only.
"""

from __future__ import annotations

_MAX = 4096  # distinct tables kept; past that the cache starts over (never unbounded)


class Interner:
    __slots__ = ("_seen",)

    def __init__(self) -> None:
        self._seen: dict[str, dict] = {}

    def __call__(self, value: dict) -> dict:
        if not value:
            return value
        key = repr(value)  # the same for equal tables from one library (insertion order included)
        held = self._seen.get(key)
        if held is not None:
            return held
        if len(self._seen) >= _MAX:
            self._seen.clear()
        self._seen[key] = value
        return value
