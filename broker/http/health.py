"""Health checks that load balancers and Kubernetes probe (RabbitMQ's paths).

- ``/api/health/checks/alarms``: 200 when no resource alarm is in effect, 503 with the alarms.
- ``/api/health/checks/ready``: 200 once this node serves clients or proxies them to the leader.
- ``/api/health/checks/leader``: 200 on the node that serves clients (the leader of a cluster, or a
  standalone node), 503 elsewhere: for a load balancer that should reach the leader directly.

The node answers these through three attributes, so the checks do not depend on how the node
decides them: ``node.ready`` (bool), ``node.is_leader`` (bool) and ``node.alarms`` (a list of
strings naming the alarms in effect).
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from broker.http.server import NODE_KEY


def _answer(ok: bool, reason: str) -> web.Response:
    if ok:
        return web.json_response({"status": "ok"})
    return web.json_response({"status": "failed", "reason": reason}, status=503)


async def alarms(request: web.Request) -> web.Response:
    active = list(getattr(request.app[NODE_KEY], "alarms", []) or [])
    return _answer(not active, "resource alarm(s) in effect: " + ", ".join(active))


async def ready(request: web.Request) -> web.Response:
    return _answer(bool(getattr(request.app[NODE_KEY], "ready", False)), "node is not ready")


async def leader(request: web.Request) -> web.Response:
    node = request.app[NODE_KEY]
    # A leader whose frontends do not listen yet (a promotion in progress) is no target yet.
    if getattr(node, "is_leader", False) and not getattr(node, "ready", False):
        return _answer(False, "node is the leader but not ready yet")
    return _answer(bool(getattr(node, "is_leader", False)), "node is not the leader")


def register(app: web.Application, _node: Any) -> None:
    app.router.add_get("/api/health/checks/alarms", alarms)
    app.router.add_get("/api/health/checks/ready", ready)
    app.router.add_get("/api/health/checks/leader", leader)
