"""Management API: exchanges, queues, bindings (RabbitMQ's paths and shapes), publish, get, purge.

Declares, deletes and bindings go through the node's planner (``Node._execute``) with the
caller's name, so the API enforces the same configure/write/read permissions as AMQP. Counts
come from the shards' periodic STATS; a single queue's GET asks its shard for fresh counts.
"""

from __future__ import annotations

import base64
import hashlib
import json
from typing import Any

from aiohttp import web
from pamqp import commands as C

from broker.amqp.properties import decode_properties, encode_properties
from broker.definitions import plain
from broker.http.auth import Caller, error
from broker.http.common import body, caller, created, execute, no_content, node_of, truthy
from broker.http.listing import respond
from broker.http.management import node_name
from broker.node_stats import Q_BYTES, Q_CONSUMERS, Q_READY, Q_UNACKED
from broker.permissions import READ, WRITE, permitted
from broker.policies import best_match


def _vhost_arg(request: web.Request, who: Caller) -> str | None:
    vhost = request.match_info.get("vhost")
    if vhost is not None and (vhost not in who.defs.vhosts or not who.may_see(vhost)):
        raise error(404, f"vhost '{vhost}' does not exist")
    return vhost


# ---------------------------------------------------------------------- queues
def _queue_type(q: Any) -> str:
    t = q.arguments.get("x-queue-type", "classic")
    return t if isinstance(t, str) else "classic"


def queue_json(node: Any, vhost: str, q: Any, counts: list | None) -> dict:
    defs = node.defs
    ready, unacked, consumers, nbytes = (counts[Q_READY], counts[Q_UNACKED], counts[Q_CONSUMERS],
                                        counts[Q_BYTES]) if counts else (0, 0, 0, 0)
    policy = defs.effective_policy(vhost, "queue", q.name)
    v = defs.vhosts[vhost]
    p = best_match(v.policies.values(), "queue", q.name)
    return {"name": q.name, "vhost": vhost, "durable": q.durable, "auto_delete": q.auto_delete,
            "exclusive": q.exclusive, "arguments": q.arguments, "node": node_name(), "state": "running",
            "type": _queue_type(q), "messages": ready + unacked, "messages_ready": ready,
            "messages_unacknowledged": unacked, "consumers": consumers, "message_bytes_ready": nbytes,
            "policy": p.name if p is not None else None, "effective_policy_definition": policy,
            "exclusive_consumer_tag": None, "shard": q.shard,
            "message_stats": node.stats.message_stats(counts) if counts else {}}


def _visible_queues(who: Caller, vhost: str | None) -> list[tuple[str, Any]]:
    defs = who.defs
    names = [vhost] if vhost is not None else sorted(who.vhosts())
    return [(vn, q) for vn in names for q in defs.vhosts[vn].queues.values()]


async def queues_list(request: web.Request) -> web.Response:
    who = caller(request)
    node = node_of(request)
    vhost = _vhost_arg(request, who)
    counts = node.stats.queues()
    zero = [None, None, 0, 0, 0, 0]
    names = [vhost] if vhost is not None else sorted(who.vhosts())
    if len(names) == 1:
        # One vhost (the usual case): list the queue objects themselves, no (vhost, queue) pair per
        # queue, so a page of 100,000 queues allocates next to nothing.
        vn = names[0]
        rows: list = list(who.defs.vhosts[vn].queues.values())

        def build(r: Any) -> dict:
            return queue_json(node, vn, r, counts.get((vn, r.name)))

        def name_of(r: Any) -> str:
            return r.name
    else:
        rows = _visible_queues(who, vhost)

        def build(r: Any) -> dict:
            return queue_json(node, r[0], r[1], counts.get((r[0], r[1].name)))

        def name_of(r: Any) -> str:
            return r[1].name

    get = counts.get
    if len(names) == 1:
        vn = names[0]
        cheap = {"vhost": lambda r: vn,
                 "messages_ready": lambda r: (get((vn, r.name)) or zero)[Q_READY],
                 "messages_unacknowledged": lambda r: (get((vn, r.name)) or zero)[Q_UNACKED],
                 "messages": lambda r: sum((get((vn, r.name)) or zero)[Q_READY:Q_UNACKED + 1]),
                 "consumers": lambda r: (get((vn, r.name)) or zero)[Q_CONSUMERS]}
    else:
        cheap = {"vhost": lambda r: r[0],
                 "messages_ready": lambda r: (get((r[0], r[1].name)) or zero)[Q_READY],
                 "messages_unacknowledged": lambda r: (get((r[0], r[1].name)) or zero)[Q_UNACKED],
                 "messages": lambda r: sum((get((r[0], r[1].name)) or zero)[Q_READY:Q_UNACKED + 1]),
                 "consumers": lambda r: (get((r[0], r[1].name)) or zero)[Q_CONSUMERS]}
    return respond(request, rows, name_of, build, cheap)


