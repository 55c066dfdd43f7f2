"""Basic auth of the management API against the broker's users; tags decide what a user may do.

As RabbitMQ's management plugin: a user needs one of the tags ``management``, ``policymaker``,
``monitoring`` or ``administrator`` to use the API at all (401 otherwise). ``administrator``
sees and changes everything; ``monitoring`` sees everything (read only, beyond its own vhosts'
objects); ``policymaker`` may also change policies and parameters of its vhosts; ``management``
sees and acts in the vhosts it has permissions on. Users listed in loopback_users (``guest``)
may only log in from a loopback address, as over AMQP.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

from aiohttp import web

from broker.auth import check_password, is_loopback_peer
from broker.http.server import NODE_KEY

MANAGEMENT_TAGS = frozenset(("management", "policymaker", "monitoring", "administrator"))


def error(status: int, reason: str, kind: str | None = None) -> web.HTTPException:
    """RabbitMQ's error body: {"error": ..., "reason": ...}."""
    kinds = {400: "bad_request", 401: "not_authorised", 404: "Object Not Found", 405: "method_not_allowed"}
    body = json.dumps({"error": kind or kinds.get(status, "error"), "reason": reason})
    cls = {400: web.HTTPBadRequest, 401: web.HTTPUnauthorized, 404: web.HTTPNotFound,
           405: web.HTTPMethodNotAllowed, 409: web.HTTPConflict, 503: web.HTTPServiceUnavailable}.get(status)
    if cls is None:
        return web.HTTPInternalServerError(text=body, content_type="application/json")
    if cls is web.HTTPMethodNotAllowed:
        return cls("", [], text=body, content_type="application/json")
    # No WWW-Authenticate challenge: a browser would answer the UI's fetch() with its own login dialog.
    return cls(text=body, content_type="application/json")


class Caller:
    """The authenticated user of one request."""

    __slots__ = ("name", "tags", "defs")

    def __init__(self, name: str, tags: list[str], defs: Any) -> None:
        self.name = name
        self.tags = set(tags)
        self.defs = defs

    @property
    def is_admin(self) -> bool:
        return "administrator" in self.tags

    @property
    def sees_all(self) -> bool:
        return bool(self.tags & {"administrator", "monitoring"})

    @property
    def policymaker(self) -> bool:
        return bool(self.tags & {"administrator", "policymaker"})

    def vhosts(self) -> list[str]:
        """The vhosts this user may see objects of."""
        if self.sees_all:
            return list(self.defs.vhosts)
        mine = self.defs.permissions.get(self.name, {})
        return [v for v in self.defs.vhosts if v in mine]

    def may_see(self, vhost: str) -> bool:
        return self.sees_all or vhost in self.defs.permissions.get(self.name, {})

    def require_admin(self) -> None:
        if not self.is_admin:
            raise error(401, "Not administrator user")

    def require_vhost(self, vhost: str, policymaker: bool = False) -> None:
        """Acting (not only looking) in vhost: permissions there (and the policymaker tag if asked)."""
        if vhost not in self.defs.vhosts:
            raise error(404, f"vhost '{vhost}' does not exist", "Object Not Found")
        if policymaker and not self.policymaker:
            raise error(401, "Not policymaker user")
        if not self.is_admin and vhost not in self.defs.permissions.get(self.name, {}):
            raise error(401, f"access to vhost '{vhost}' refused for user '{self.name}'")



def credentials(request: web.Request) -> tuple[str, str] | None:
    header = request.headers.get("Authorization", "")
    if not header.lower().startswith("basic "):
        return None
    try:
        user, sep, password = base64.b64decode(header[6:].strip(), validate=True).decode("utf-8").partition(":")
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None
    return (user, password) if sep else None


def authenticate(request: web.Request) -> Caller:
    """The caller, or 401 (no or wrong credentials, no management tag, loopback-only user)."""
    node = request.app[NODE_KEY]
    defs = node.defs
    creds = credentials(request)
    if creds is None:
        raise error(401, "Login failed")
    name, password = creds
    user = defs.users.get(name)
    if user is None or not check_password(user, password):
        raise error(401, "Login failed")
    if name in defs.loopback_users and not (request.remote is not None and is_loopback_peer((request.remote,))):
        raise error(401, "User can only log in via localhost")
    if not MANAGEMENT_TAGS & set(user.tags):
        raise error(401, "Not management user")
    return Caller(name, list(user.tags), defs)
