"""Management API: policies, operator policies, vhost limits and parameters (RabbitMQ's paths)."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from broker.http.auth import Caller, error
from broker.http.common import body, caller, created, no_content, node_of
from broker.http.listing import respond


def _vhost(request: web.Request, who: Caller) -> str | None:
    vhost = request.match_info.get("vhost")
    if vhost is not None and (vhost not in who.defs.vhosts or not who.may_see(vhost)):
        raise error(404, f"vhost '{vhost}' does not exist")
    return vhost


def _policy_json(vhost: str, name: str, attrs: dict) -> dict:
    return {"vhost": vhost, "name": name, "pattern": attrs.get("pattern"), "apply-to": attrs.get("apply-to", "all"),
            "definition": attrs.get("definition", {}), "priority": attrs.get("priority", 0)}


def _lister(operator: bool):
    async def handler(request: web.Request) -> web.Response:
        who = caller(request)
        vhost = _vhost(request, who)
        names = [vhost] if vhost is not None else sorted(who.vhosts())
        rows = [_policy_json(vn, n, a) for vn in names for n, a in sorted(who.defs.policies(vn, operator).items())]
        return respond(request, rows, lambda r: r["name"], lambda r: r)
    return handler


def _getter(operator: bool):
    async def handler(request: web.Request) -> web.Response:
        who = caller(request)
        vhost = _vhost(request, who)
        name = request.match_info["name"]
        attrs = who.defs.policies(vhost, operator).get(name)
        if attrs is None:
            raise error(404, f"no policy '{name}' in vhost '{vhost}'")
        return web.json_response(_policy_json(vhost, name, attrs))
    return handler


def _putter(operator: bool):
    async def handler(request: web.Request) -> web.Response:
        who = caller(request)
        vhost = _vhost(request, who)
        if operator:
            who.require_admin()
        else:
            who.require_vhost(vhost, policymaker=True)
        node = node_of(request)
        name = request.match_info["name"]
        data = await body(request)
        if "pattern" not in data or "definition" not in data:
            raise error(400, "pattern and definition are required")
        existed = name in node.defs.policies(vhost, operator)
        try:
            priority = int(data.get("priority", 0))
            ops = node.defs.plan_policy_put(vhost, name, data["pattern"], data["definition"], priority,
                                            data.get("apply-to", "all"), operator)
        except (ValueError, KeyError, TypeError) as exc:
            raise error(400, str(exc)) from None
        await node.commit(ops)
        return no_content() if existed else created()
    return handler


def _deleter(operator: bool):
    async def handler(request: web.Request) -> web.Response:
        who = caller(request)
        vhost = _vhost(request, who)
        if operator:
            who.require_admin()
        else:
            who.require_vhost(vhost, policymaker=True)
        node = node_of(request)
        ops = node.defs.plan_policy_delete(vhost, request.match_info["name"], operator)
        if not ops:
            raise error(404, "no such policy")
        await node.commit(ops)
        return no_content()
    return handler


# ------------------------------------------------------------------- vhost limits
async def limits_list(request: web.Request) -> web.Response:
    who = caller(request)
    vhost = _vhost(request, who)
    names = [vhost] if vhost is not None else sorted(who.vhosts())
    return web.json_response([{"vhost": vn, "value": who.defs.vhost_limits(vn)} for vn in names
                              if who.defs.vhost_limits(vn)])


async def limit_put(request: web.Request) -> web.Response:
    who = caller(request)
    who.require_admin()
    vhost = _vhost(request, who)
    node = node_of(request)
    data = await body(request)
    name = request.match_info["name"]
    if "value" not in data:
        raise error(400, "value is required")
    limits = {**node.defs.vhost_limits(vhost), name: data["value"]}
    try:
        ops = node.defs.plan_vhost_limits(vhost, limits)
    except (ValueError, KeyError) as exc:
        raise error(400, str(exc)) from None
    await node.commit(ops)
    return no_content()


async def limit_delete(request: web.Request) -> web.Response:
    who = caller(request)
    who.require_admin()
    vhost = _vhost(request, who)
    node = node_of(request)
    limits = node.defs.vhost_limits(vhost)
    if request.match_info["name"] not in limits:
        raise error(404, "no such limit")
    limits.pop(request.match_info["name"])
    await node.commit(node.defs.plan_vhost_limits(vhost, limits))
    return no_content()


async def parameters_list(request: web.Request) -> web.Response:
    """Runtime parameters: ShardMQ keeps vhost limits and operator policies as their own objects, so
    this lists the vhost-limits ones (RabbitMQ's component "vhost-limits")."""
    who = caller(request)
    component = request.match_info.get("component")
    vhost = _vhost(request, who)
    if component not in (None, "vhost-limits"):
        return web.json_response([])
    names = [vhost] if vhost is not None else sorted(who.vhosts())
    return web.json_response([{"vhost": vn, "component": "vhost-limits", "name": "limits",
                               "value": who.defs.vhost_limits(vn)} for vn in names if who.defs.vhost_limits(vn)])


def register(app: web.Application, _node: Any) -> None:
    r = app.router
    for base, operator in (("/api/policies", False), ("/api/operator-policies", True)):
        r.add_get(base, _lister(operator))
        r.add_get(base + "/{vhost}", _lister(operator))
        r.add_get(base + "/{vhost}/{name}", _getter(operator))
        r.add_put(base + "/{vhost}/{name}", _putter(operator))
        r.add_delete(base + "/{vhost}/{name}", _deleter(operator))
    r.add_get("/api/vhost-limits", limits_list)
    r.add_get("/api/vhost-limits/{vhost}", limits_list)
    r.add_put("/api/vhost-limits/{vhost}/{name}", limit_put)
    r.add_delete("/api/vhost-limits/{vhost}/{name}", limit_delete)
    r.add_get("/api/parameters", parameters_list)
    r.add_get("/api/parameters/{component}", parameters_list)
    r.add_get("/api/parameters/{component}/{vhost}", parameters_list)
    r.add_get("/api/global-parameters", _empty)


async def _empty(request: web.Request) -> web.Response:
    caller(request)
    return web.json_response([])


