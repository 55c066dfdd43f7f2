"""``shardmq-perf memory PID``: RSS, PSS and USS of each process of a broker's process tree, and their sums.

RSS counts every shared page (libpython, libcrypto, libzmq...) once per process that maps it, so
a sum of RSS over a node's five processes charges the machine five times for memory it holds
once; PSS divides each shared page among the processes mapping it (the sum is what the tree
costs); USS is the private pages (what the tree frees by exiting). From /proc/PID/smaps_rollup.
"""

from __future__ import annotations

import argparse
import json
import sys

from loadtest.results import process_tree

MIB = 1024 * 1024


def process_memory(pid: int) -> dict[str, int] | None:
    """{"rss", "pss", "uss"} in bytes of one process; None when it is gone."""
    out = {"rss": 0, "pss": 0, "uss": 0}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            lines = f.read().splitlines()[1:]
    except OSError:
        return None
    for line in lines:
        key, _, rest = line.partition(":")
        kib = rest.split()
        if not kib:
            continue
        if key == "Rss":
            out["rss"] += int(kib[0]) * 1024
        elif key == "Pss":
            out["pss"] += int(kib[0]) * 1024
        elif key in ("Private_Clean", "Private_Dirty"):
            out["uss"] += int(kib[0]) * 1024
    return out


def role(pid: int, root: int) -> str:
    """"node", "frontend-0", "shard-1", "pair-0" (frontend 0 and shard 0 in one process, --colocate) for
    a ShardMQ tree (from the command line), else the command."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")
    except OSError:
        return "?"
    for mod, name in (("frontend.main", "frontend"), ("shard.main", "shard"), ("shard.pair_main", "pair")):
        if mod in argv and "--index" in argv:
            return f"{name}-{argv[argv.index('--index') + 1]}"
    return "node" if pid == root else " ".join(argv)[:40]


def tree_memory(root: int) -> list[dict]:
    """One row per live process of ``root``'s tree, ``root`` first: pid, role, rss, pss, uss."""
    rows = []
    for pid in process_tree(root):
        mem = process_memory(pid)
        if mem is not None:
            rows.append({"pid": pid, "role": role(pid, root), **mem})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shardmq-perf memory", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("pid", type=int, help="the broker's pid (the ShardMQ node process)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    rows = tree_memory(args.pid)
    if not rows:
        print(f"shardmq-perf memory: no process {args.pid}", file=sys.stderr)
        return 1
    total = {k: sum(r[k] for r in rows) for k in ("rss", "pss", "uss")}
    if args.json:
        print(json.dumps({"processes": rows, "total": total}))
        return 0
    print(f"{'process':<12} {'pid':>8} {'RSS MiB':>9} {'PSS MiB':>9} {'USS MiB':>9}")
    for r in rows:
        print(f"{r['role']:<12} {r['pid']:>8} {r['rss'] / MIB:9.1f} {r['pss'] / MIB:9.1f} {r['uss'] / MIB:9.1f}")
    print(f"{'total':<12} {len(rows):>8} {total['rss'] / MIB:9.1f} {total['pss'] / MIB:9.1f} {total['uss'] / MIB:9.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