def _queue_of(request: web.Request) -> tuple[Caller, Any, str, Any]:
    who = caller(request)
    vhost = _vhost_arg(request, who)
    name = request.match_info["name"]
    q = who.defs.queue(vhost, name)
    if q is None:
        raise error(404, f"no queue '{name}' in vhost '{vhost}'")
    return who, node_of(request), vhost, q


async def queue_get(request: web.Request) -> web.Response:
    _who, node, vhost, q = _queue_of(request)
    counts = list(node.stats.queues().get((vhost, q.name)) or [vhost, q.name, 0, 0, 0, 0])
    info = await node.queue_info(vhost, q.name)  # fresh ready count and consumers from the shard
    doc = queue_json(node, vhost, q, counts)
    if info is not None:
        counts[Q_READY], counts[Q_CONSUMERS] = int(info.get("messages", 0)), int(info.get("consumers", 0))
        doc = queue_json(node, vhost, q, counts)
        # Storage damage the shard found in this queue since it opened it (docs/storage.md "Recovery").
        doc["damaged_records"] = int(info.get("damaged_records", 0))
        doc["damaged_acks"] = int(info.get("damaged_acks", 0))
    return web.json_response(doc)


async def queue_put(request: web.Request) -> web.Response:
    who = caller(request)
    vhost = _vhost_arg(request, who)
    name = request.match_info["name"]
    data = await body(request)
    args = data.get("arguments") or {}
    if not isinstance(args, dict):
        raise error(400, "arguments must be an object")
    if data.get("type") and "x-queue-type" not in args:
        args["x-queue-type"] = data["type"]
    existed = who.defs.queue(vhost, name) is not None
    await execute(request, who, "queue.declare", {
        "vhost": vhost, "queue": name, "passive": False, "durable": truthy(data.get("durable", True)),
        "exclusive": False, "auto_delete": truthy(data.get("auto_delete", False)), "arguments": args,
        "owner": None})
    return no_content() if existed else created()


async def queue_delete(request: web.Request) -> web.Response:
    who, _node, vhost, q = _queue_of(request)
    await execute(request, who, "queue.delete", {
        "vhost": vhost, "queue": q.name, "if_unused": truthy(request.query.get("if-unused")),
        "if_empty": truthy(request.query.get("if-empty")), "owner": None})
    return no_content()


def _require(who: Caller, vhost: str, perm: str, kind: str, name: str) -> None:
    who.require_vhost(vhost)
    if not permitted(who.defs, who.name, vhost, perm, name):
        raise error(401, f"access to {kind} '{name or 'amq.default'}' in vhost '{vhost}' refused for user "
                         f"'{who.name}'", "access_refused")


async def queue_purge(request: web.Request) -> web.Response:
    who, node, vhost, q = _queue_of(request)
    _require(who, vhost, READ, "queue", q.name)
    ok, result = await node.shard_query(q.shard, "purge", {"vhost": vhost, "queue": q.name})
    if not ok:
        raise error(400, str(result[1]))
    return no_content()


def _props_json(props_raw: bytes) -> dict:
    try:
        props = dict(decode_properties(props_raw))
    except ValueError:
        return {}
    out = {}
    for key, value in props.items():
        if value is None or value == "" and key == "cluster_id":
            continue
        if isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
        out["type" if key == "message_type" else key] = value
    return json.loads(json.dumps(plain(out), default=str))


def _payload(body_bytes: bytes, encoding: str, truncate: int | None) -> tuple[str, str, int]:
    size = len(body_bytes)
    if truncate is not None:
        body_bytes = body_bytes[:truncate]
    if encoding == "auto":
        try:
            return body_bytes.decode("utf-8"), "string", size
        except UnicodeDecodeError:
            pass
    return base64.b64encode(body_bytes).decode("ascii"), "base64", size


