"""Authorization: RabbitMQ's configure/write/read permissions and topic permissions.

A user's permissions on a vhost are three regular expressions matched (unanchored, as
Erlang's ``re:run``) against a resource name; an empty pattern matches nothing (RabbitMQ
reads it as ``^$``) and the default exchange is named ``amq.default``. Which operation needs
which permission (rabbit_channel):

===========================  ============================================================
configure                    declare (not passive) and delete of a queue or an exchange
write                        publish to an exchange; the destination of a binding; the
                             alternate exchange of an exchange and the dead-letter exchange
                             of a queue being declared
read                         consume, get and purge a queue; the source exchange of a
                             binding; the exchange of a declare with an alternate exchange,
                             the queue of a declare with a dead-letter exchange
===========================  ============================================================

Topic permissions (a write and a read pattern per user, vhost and exchange) apply to topic
exchanges only: the routing key of a publish must match ``write``, the binding key of a
binding from that exchange must match ``read``. A user without topic permissions for an
exchange is not restricted on it. ``{username}``, ``{vhost}`` and ``{client_id}`` in a
pattern are replaced by the connection's values first.

A refusal is ``403 ACCESS_REFUSED`` with RabbitMQ's text; it closes the channel.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

from broker.amqp.errors import AMQPChannelError

CONFIGURE = "configure"
WRITE = "write"
READ = "read"
ACCESS_REFUSED = 403

_CACHE_MAX = 4096  # per connection: names seen are cached, bounded so odd clients cannot grow it


@lru_cache(maxsize=1024)
def _regex(pattern: str) -> re.Pattern | None:
    try:
        return re.compile(pattern or "^$")
    except re.error:
        return None  # an invalid pattern grants nothing


def resource_name(name: str) -> str:
    return name or "amq.default"


def matches(pattern: str, name: str) -> bool:
    rx = _regex(pattern)
    return rx is not None and rx.search(name) is not None


def permitted(defs: Any, user: str, vhost: str, perm: str, name: str) -> bool:
    """Whether user may perm (configure/write/read) the resource name in vhost."""
    p = defs.permissions.get(user, {}).get(vhost)
    if p is None:
        return False
    return matches(p.get(perm, ""), resource_name(name))


def refusal(user: str, vhost: str, kind: str, name: str, class_id: int, method_id: int) -> AMQPChannelError:
    return AMQPChannelError(ACCESS_REFUSED, f"access to {kind} '{resource_name(name)}' in vhost '{vhost}' "
                            f"refused for user '{user}'", class_id, method_id)


def check(defs: Any, user: str | None, vhost: str, perm: str, kind: str, name: str, class_id: int,
          method_id: int) -> None:
    """Raise 403 unless user may perm the resource. user None = an internal caller (no check)."""
    if user is not None and not permitted(defs, user, vhost, perm, name):
        raise refusal(user, vhost, kind, name, class_id, method_id)


def _expand(pattern: str, variables: dict[str, str]) -> str:
    for key, value in variables.items():
        pattern = pattern.replace("{" + key + "}", re.escape(value))
    return pattern


def topic_permitted(defs: Any, user: str, vhost: str, perm: str, exchange: str, routing_key: str,
                    variables: dict[str, str] | None = None) -> bool:
    """Topic authorisation of a routing/binding key (callers check that the exchange is a topic one)."""
    tp = defs.topic_permissions.get(user, {}).get(vhost, {}).get(exchange)
    if tp is None:
        return True
    pattern = tp.get(perm, "")
    if variables:
        pattern = _expand(pattern, variables)
    return matches(pattern, routing_key)


def check_topic(defs: Any, user: str | None, vhost: str, perm: str, exchange: str, routing_key: str,
                class_id: int, method_id: int, variables: dict[str, str] | None = None) -> None:
    if user is None:
        return
    x = defs.exchange(vhost, exchange)
    if x is None or x.type != "topic":
        return
    if not topic_permitted(defs, user, vhost, perm, exchange, routing_key, variables):
        raise AMQPChannelError(ACCESS_REFUSED, f"{perm} access to topic '{routing_key}' in exchange "
                               f"'{resource_name(exchange)}' in vhost '{vhost}' refused for user '{user}'",
                               class_id, method_id)


class Access:
    """One connection's permission checks, cached per definitions version.

    The publish path asks ``writable`` (a set) first, so a permitted publish costs one
    version compare and one set lookup; a new definitions version (a permission change
    among others) drops the cache, so changes apply to open connections at once.
    """

    __slots__ = ("user", "vhost", "variables", "version", "writable", "_ok", "topics")

    def __init__(self, user: str, vhost: str, client_id: str = "") -> None:
        self.user = user
        self.vhost = vhost
        self.variables = {"username": user, "vhost": vhost, "client_id": client_id}
        self.version = -1
        self.writable: set[str] = set()  # exchanges this user may publish to (write permitted)
        self._ok: dict[tuple[str, str], bool] = {}
        self.topics: dict | None = None  # exchange -> topic permissions, None when the user has none here

    def refresh(self, defs: Any) -> None:
        if self.version != defs.version:
            self.version = defs.version
            self.writable = set()
            self._ok = {}
            self.topics = defs.topic_permissions.get(self.user, {}).get(self.vhost) or None

    def allowed(self, defs: Any, perm: str, name: str) -> bool:
        self.refresh(defs)
        key = (perm, name)
        ok = self._ok.get(key)
        if ok is None:
            ok = permitted(defs, self.user, self.vhost, perm, name)
            if len(self._ok) >= _CACHE_MAX:
                self._ok.clear()
                self.writable.clear()
            self._ok[key] = ok
            if ok and perm == WRITE:
                self.writable.add(name)
        return ok

    def check(self, defs: Any, perm: str, kind: str, name: str, class_id: int, method_id: int) -> None:
        if not self.allowed(defs, perm, name):
            raise refusal(self.user, self.vhost, kind, name, class_id, method_id)

    def check_publish(self, defs: Any, exchange: Any, name: str, routing_key: str) -> None:
        """Write on the exchange, then topic write on the routing key (basic.publish, 60/40)."""
        if name not in self.writable or self.version != defs.version:
            self.check(defs, WRITE, "exchange", name, 60, 40)
        if self.topics is not None and exchange.type == "topic" and name in self.topics:
            if not matches(_expand(self.topics[name].get(WRITE, ""), self.variables), routing_key):
                raise AMQPChannelError(
                    ACCESS_REFUSED, f"write access to topic '{routing_key}' in exchange '{resource_name(name)}' "
                    f"in vhost '{self.vhost}' refused for user '{self.user}'", 60, 40)
