"""Management API: ``/api/definitions[/vhost]``, GET = export, POST = import (RabbitMQ's JSON format)."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from broker.definitions.rabbit_format import export, plan_import
from broker.http.auth import error
from broker.http.common import RABBITMQ_VERSION, caller, node_of


async def definitions_get(request: web.Request) -> web.Response:
    who = caller(request)
    who.require_admin()
    vhost = request.match_info.get("vhost")
    if vhost is not None and vhost not in who.defs.vhosts:
        raise error(404, f"vhost '{vhost}' does not exist")
    data = export(who.defs, vhost, RABBITMQ_VERSION)
    headers = {}
    if request.query.get("download"):
        headers["Content-Disposition"] = f'attachment; filename="{request.query["download"]}"'
    return web.json_response(data, headers=headers)


async def definitions_post(request: web.Request) -> web.Response:
    who = caller(request)
    who.require_admin()
    node = node_of(request)
    vhost = request.match_info.get("vhost")
    raw = await request.read()
    if request.content_type == "multipart/form-data":
        form = await request.post()
        field = form.get("file")
        raw = field.file.read() if hasattr(field, "file") else str(field or "").encode()
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise error(400, f"malformed JSON: {exc}") from None
    try:
        ops = plan_import(node.defs, data, node.settings.shards, vhost)
    except ValueError as exc:
        raise error(400, str(exc)) from None
    await node.commit(ops)
    return web.Response(status=204)


def register(app: web.Application, _node: Any) -> None:
    r = app.router
    r.add_get("/api/definitions", definitions_get)
    r.add_post("/api/definitions", definitions_post)
    r.add_get("/api/definitions/{vhost}", definitions_get)
    r.add_post("/api/definitions/{vhost}", definitions_post)
