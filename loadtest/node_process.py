"""Start a ShardMQ node process for a benchmark or a drill (not the test harness's Node)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from pathlib import Path


def spawn_node(argv: Sequence[str], workdir: Path, root: Path) -> subprocess.Popen:
    """Run ``argv`` from the checkout at ``root`` in its own process group (so it can be signalled as a
    whole), with no inherited SHARDMQ_* settings, its output appended to workdir/node.log. Not in a
    session of its own: with autogroup scheduling a session is one CPU share, and a measured node in
    its own session competes as one group against the load generator (loadtest/bench.py BROKER_SPAWN)."""
    workdir.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDMQ_")}
    env["PYTHONPATH"] = str(root)
    with open(workdir / "node.log", "ab") as log:
        return subprocess.Popen(list(argv), cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, process_group=0)