async def queue_get_messages(request: web.Request) -> web.Response:
    who, node, vhost, q = _queue_of(request)
    _require(who, vhost, READ, "queue", q.name)
    data = await body(request)
    ackmode = data.get("ackmode", "ack_requeue_true")
    if ackmode not in ("ack_requeue_true", "ack_requeue_false", "reject_requeue_true", "reject_requeue_false"):
        raise error(400, f"invalid ackmode '{ackmode}'")
    encoding = data.get("encoding", "auto")
    if encoding not in ("auto", "base64"):
        raise error(400, f"invalid encoding '{encoding}'")
    try:
        count = int(data.get("count", 1))
        truncate = int(data["truncate"]) if data.get("truncate") not in (None, "") else None
    except (TypeError, ValueError):
        raise error(400, "count and truncate must be integers") from None
    ok, result = await node.shard_query(q.shard, "get", {"vhost": vhost, "queue": q.name, "count": count,
                                                         "requeue": ackmode.endswith("requeue_true")})
    if not ok:
        raise error(400, str(result[1]))
    out = []
    for redelivered, exchange, routing_key, props_raw, body_bytes, remaining in result["messages"]:
        payload, enc, size = _payload(bytes(body_bytes), encoding, truncate)
        out.append({"payload_bytes": size, "redelivered": redelivered, "exchange": exchange,
                    "routing_key": routing_key, "message_count": remaining,
                    "properties": _props_json(bytes(props_raw)), "payload": payload, "payload_encoding": enc})
    return web.json_response(out)


# ------------------------------------------------------------------- exchanges
def exchange_json(vhost: str, x: Any) -> dict:
    return {"name": x.name, "vhost": vhost, "type": x.type, "durable": x.durable, "auto_delete": x.auto_delete,
            "internal": x.internal, "arguments": x.arguments, "user_who_performed_action": "",
            "policy": None}


async def exchanges_list(request: web.Request) -> web.Response:
    who = caller(request)
    vhost = _vhost_arg(request, who)
    names = [vhost] if vhost is not None else sorted(who.vhosts())
    rows = [(vn, x) for vn in names for x in who.defs.vhosts[vn].exchanges.values()]
    return respond(request, rows, lambda r: r[1].name, lambda r: exchange_json(r[0], r[1]),
                   {"vhost": lambda r: r[0], "type": lambda r: r[1].type})


def _exchange_name(request: web.Request) -> str:
    name = request.match_info["name"]
    return "" if name == "amq.default" else name


async def exchange_get(request: web.Request) -> web.Response:
    who = caller(request)
    vhost = _vhost_arg(request, who)
    x = who.defs.exchange(vhost, _exchange_name(request))
    if x is None:
        raise error(404, f"no exchange '{request.match_info['name']}' in vhost '{vhost}'")
    return web.json_response(exchange_json(vhost, x))


async def exchange_put(request: web.Request) -> web.Response:
    who = caller(request)
    vhost = _vhost_arg(request, who)
    name = _exchange_name(request)
    data = await body(request)
    if "type" not in data:
        raise error(400, "type is required")
    if not isinstance(data.get("arguments") or {}, dict):
        raise error(400, "arguments must be an object")
    existed = who.defs.exchange(vhost, name) is not None
    await execute(request, who, "exchange.declare", {
        "vhost": vhost, "exchange": name, "exchange_type": str(data["type"]), "passive": False,
        "durable": truthy(data.get("durable", True)), "auto_delete": truthy(data.get("auto_delete", False)),
        "internal": truthy(data.get("internal", False)), "arguments": data.get("arguments") or {}})
    return no_content() if existed else created()


async def exchange_delete(request: web.Request) -> web.Response:
    who = caller(request)
    vhost = _vhost_arg(request, who)
    name = _exchange_name(request)
    if who.defs.exchange(vhost, name) is None:
        raise error(404, f"no exchange '{name}' in vhost '{vhost}'")
    await execute(request, who, "exchange.delete", {"vhost": vhost, "exchange": name,
                                                    "if_unused": truthy(request.query.get("if-unused"))})
    return no_content()


