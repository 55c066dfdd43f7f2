"""Routing a publish through a vhost's exchanges (a mixin of ``Definitions``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from broker.amqp.errors import AMQPChannelError
from broker.definitions.entities import ACCESS_REFUSED, NOT_FOUND, Exchange, VHost
from broker.definitions.validation import _rs

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


class RoutingMixin:
    """Lookups for publishes; expects ``self.vhosts`` and ``self.exchange`` (``Definitions``)."""

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
