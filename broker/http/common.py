"""Helpers the management route modules share: the caller, JSON bodies, running node operations."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from broker.amqp.errors import AMQPError
from broker.http.auth import Caller, authenticate, error
from broker.http.server import NODE_KEY

PRODUCT = "ShardMQ"
# The RabbitMQ version whose management API shapes this follows (clients check it).
RABBITMQ_VERSION = "3.13.0"


def node_of(request: web.Request) -> Any:
    return request.app[NODE_KEY]


def caller(request: web.Request) -> Caller:
    return authenticate(request)


async def body(request: web.Request) -> dict:
    """The JSON object of a PUT/POST body ({} when empty); 400 on anything else."""
    raw = await request.read()
    if not raw.strip():
        return {}
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise error(400, f"malformed JSON body: {exc}") from None
    if not isinstance(data, dict):
        raise error(400, "the body must be a JSON object")
    return data


def truthy(value: Any) -> bool:
    if isinstance(value, str):
        return value.lower() in ("true", "1", "yes")
    return bool(value)


def amqp_to_http(exc: AMQPError) -> web.HTTPException:
    """An AMQP refusal from the planner as the HTTP answer RabbitMQ's API gives."""
    text = exc.text
    if exc.code == 403:
        return error(401, text, "access_refused")
    if exc.code == 404:
        return error(404, text, "Object Not Found")
    if exc.code == 530 and "not found" in text:
        return error(404, text, "Object Not Found")
    return error(400, text, "bad_request")


async def execute(request: web.Request, who: Caller, op: str, args: dict) -> dict:
    """Run a declare/delete/bind request through the node's planner, checked against who's permissions."""
    node = node_of(request)
    try:
        return await node.execute(op, {**args, "user": who.name})
    except AMQPError as exc:
        raise amqp_to_http(exc) from None


def no_content() -> web.Response:
    return web.Response(status=204)


def created() -> web.Response:
    return web.Response(status=201)
