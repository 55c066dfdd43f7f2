"""The management web UI: static HTML/JS/CSS (no build step) served at ``/`` by the node's HTTP app.

The page only calls the public management API (``/api/...``) with the credentials the user logs in
with; nothing here has access the API does not give.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from aiohttp import web

HERE = Path(__file__).resolve().parent
_TYPES = {".html": "text/html", ".js": "application/javascript", ".css": "text/css"}


async def index(_request: web.Request) -> web.Response:
    return web.FileResponse(HERE / "index.html", headers={"Cache-Control": "no-cache"})


async def asset(request: web.Request) -> web.StreamResponse:
    name = request.match_info["name"]
    path = HERE / name
    if path.suffix not in _TYPES or path.parent != HERE or not path.is_file():
        raise web.HTTPNotFound()
    return web.FileResponse(path, headers={"Content-Type": _TYPES[path.suffix], "Cache-Control": "no-cache"})


def register(app: web.Application, _node: Any) -> None:
    app.router.add_get("/", index)
    app.router.add_get("/ui/{name}", asset)
