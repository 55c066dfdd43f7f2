"""Management API: overview, nodes, whoami, vhosts, users, permissions, connections, channels, consumers.

RabbitMQ's paths and JSON shapes (see docs/management.md for what differs). Objects and
counts of queues, exchanges and bindings are in ``resources.py``; policies and limits in
``policies_api.py``; definitions export/import in ``definitions_api.py``.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import time
from typing import Any

from aiohttp import web

from broker.cpus import available_cpus
from broker.http.auth import Caller, error
from broker.http.common import (
    PRODUCT,
    RABBITMQ_VERSION,
    body,
    caller,
    created,
    no_content,
    node_of,
)
from broker.http.listing import respond
from broker.node_stats import (
    C_AT,
    C_BLOCKED,
    C_CHANNELS,
    C_HOST,
    C_ID,
    C_PORT,
    C_PROPS,
    C_RECV,
    C_SEND,
    C_SEND_PEND,
    C_USER,
    C_VHOST,
    Q_CONSUMERS,
    Q_READY,
    Q_UNACKED,
)
from broker.passwords import hash_password

log = logging.getLogger("shardmq.http")

HASHING = "rabbit_password_hashing_sha256"
CONNECTION_FORCED = 320
_STARTED = time.time()


def node_name() -> str:
    return f"shardmq@{socket.gethostname()}"


def _tags_of(value: Any) -> list[str]:
    """Tags as RabbitMQ accepts them: a comma-separated string or a list."""
    if value is None:
        return []
    if isinstance(value, str):
        return [t.strip() for t in value.split(",") if t.strip()]
    if isinstance(value, list):
        return [str(t) for t in value if str(t)]
    raise error(400, "tags must be a string or a list")


# ---------------------------------------------------------------- overview, nodes
def _rss_bytes() -> int:
    try:
        with open(f"/proc/{os.getpid()}/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


async def overview(request: web.Request) -> web.Response:
    who = caller(request)
    node = node_of(request)
    visible = set(who.vhosts())
    defs = node.defs
    conns = [row for _fe, row in node.stats.connections() if row[C_VHOST] in visible
             and (who.sees_all or row[C_USER] == who.name)]
    queues = node.stats.queues()
    ready = unacked = consumers = 0
    nqueues = nexchanges = 0
    for vname in visible:
        v = defs.vhosts[vname]
        nqueues += len(v.queues)
        nexchanges += len(v.exchanges)
        for qname in v.queues:
            row = queues.get((vname, qname))
            if row is not None:
                ready += row[Q_READY]
                unacked += row[Q_UNACKED]
                consumers += row[Q_CONSUMERS]
    s = node.settings
    message_stats = node.stats.totals(None if who.sees_all else
                                      {(vn, qn) for vn in visible for qn in defs.vhosts[vn].queues})
    if who.sees_all:
        # As RabbitMQ's overview: publish/confirm/returns counted at the publishing channels (the
        # frontends), so a message routed to three queues is one publish here, not three.
        message_stats.update(node.stats.frontend_stats())
    return web.json_response({
        "management_version": RABBITMQ_VERSION, "rabbitmq_version": RABBITMQ_VERSION,
        "product_name": PRODUCT, "product_version": RABBITMQ_VERSION, "cluster_name": node_name(),
        "node": node_name(), "erlang_version": "n/a", "statistics_db_event_queue": 0,
        "message_stats": message_stats,
        "queue_totals": {"messages": ready + unacked, "messages_ready": ready,
                         "messages_unacknowledged": unacked},
        "object_totals": {"connections": len(conns), "channels": sum(len(r[C_CHANNELS]) for r in conns),
                          "exchanges": nexchanges, "queues": nqueues, "consumers": consumers},
        "listeners": [{"node": node_name(), "protocol": "amqp", "ip_address": s.bind, "port": s.port},
                      {"node": node_name(), "protocol": "http", "ip_address": s.http_bind, "port": s.http_port}],
        "contexts": [{"node": node_name(), "description": "ShardMQ Management", "path": "/",
                      "port": str(s.http_port)}],
        "alarms": list(node.alarms),
    })


async def nodes(request: web.Request) -> web.Response:
    caller(request)
    return web.json_response([_node_json(request)])


async def node_one(request: web.Request) -> web.Response:
    caller(request)
    if request.match_info["name"] != node_name():
        raise error(404, "no such node")
    return web.json_response(_node_json(request))


def _node_json(request: web.Request) -> dict:
    node = node_of(request)
    alarms = set(node.alarms)
    return {"name": node_name(), "type": "disc", "running": True, "uptime": int((time.time() - _STARTED) * 1000),
            "mem_used": _rss_bytes(), "mem_alarm": "memory" in alarms, "disk_free_alarm": "disk" in alarms,
            "partitions": [], "processors": available_cpus(),
            "frontends": node.settings.frontends, "shards": node.settings.shards,
            "being_drained": False}


async def whoami(request: web.Request) -> web.Response:
    who = caller(request)
    return web.json_response({"name": who.name, "tags": sorted(who.tags)})


async def aliveness(request: web.Request) -> web.Response:
    who = caller(request)
    vhost = request.match_info["vhost"]
    who.require_vhost(vhost)
    return web.json_response({"status": "ok"})


# ------------------------------------------------------------------------- vhosts
def _vhost_json(node: Any, name: str) -> dict:
    v = node.defs.vhosts[name]
    meta = v.metadata
    queues = node.stats.queues()
    ready = unacked = 0
    for qname in v.queues:
        row = queues.get((name, qname))
        if row is not None:
            ready += row[Q_READY]
            unacked += row[Q_UNACKED]
    message_stats = node.stats.totals({(name, qname) for qname in v.queues})
    return {"name": name, "description": meta.get("description", ""), "tags": list(meta.get("tags", [])),
            "default_queue_type": meta.get("default_queue_type", "classic"),
            "metadata": {"description": meta.get("description", ""), "tags": list(meta.get("tags", []))},
            "tracing": False, "cluster_state": {node_name(): "running"},
            "messages": ready + unacked, "messages_ready": ready, "messages_unacknowledged": unacked,
            "message_stats": message_stats}


async def vhosts_list(request: web.Request) -> web.Response:
    who = caller(request)
    node = node_of(request)
    return respond(request, sorted(who.vhosts()), lambda n: n, lambda n: _vhost_json(node, n))


async def vhost_get(request: web.Request) -> web.Response:
    who = caller(request)
    name = request.match_info["vhost"]
    if name not in who.defs.vhosts or not who.may_see(name):
        raise error(404, f"vhost '{name}' does not exist")
    return web.json_response(_vhost_json(node_of(request), name))


async def vhost_put(request: web.Request) -> web.Response:
    who = caller(request)
    who.require_admin()
    node = node_of(request)
    name = request.match_info["vhost"]
    data = await body(request)
    existed = name in node.defs.vhosts
    meta = dict(node.defs.vhosts[name].metadata) if existed else {}
    for key in ("description", "default_queue_type"):
        if key in data:
            meta[key] = str(data[key])
    if meta.get("default_queue_type", "classic") not in ("classic", "quorum", "stream"):
        raise error(400, f"default_queue_type '{meta['default_queue_type']}' is not one of classic, quorum, stream")
    if "tags" in data:
        meta["tags"] = _tags_of(data["tags"])
    await node.commit(node.defs.plan_vhost_put(name, meta))
    if not existed:
        # RabbitMQ grants the creating user full permissions on a new vhost.
        await node.commit(node.defs.plan_permission_put(who.name, name, ".*", ".*", ".*"))
    return no_content() if existed else created()


async def vhost_delete(request: web.Request) -> web.Response:
    who = caller(request)
    who.require_admin()
    node = node_of(request)
    name = request.match_info["vhost"]
    if name not in node.defs.vhosts:
        raise error(404, f"vhost '{name}' does not exist")
    node.close_connections(CONNECTION_FORCED, f"vhost '{name}' is deleted", vhost=name)
    await node.commit(node.defs.plan_vhost_delete(name))
    return no_content()


# -------------------------------------------------------------------------- users
def _user_json(u: Any) -> dict:
    return {"name": u.name, "password_hash": u.password_hash, "hashing_algorithm": HASHING,
            "tags": list(u.tags), "limits": {}}


async def users_list(request: web.Request) -> web.Response:
    who = caller(request)
    who.require_admin()
    users = who.defs.users
    return respond(request, sorted(users), lambda n: n, lambda n: _user_json(users[n]))


async def users_without_permissions(request: web.Request) -> web.Response:
    who = caller(request)
    who.require_admin()
    defs = who.defs
    return web.json_response([_user_json(u) for n, u in sorted(defs.users.items()) if not defs.permissions.get(n)])


async def user_get(request: web.Request) -> web.Response:
    who = caller(request)
    who.require_admin()
    u = who.defs.users.get(request.match_info["user"])
    if u is None:
        raise error(404, "user does not exist")
    return web.json_response(_user_json(u))


async def user_put(request: web.Request) -> web.Response:
    who = caller(request)
    who.require_admin()
    node = node_of(request)
    name = request.match_info["user"]
    data = await body(request)
    old = node.defs.users.get(name)
    tags = _tags_of(data["tags"]) if "tags" in data else (list(old.tags) if old else [])
    if "password" in data and data["password"] is not None:
        if not isinstance(data["password"], str):
            raise error(400, "password must be a string")
        password_hash = hash_password(data["password"])
    elif "password_hash" in data:
        algo = data.get("hashing_algorithm", HASHING)
        if algo != HASHING:
            raise error(400, f"unsupported hashing_algorithm '{algo}' (only {HASHING})")
        password_hash = str(data["password_hash"] or "")
    elif old is not None:
        password_hash = old.password_hash
    else:
        password_hash = ""  # a user without a password: cannot log in with PLAIN
    await node.commit(node.defs.plan_user_put(name, tags=tags, password_hash=password_hash))
    if old is not None and password_hash != old.password_hash:
        node.close_connections(CONNECTION_FORCED, f"password of user '{name}' changed", user=name)
    return no_content() if old is not None else created()


async def user_delete(request: web.Request) -> web.Response:
    who = caller(request)
    who.require_admin()
    node = node_of(request)
    name = request.match_info["user"]
    if name not in node.defs.users:
        raise error(404, "user does not exist")
    await node.commit(node.defs.plan_user_delete(name))
    node.close_connections(CONNECTION_FORCED, f"user '{name}' deleted", user=name)
    return no_content()


async def bulk_delete_users(request: web.Request) -> web.Response:
    who = caller(request)
    who.require_admin()
    node = node_of(request)
    data = await body(request)
    for name in data.get("users", []):
        if name in node.defs.users:
            await node.commit(node.defs.plan_user_delete(name))
            node.close_connections(CONNECTION_FORCED, f"user '{name}' deleted", user=name)
    return no_content()


# -------------------------------------------------------------------- permissions
def _perm_rows(defs: Any, user: str | None = None, vhost: str | None = None) -> list[dict]:
    rows = []
    for uname, by_vhost in sorted(defs.permissions.items()):
        if user is not None and uname != user:
            continue
        for vname, p in sorted(by_vhost.items()):
            if vhost is None or vname == vhost:
                rows.append({"user": uname, "vhost": vname, "configure": p["configure"], "write": p["write"],
                             "read": p["read"]})
    return rows


def _topic_rows(defs: Any, user: str | None = None, vhost: str | None = None) -> list[dict]:
    rows = []
    for uname, by_vhost in sorted(defs.topic_permissions.items()):
        if user is not None and uname != user:
            continue
        for vname, xs in sorted(by_vhost.items()):
            if vhost is not None and vname != vhost:
                continue
            for xname, p in sorted(xs.items()):
                rows.append({"user": uname, "vhost": vname, "exchange": xname, "write": p["write"],
                             "read": p["read"]})
    return rows


async def permissions_list(request: web.Request) -> web.Response:
    who = caller(request)
    who.require_admin()
    return web.json_response(_perm_rows(who.defs))


async def vhost_permissions(request: web.Request) -> web.Response:
    who = caller(request)
    who.require_admin()
    vhost = request.match_info["vhost"]
    if vhost not in who.defs.vhosts:
        raise error(404, f"vhost '{vhost}' does not exist")
    return web.json_response(_perm_rows(who.defs, vhost=vhost))


async def user_permissions(request: web.Request) -> web.Response:
    who = caller(request)
    who.require_admin()
    user = request.match_info["user"]
    if user not in who.defs.users:
        raise error(404, "user does not exist")
    return web.json_response(_perm_rows(who.defs, user=user))


async def permission_get(request: web.Request) -> web.Response:
    who = caller(request)
    who.require_admin()
    rows = _perm_rows(who.defs, request.match_info["user"], request.match_info["vhost"])
    if not rows:
        raise error(404, "no permissions")
    return web.json_response(rows[0])


def _check_pattern(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise error(400, f"{name} must be a string")
    try:
        re.compile(value)
    except re.error as exc:
        raise error(400, f"{name}: invalid regular expression {value!r}: {exc}") from None
    return value


async def permission_put(request: web.Request) -> web.Response:
    who = caller(request)
    who.require_admin()
    node = node_of(request)
    user, vhost = request.match_info["user"], request.match_info["vhost"]
    data = await body(request)
    if user not in node.defs.users:
        raise error(400, f"no user '{user}'")
    if vhost not in node.defs.vhosts:
        raise error(400, f"no vhost '{vhost}'")
    perms = {k: _check_pattern(k, data.get(k, "")) for k in ("configure", "write", "read")}
    existed = vhost in node.defs.permissions.get(user, {})
    await node.commit(node.defs.plan_permission_put(user, vhost, **perms))
    return no_content() if existed else created()


async def permission_delete(request: web.Request) -> web.Response:
    who = caller(request)
    who.require_admin()
    node = node_of(request)
    user, vhost = request.match_info["user"], request.match_info["vhost"]
    ops = node.defs.plan_permission_delete(user, vhost)
    if not ops:
        raise error(404, "no permissions")
    await node.commit(ops)
    return no_content()


async def topic_permissions_list(request: web.Request) -> web.Response:
    who = caller(request)
    who.require_admin()
    vhost = request.match_info.get("vhost")
    user = request.match_info.get("user")
    return web.json_response(_topic_rows(who.defs, user, vhost))


async def topic_permission_put(request: web.Request) -> web.Response:
    who = caller(request)
    who.require_admin()
    node = node_of(request)
    user, vhost = request.match_info["user"], request.match_info["vhost"]
    data = await body(request)
    exchange = data.get("exchange")
    if not isinstance(exchange, str) or not exchange:
        raise error(400, "exchange is required")
    if user not in node.defs.users or vhost not in node.defs.vhosts:
        raise error(400, "no such user or vhost")
    perms = {k: _check_pattern(k, data.get(k, "")) for k in ("write", "read")}
    await node.commit(node.defs.plan_topic_permission_put(user, vhost, exchange, **perms))
    return created()


async def topic_permission_delete(request: web.Request) -> web.Response:
    who = caller(request)
    who.require_admin()
    node = node_of(request)
    user, vhost = request.match_info["user"], request.match_info["vhost"]
    exchange = request.query.get("exchange")
    ops = node.defs.plan_topic_permission_delete(user, vhost, exchange)
    if not ops:
        raise error(404, "no topic permissions")
    await node.commit(ops)
    return no_content()


# ----------------------------------------------------- connections, channels, consumers
def connection_name(node: Any, row: list) -> str:
    return f"{row[C_HOST]}:{row[C_PORT]} -> {node.settings.bind}:{node.settings.port}"


def _connection_json(node: Any, fe: int, row: list) -> dict:
    props = row[C_PROPS] or {}
    recv_rate, send_rate = node.stats.connection_rates(fe, row[C_ID])
    return {"name": connection_name(node, row), "node": node_name(), "type": "network",
            # An MQTT session names its protocol in the properties it reports (frontend/mqtt/connection.py).
            "protocol": props.get("protocol", "MQTT 3.1.1") if props.get("product") == "MQTT client" else "AMQP 0-9-1",
            "user": row[C_USER], "vhost": row[C_VHOST], "peer_host": row[C_HOST], "peer_port": row[C_PORT],
            "host": node.settings.bind, "port": node.settings.port, "client_properties": props,
            "connected_at": row[C_AT], "channels": len(row[C_CHANNELS]), "recv_oct": row[C_RECV],
            "send_oct": row[C_SEND], "send_pend": row[C_SEND_PEND] if len(row) > C_SEND_PEND else 0,
            "recv_oct_details": {"rate": recv_rate}, "send_oct_details": {"rate": send_rate},
            "state": "blocked" if row[C_BLOCKED] else "running",
            "frontend": fe, "conn_id": row[C_ID], "auth_mechanism": "PLAIN", "ssl": False}


def _visible_connections(who: Caller, node: Any, vhost: str | None = None) -> list[tuple[int, list]]:
    return [(fe, row) for fe, row in node.stats.connections()
            if (vhost is None or row[C_VHOST] == vhost) and who.may_see(row[C_VHOST])
            and (who.sees_all or row[C_USER] == who.name)]


async def connections_list(request: web.Request) -> web.Response:
    who = caller(request)
    node = node_of(request)
    rows = _visible_connections(who, node, request.match_info.get("vhost"))
    return respond(request, rows, lambda r: connection_name(node, r[1]),
                   lambda r: _connection_json(node, r[0], r[1]))


def _find_connection(request: web.Request) -> tuple[Caller, Any, int, list]:
    who = caller(request)
    node = node_of(request)
    name = request.match_info["name"]
    for fe, row in _visible_connections(who, node):
        if connection_name(node, row) == name:
            return who, node, fe, row
    raise error(404, f"no connection '{name}'")


async def connection_get(request: web.Request) -> web.Response:
    _who, node, fe, row = _find_connection(request)
    return web.json_response(_connection_json(node, fe, row))


async def connection_delete(request: web.Request) -> web.Response:
    who, node, fe, row = _find_connection(request)
    if not who.is_admin and row[C_USER] != who.name:
        raise error(401, "only administrators may close other users' connections")
    reason = request.headers.get("X-Reason", "Closed via management plugin")
    node.close_connections(CONNECTION_FORCED, reason, frontend=fe, conn_id=row[C_ID])
    return no_content()


def _channel_json(node: Any, fe: int, row: list, ch: list) -> dict:
    cname = connection_name(node, row)
    number, prefetch, global_prefetch, consumers, unacked, unconfirmed, confirm, tx = ch
    return {"name": f"{cname} ({number})", "number": number, "node": node_name(), "user": row[C_USER],
            "vhost": row[C_VHOST], "connection_details": {"name": cname, "peer_host": row[C_HOST],
                                                          "peer_port": row[C_PORT]},
            "prefetch_count": prefetch, "global_prefetch_count": global_prefetch, "consumer_count": consumers,
            "messages_unacknowledged": unacked, "messages_unconfirmed": unconfirmed, "confirm": confirm,
            "transactional": tx, "state": "running"}


async def channels_list(request: web.Request) -> web.Response:
    who = caller(request)
    node = node_of(request)
    rows = [(fe, row, ch) for fe, row in _visible_connections(who, node, request.match_info.get("vhost"))
            for ch in row[C_CHANNELS]]
    return respond(request, rows, lambda r: f"{connection_name(node, r[1])} ({r[2][0]})",
                   lambda r: _channel_json(node, *r))


async def connection_channels(request: web.Request) -> web.Response:
    _who, node, fe, row = _find_connection(request)
    return web.json_response([_channel_json(node, fe, row, ch) for ch in row[C_CHANNELS]])


async def consumers_list(request: web.Request) -> web.Response:
    who = caller(request)
    node = node_of(request)
    vhost = request.match_info.get("vhost")
    conns = {(fe, row[C_ID]): row for fe, row in _visible_connections(who, node, vhost)}
    out = []
    for fe, c in node.stats.consumers():
        row = conns.get((fe, c[0]))
        if row is None:
            continue
        conn_id, channel, tag, queue, no_ack, prefetch = c
        cname = connection_name(node, row)
        out.append({"consumer_tag": tag, "queue": {"name": queue, "vhost": row[C_VHOST]},
                    "channel_details": {"name": f"{cname} ({channel})", "number": channel,
                                        "connection_name": cname, "peer_host": row[C_HOST],
                                        "peer_port": row[C_PORT], "user": row[C_USER]},
                    "ack_required": not no_ack, "prefetch_count": prefetch, "exclusive": False,
                    "active": True, "activity_status": "up", "arguments": {}})
    return web.json_response(out)


@web.middleware
async def json_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """A bug in a handler answers a JSON 500 (and is logged), never a traceback or an HTML page."""
    try:
        return await handler(request)
    except web.HTTPException:
        raise
    except Exception:
        log.exception("HTTP %s %s failed", request.method, request.path)
        return web.json_response({"error": "internal_error", "reason": "internal error, see the node's log"},
                                 status=500)


def register(app: web.Application, _node: Any) -> None:
    app.middlewares.append(json_errors)
    r = app.router
    r.add_get("/api/overview", overview)
    r.add_get("/api/nodes", nodes)
    r.add_get("/api/nodes/{name}", node_one)
    r.add_get("/api/whoami", whoami)
    r.add_get("/api/aliveness-test/{vhost}", aliveness)
    r.add_get("/api/vhosts", vhosts_list)
    r.add_get("/api/vhosts/{vhost}", vhost_get)
    r.add_put("/api/vhosts/{vhost}", vhost_put)
    r.add_delete("/api/vhosts/{vhost}", vhost_delete)
    r.add_get("/api/vhosts/{vhost}/permissions", vhost_permissions)
    r.add_get("/api/vhosts/{vhost}/topic-permissions", topic_permissions_list)
    r.add_get("/api/vhosts/{vhost}/connections", connections_list)
    r.add_get("/api/vhosts/{vhost}/channels", channels_list)
    r.add_get("/api/users", users_list)
    r.add_get("/api/users/without-permissions", users_without_permissions)
    r.add_post("/api/users/bulk-delete", bulk_delete_users)
    r.add_get("/api/users/{user}", user_get)
    r.add_put("/api/users/{user}", user_put)
    r.add_delete("/api/users/{user}", user_delete)
    r.add_get("/api/users/{user}/permissions", user_permissions)
    r.add_get("/api/users/{user}/topic-permissions", topic_permissions_list)
    r.add_get("/api/permissions", permissions_list)
    r.add_get("/api/permissions/{vhost}/{user}", permission_get)
    r.add_put("/api/permissions/{vhost}/{user}", permission_put)
    r.add_delete("/api/permissions/{vhost}/{user}", permission_delete)
    r.add_get("/api/topic-permissions", topic_permissions_list)
    r.add_get("/api/topic-permissions/{vhost}/{user}", topic_permissions_list)
    r.add_put("/api/topic-permissions/{vhost}/{user}", topic_permission_put)
    r.add_delete("/api/topic-permissions/{vhost}/{user}", topic_permission_delete)
    r.add_get("/api/connections", connections_list)
    r.add_get("/api/connections/{name}", connection_get)
    r.add_delete("/api/connections/{name}", connection_delete)
    r.add_get("/api/connections/{name}/channels", connection_channels)
    r.add_get("/api/channels", channels_list)
    r.add_get("/api/consumers", consumers_list)
    r.add_get("/api/consumers/{vhost}", consumers_list)


