"""Paging, sorting, filtering and column selection of list endpoints, as RabbitMQ's API does them.

Query parameters: ``page`` (1-based; when present the answer is a page object), ``page_size``
(default 100, at most 500), ``name`` (substring, or a regular expression with ``use_regex=true``),
``sort`` (a column, dotted for nested keys), ``sort_reverse``, ``columns`` (comma list of dotted
keys to keep). Items are built lazily: filtering and sorting by name work on the names, so only the
page's items are turned into JSON objects (listing one page of 100,000 queues stays fast).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import Any

from aiohttp import web

from broker.http.auth import error

MAX_PAGE_SIZE = 500


def _truthy(value: str | None) -> bool:
    return (value or "").lower() in ("true", "1", "yes")


def _get_path(item: dict, path: str) -> Any:
    cur: Any = item
    for part in path.split("."):
        if not isinstance(cur, dict):
            return None
        cur = cur.get(part)
    return cur


def _sort_key(value: Any) -> tuple:
    if value is None:
        return (0, 0)
    if isinstance(value, bool):
        return (1, int(value))
    if isinstance(value, (int, float)):
        return (1, value)
    return (2, str(value))


def select_columns(item: dict, columns: list[str]) -> dict:
    out: dict = {}
    for col in columns:
        parts = col.split(".")
        value = _get_path(item, col)
        if value is None and col not in item:
            continue
        cur = out
        for part in parts[:-1]:
            cur = cur.setdefault(part, {})
        cur[parts[-1]] = value
    return out


def respond(request: web.Request, rows: Sequence[Any], name_of: Callable[[Any], str],
            build: Callable[[Any], dict], cheap_sorts: dict[str, Callable[[Any], Any]] | None = None) -> web.Response:
    """The JSON answer for a list endpoint over rows (opaque), built with build(row).

    cheap_sorts: columns that can be sorted on without building the items (each returns values of
    one type for every row)."""
    q = request.query
    total = len(rows)
    name = q.get("name")
    if name:
        if _truthy(q.get("use_regex")):
            try:
                rx = re.compile(name)
            except re.error as exc:
                raise error(400, f"invalid regular expression {name!r}: {exc}") from None
            rows = [r for r in rows if rx.search(name_of(r))]
        else:
            rows = [r for r in rows if name in name_of(r)]
    sort = q.get("sort")
    reverse = _truthy(q.get("sort_reverse"))
    cheap = dict(cheap_sorts or {})
    cheap.setdefault("name", name_of)
    built: list | None = None
    if sort and sort in cheap:
        # cheap sort keys return one type (all ints or all strings): no per-row normalizing wrapper
        rows = sorted(rows, key=cheap[sort], reverse=reverse)
    elif sort:
        built = sorted((build(r) for r in rows), key=lambda d: _sort_key(_get_path(d, sort)), reverse=reverse)
    elif reverse:
        rows = list(reversed(rows))
    columns = [c for c in (q.get("columns") or "").split(",") if c]
    page_arg = q.get("page")
    if page_arg is None:
        items = built if built is not None else [build(r) for r in rows]
        if columns:
            items = [select_columns(i, columns) for i in items]
        return web.json_response(items)
    try:
        page = int(page_arg)
        page_size = int(q.get("page_size", 100))
    except ValueError:
        raise error(400, "page and page_size must be integers") from None
    if page < 1 or page_size < 1 or page_size > MAX_PAGE_SIZE:
        raise error(400, f"page must be >= 1 and page_size between 1 and {MAX_PAGE_SIZE}")
    filtered = len(built) if built is not None else len(rows)
    page_count = max(1, math.ceil(filtered / page_size))
    if page > page_count:
        raise error(400, f"page {page} is beyond the last page ({page_count})")
    start = (page - 1) * page_size
    if built is not None:
        items = built[start:start + page_size]
    else:
        items = [build(r) for r in rows[start:start + page_size]]
    if columns:
        items = [select_columns(i, columns) for i in items]
    return web.json_response({"filtered_count": filtered, "item_count": len(items), "items": items,
                              "page": page, "page_count": page_count, "page_size": page_size,
                              "total_count": total})