async def exchange_publish(request: web.Request) -> web.Response:
    who = caller(request)
    node = node_of(request)
    vhost = _vhost_arg(request, who)
    name = _exchange_name(request)
    _require(who, vhost, WRITE, "exchange", name)
    defs = who.defs
    x = defs.exchange(vhost, name)
    if x is None:
        raise error(404, f"no exchange '{name}' in vhost '{vhost}'")
    data = await body(request)
    routing_key = data.get("routing_key", "")
    payload = data.get("payload", "")
    if not isinstance(routing_key, str) or not isinstance(payload, str):
        raise error(400, "routing_key and payload must be strings")
    if data.get("payload_encoding", "string") == "base64":
        try:
            raw = base64.b64decode(payload, validate=True)
        except ValueError:
            raise error(400, "payload is not valid base64") from None
    else:
        raw = payload.encode()
    props = data.get("properties") or {}
    if not isinstance(props, dict):
        raise error(400, "properties must be an object")
    try:
        fields = {("message_type" if k == "type" else k): v for k, v in props.items()}
        props_raw = encode_properties(C.Basic.Properties(**fields))
    except (TypeError, ValueError, KeyError) as exc:
        raise error(400, f"invalid properties: {exc}") from None
    queues = defs.route(vhost, name, routing_key, props_raw)
    groups: dict[int, list[str]] = {}
    for qn in queues:
        q = defs.queue(vhost, qn)
        if q is not None:
            groups.setdefault(q.shard, []).append(qn)
    for shard, names in groups.items():
        ok, result = await node.shard_query(shard, "publish", {
            "vhost": vhost, "queues": names, "exchange": name, "routing_key": routing_key, "props_raw": props_raw,
            "body": raw, "persistent": props.get("delivery_mode") == 2})
        if not ok:
            raise error(400, str(result[1]))
    return web.json_response({"routed": bool(groups)})


# -------------------------------------------------------------------- bindings
def properties_key(routing_key: str, arguments: dict) -> str:
    """RabbitMQ's binding properties_key: the routing key, '~' alone when both are empty, and a hash
    of the arguments after '~' when there are some."""
    if not arguments:
        return routing_key or "~"
    digest = hashlib.md5(json.dumps(arguments, sort_keys=True, default=str).encode()).digest()
    return f"{routing_key}~{base64.urlsafe_b64encode(digest).decode().rstrip('=')}"


def binding_json(vhost: str, b: tuple) -> dict:
    source, dest_kind, dest, routing_key, args = b
    return {"source": source, "vhost": vhost, "destination": dest, "destination_type": dest_kind,
            "routing_key": routing_key, "arguments": args, "properties_key": properties_key(routing_key, args)}


def _all_bindings(defs: Any, vhost: str) -> list[dict]:
    """Explicit bindings plus the default exchange's implicit one per queue (as RabbitMQ lists them)."""
    out = [binding_json(vhost, ("", "queue", q, q, {})) for q in defs.vhosts[vhost].queues]
    out += [binding_json(vhost, b) for b in defs.bindings(vhost)]
    return out


async def bindings_list(request: web.Request) -> web.Response:
    who = caller(request)
    vhost = _vhost_arg(request, who)
    names = [vhost] if vhost is not None else sorted(who.vhosts())
    rows = [b for vn in names for b in _all_bindings(who.defs, vn)]
    return respond(request, rows, lambda b: b["routing_key"], lambda b: b)


def _kind(letter: str) -> str:
    if letter == "q":
        return "queue"
    if letter == "e":
        return "exchange"
    raise error(404, "not found")


async def bindings_between(request: web.Request) -> web.Response:
    who = caller(request)
    vhost = _vhost_arg(request, who)
    m = request.match_info
    src, kind, dst = m["source"], _kind(m["dkind"]), m["dest"]
    if who.defs.exchange(vhost, src) is None:
        raise error(404, f"no exchange '{src}' in vhost '{vhost}'")
    rows = [binding_json(vhost, b) for b in who.defs.bindings(vhost) if b[0] == src and b[1] == kind and b[2] == dst]
    props = m.get("props")
    if props is None:
        return web.json_response(rows)
    for row in rows:
        if row["properties_key"] == props:
            return web.json_response(row)
    raise error(404, "no such binding")


