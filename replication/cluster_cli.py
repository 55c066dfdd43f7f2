"""``shardmq cluster status``: the leader, every node, ISR membership and each follower's lag.

Reads etcd (``<prefix>/leader``, ``<prefix>/isr``, ``<prefix>/nodes/*``) and each node's
``/api/cluster/status`` on its HTTP port (from its etcd record). Exit status: 0 with a leader,
1 without one or when etcd cannot be reached, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import urllib.error
import urllib.request
from typing import Any

from replication.coordination import CoordinationError, Coordinator, NodeInfo


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardmq cluster", description="Inspect a ShardMQ cluster.")
    sub = p.add_subparsers(dest="command", required=True)
    st = sub.add_parser("status", help="leader, nodes, ISR and follower lag")
    st.add_argument("--etcd-endpoints", default="127.0.0.1:2379", metavar="HOSTS",
                    help="etcd endpoints HOST:PORT, comma separated (default 127.0.0.1:2379)")
    st.add_argument("--etcd-prefix", default="shardmq", metavar="PREFIX", help="key prefix (default shardmq)")
    st.add_argument("--json", action="store_true", help="print the gathered state as JSON")
    st.add_argument("--timeout", type=float, default=2.0, help="seconds per node HTTP request (default 2)")
    return p


def _node_status(info: NodeInfo, timeout: float) -> dict | None:
    if not info.http_port:
        return None
    try:
        url = f"http://{info.host}:{info.http_port}/api/cluster/status"
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None


async def gather(endpoints: list[str], prefix: str, timeout: float) -> dict[str, Any]:
    coord = Coordinator(endpoints, prefix, "shardmq-cli", 10)
    try:
        leader = await coord.leader()
        isr = await coord.isr()
        nodes = await coord.nodes()
    finally:
        await coord.stop()
    loop = asyncio.get_running_loop()
    statuses = await asyncio.gather(*(loop.run_in_executor(None, _node_status, info, timeout)
                                      for info in nodes.values()))
    by_name = dict(zip(nodes, statuses, strict=True))
    followers = (by_name.get(leader.name) or {}).get("followers", {}) if leader else {}
    out_nodes = []
    for name, info in sorted(nodes.items()):
        st = by_name[name] or {}
        f = followers.get(name, {})
        out_nodes.append({
            "name": name, "host": info.host, "amqp_port": info.amqp_port,
            "replication_port": info.replication_port, "http_port": info.http_port,
            "role": st.get("role", "unreachable"), "ready": st.get("ready"),
            "in_isr": name in (isr or []), "connected": f.get("connected"),
            "lag_bytes": f.get("lag_bytes"), "lag_seconds": f.get("lag_seconds"),
        })
    return {"leader": leader.name if leader else None, "isr": isr or [], "nodes": out_nodes}


def _fmt(value: Any, digits: int = 0) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.{digits or 2}f}"
    return str(value)


def render(state: dict) -> str:
    lines = [f"leader: {state['leader'] or '(none)'}", f"isr: {', '.join(state['isr']) or '(none)'}", ""]
    header = ("node", "role", "address", "amqp", "repl", "http", "ready", "in ISR", "lag bytes", "lag s")
    rows = [header]
    for n in state["nodes"]:
        rows.append((n["name"], n["role"], n["host"], str(n["amqp_port"]), str(n["replication_port"]),
                     str(n["http_port"]), _fmt(n["ready"]), _fmt(n["in_isr"]),
                     _fmt(n["lag_bytes"]), _fmt(n["lag_seconds"], 3)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    endpoints = [e.strip() for e in args.etcd_endpoints.split(",") if e.strip()]
    if not endpoints:
        _parser().error("--etcd-endpoints: no endpoint given")
    try:
        state = asyncio.run(gather(endpoints, args.etcd_prefix, args.timeout))
    except CoordinationError as exc:
        print(f"shardmq cluster: {exc} (--etcd-endpoints {args.etcd_endpoints})", file=sys.stderr)
        return 1
    print(json.dumps(state, indent=2) if args.json else render(state))
    return 0 if state["leader"] else 1
