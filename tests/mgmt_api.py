"""A small client of the management HTTP API for tests (plain urllib: what any HTTP client sends)."""

from __future__ import annotations

import base64
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

import pika


def q(name: str) -> str:
    """A path segment as RabbitMQ's API wants it ('/' is %2F)."""
    return urllib.parse.quote(name, safe="")


class Api:
    def __init__(self, port: int, user: str = "guest", password: str = "guest") -> None:
        self.base = f"http://127.0.0.1:{port}"
        self.user, self.password = user, password

    def as_user(self, user: str, password: str) -> Api:
        return Api(int(self.base.rsplit(":", 1)[1]), user, password)

    def call(self, method: str, path: str, body: Any = None, headers: dict | None = None) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, method=method)
        token = base64.b64encode(f"{self.user}:{self.password}".encode()).decode()
        req.add_header("Authorization", f"Basic {token}")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        for k, v in (headers or {}).items():
            req.add_header(k, v)
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                raw = resp.read()
                return resp.status, json.loads(raw) if raw else None
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            try:
                return exc.code, json.loads(raw) if raw else None
            except ValueError:
                return exc.code, raw.decode("utf-8", "replace")

    def get(self, path: str) -> Any:
        status, data = self.call("GET", path)
        assert status == 200, (path, status, data)
        return data

    def put(self, path: str, body: Any = None) -> int:
        status, data = self.call("PUT", path, body if body is not None else {})
        assert status in (201, 204), (path, status, data)
        return status

    def delete(self, path: str) -> int:
        status, data = self.call("DELETE", path)
        assert status == 204, (path, status, data)
        return status

    def wait_for(self, path: str, predicate, timeout: float = 10.0) -> Any:
        """GET path until predicate(json) holds (stats arrive every stats_interval)."""
        deadline = time.monotonic() + timeout
        while True:
            data = self.get(path)
            if predicate(data):
                return data
            assert time.monotonic() < deadline, f"{path} never matched: {data}"
            time.sleep(0.05)

    def add_user(self, name: str, password: str, tags: str = "", vhost: str | None = "/",
                 perms: tuple[str, str, str] = (".*", ".*", ".*")) -> None:
        self.put(f"/api/users/{q(name)}", {"password": password, "tags": tags})
        if vhost is not None:
            self.put(f"/api/permissions/{q(vhost)}/{q(name)}",
                     {"configure": perms[0], "write": perms[1], "read": perms[2]})


def connect(node, user: str, password: str, vhost: str = "/") -> pika.BlockingConnection:
    return pika.BlockingConnection(pika.ConnectionParameters(
        host="127.0.0.1", port=node.port, virtual_host=vhost, credentials=pika.PlainCredentials(user, password),
        connection_attempts=1))
