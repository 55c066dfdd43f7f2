"""Start a ShardMQ node process for a benchmark or a drill (not the test harness's Node)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from pathlib import Path


def spawn_node(argv: Sequence[str], workdir: Path, root: Path) -> subprocess.Popen:
    """Run ``argv`` from the checkout at ``root`` in its own session (so its whole process group can
    be signalled), with no inherited SHARDMQ_* settings, its output appended to workdir/node.log."""
    workdir.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDMQ_")}
    env["PYTHONPATH"] = str(root)
    with open(workdir / "node.log", "ab") as log:
        return subprocess.Popen(list(argv), cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
