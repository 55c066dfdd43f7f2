"""Helpers for cluster tests: a private etcd, cluster nodes on free ports, polling HTTP reads."""

from __future__ import annotations

import itertools
import json
import time
import urllib.error
import urllib.request
from pathlib import Path

from tests.harness import Node, NodeFactory, wait_until

SECRET = "test-cluster-secret"
_prefixes = itertools.count()


def http_get(port: int, path: str, timeout: float = 2.0) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")
    except (urllib.error.URLError, OSError, ValueError):
        return 0, {}


def wait_for(predicate, timeout: float, what: str, interval: float = 0.05):
    """Poll ``predicate`` until it returns something truthy (returned) or fail naming ``what``."""
    return wait_until(predicate, timeout, what, interval)


def is_leader(node: Node) -> bool:
    return node.running() and http_get(node.http_port, "/api/health/checks/leader", 1.0)[0] == 200


def leaders(nodes: list[Node]) -> list[Node]:
    return [n for n in nodes if is_leader(n)]


def one_leader(nodes: list[Node], timeout: float = 20.0) -> Node:
    found = wait_for(lambda: (ls := leaders(nodes)) and len(ls) == 1 and ls, timeout, "exactly one leader")
    return found[0]


class Cluster:
    """Nodes of one cluster (one etcd prefix) made by a NodeFactory."""

    def __init__(self, factory: NodeFactory, etcd_endpoints: str, ttl: int = 1) -> None:
        self.factory = factory
        self.endpoints = etcd_endpoints
        self.prefix = f"test{next(_prefixes)}-{int(time.time() * 1000) % 10**8}"
        self.ttl = ttl
        self.nodes: list[Node] = []
        self.secret_file = Path(factory.base_dir) / "cluster-secret"
        self.secret_file.write_text(SECRET + "\n")

    def add(self, name: str, start: bool = True, wait: bool = True, extra: tuple = (), **kw) -> Node:
        node = self.factory(name=name, start=False, frontends=kw.pop("frontends", 1),
                            shards=kw.pop("shards", 1), extra_args=[
                                "--cluster", "--etcd-endpoints", self.endpoints, "--etcd-prefix", self.prefix,
                                "--node-name", name, "--advertised-host", "127.0.0.1",
                                "--lease-ttl", str(self.ttl), "--cluster-secret-file", str(self.secret_file),
                                *extra], **kw)
        self.nodes.append(node)
        if start:
            node.start(wait=wait)
        return node

    def start(self, n: int = 3, **kw) -> list[Node]:
        nodes = [self.add(f"n{i + 1}", wait=False, **kw) for i in range(n)]
        for node in nodes:
            node.wait_ready()
        return nodes

    def leader(self, timeout: float = 20.0) -> Node:
        return one_leader([n for n in self.nodes if n.running()], timeout)
