"""``GET /api/cluster/status``: this node's view of the cluster (role, leader, ISR, follower lag).

``shardmq cluster status`` reads it from every node; a standalone node answers ``{"role":
"standalone"}``.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from broker.http.server import NODE_KEY


async def status(request: web.Request) -> web.Response:
    node = request.app[NODE_KEY]
    cluster = getattr(node, "cluster", None)
    if cluster is None:
        return web.json_response({"role": "standalone", "leader": None, "ready": bool(node.ready)})
    return web.json_response({**cluster.status(), "ready": bool(node.ready), "is_leader": bool(node.is_leader)})


def register(app: web.Application, _node: Any) -> None:
    app.router.add_get("/api/cluster/status", status)