async def binding_create(request: web.Request) -> web.Response:
    who = caller(request)
    vhost = _vhost_arg(request, who)
    m = request.match_info
    src, kind, dst = m["source"], _kind(m["dkind"]), m["dest"]
    data = await body(request)
    rk = data.get("routing_key", "")
    args = data.get("arguments") or {}
    if not isinstance(rk, str) or not isinstance(args, dict):
        raise error(400, "routing_key must be a string and arguments an object")
    if kind == "queue":
        await execute(request, who, "queue.bind", {"vhost": vhost, "exchange": src, "queue": dst,
                                                  "routing_key": rk, "arguments": args, "owner": None})
    else:
        await execute(request, who, "exchange.bind", {"vhost": vhost, "source": src, "destination": dst,
                                                     "routing_key": rk, "arguments": args, "owner": None})
    location = f"{request.path}/{properties_key(rk, args)}"
    return web.Response(status=201, headers={"Location": location})


async def binding_delete(request: web.Request) -> web.Response:
    who = caller(request)
    vhost = _vhost_arg(request, who)
    m = request.match_info
    src, kind, dst, props = m["source"], _kind(m["dkind"]), m["dest"], m["props"]
    for b in who.defs.bindings(vhost):
        if b[0] == src and b[1] == kind and b[2] == dst and properties_key(b[3], b[4]) == props:
            if kind == "queue":
                await execute(request, who, "queue.unbind", {"vhost": vhost, "exchange": src, "queue": dst,
                                                            "routing_key": b[3], "arguments": b[4], "owner": None})
            else:
                await execute(request, who, "exchange.unbind", {"vhost": vhost, "source": src, "destination": dst,
                                                               "routing_key": b[3], "arguments": b[4],
                                                               "owner": None})
            return no_content()
    raise error(404, "no such binding")


async def queue_bindings(request: web.Request) -> web.Response:
    _who, node, vhost, q = _queue_of(request)
    rows = [b for b in _all_bindings(node.defs, vhost) if b["destination_type"] == "queue"
            and b["destination"] == q.name]
    return web.json_response(rows)


async def exchange_bindings(request: web.Request) -> web.Response:
    who = caller(request)
    vhost = _vhost_arg(request, who)
    name = _exchange_name(request)
    if who.defs.exchange(vhost, name) is None:
        raise error(404, f"no exchange '{name}' in vhost '{vhost}'")
    side = request.match_info["side"]
    if side not in ("source", "destination"):
        raise error(404, "not found")
    rows = [binding_json(vhost, b) for b in who.defs.bindings(vhost)
            if (b[0] == name if side == "source" else (b[1] == "exchange" and b[2] == name))]
    return web.json_response(rows)


def register(app: web.Application, _node: Any) -> None:
    r = app.router
    r.add_get("/api/queues", queues_list)
    r.add_get("/api/queues/{vhost}", queues_list)
    r.add_get("/api/queues/{vhost}/{name}", queue_get)
    r.add_put("/api/queues/{vhost}/{name}", queue_put)
    r.add_delete("/api/queues/{vhost}/{name}", queue_delete)
    r.add_delete("/api/queues/{vhost}/{name}/contents", queue_purge)
    r.add_post("/api/queues/{vhost}/{name}/get", queue_get_messages)
    r.add_get("/api/queues/{vhost}/{name}/bindings", queue_bindings)
    r.add_get("/api/exchanges", exchanges_list)
    r.add_get("/api/exchanges/{vhost}", exchanges_list)
    r.add_get("/api/exchanges/{vhost}/{name}", exchange_get)
    r.add_put("/api/exchanges/{vhost}/{name}", exchange_put)
    r.add_delete("/api/exchanges/{vhost}/{name}", exchange_delete)
    r.add_post("/api/exchanges/{vhost}/{name}/publish", exchange_publish)
    r.add_get("/api/exchanges/{vhost}/{name}/bindings/{side}", exchange_bindings)
    r.add_get("/api/bindings", bindings_list)
    r.add_get("/api/bindings/{vhost}", bindings_list)
    r.add_get("/api/bindings/{vhost}/e/{source}/{dkind}/{dest}", bindings_between)
    r.add_post("/api/bindings/{vhost}/e/{source}/{dkind}/{dest}", binding_create)
    r.add_get("/api/bindings/{vhost}/e/{source}/{dkind}/{dest}/{props}", bindings_between)
    r.add_delete("/api/bindings/{vhost}/e/{source}/{dkind}/{dest}/{props}", binding_delete)


