"""Default process counts: the cores a node may use (affinity, cgroup quota) and the rule on them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from broker import cpus
from broker.config import load_settings
from tests.harness import DEFAULT_COMMAND
from tests.mgmt_api import Api

ROOT = Path(__file__).resolve().parent.parent


def _tree(tmp_path: Path, files: dict[str, str], proc_cgroup: str) -> tuple[Path, Path]:
    root = tmp_path / "cgroup"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    pc = tmp_path / "proc-self-cgroup"
    pc.write_text(proc_cgroup)
    return root, pc


@pytest.mark.parametrize(("files", "proc_cgroup", "expected"), [
    ({"cpu.max": "max 100000\n"}, "0::/\n", None),  # cgroup v2, no limit
    ({"cpu.max": "150000 100000\n"}, "0::/\n", 1.5),  # docker --cpus 1.5
    ({"kubepods/pod1/cpu.max": "200000 100000\n", "cpu.max": "max 100000\n"}, "0::/kubepods/pod1\n", 2.0),
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, "1:cpu,cpuacct:/\n", None),  # v1
    ({"cpu/docker/abc/cpu.cfs_quota_us": "50000\n", "cpu/docker/abc/cpu.cfs_period_us": "100000\n"},
     "4:memory:/docker/abc\n1:cpu,cpuacct:/docker/abc\n", 0.5),
    ({}, "0::/\n", None),  # no cgroup CPU controller at all
])
def test_cgroup_cpu_limit(tmp_path: Path, files: dict[str, str], proc_cgroup: str, expected: float | None) -> None:
    root, pc = _tree(tmp_path, files, proc_cgroup)
    assert cpus.cgroup_cpu_limit(root, pc) == expected


def test_rule_for_1_2_4_8_cores() -> None:
    # measured on 1 and 2 cores, extrapolated to 4 and 8 (docs/benchmarks.md "Default process counts")
    got = {n: (cpus.default_frontends(n), cpus.default_shards(n)) for n in (1, 2, 4, 8)}
    assert got == {1: (1, 1), 2: (1, 1), 4: (2, 2), 8: (4, 4)}
    assert all(cpus.default_frontends(n) >= 1 and cpus.default_shards(n) >= 1 for n in range(1, 130))


def test_available_cpus_follows_the_affinity_of_the_process() -> None:
    assert cpus.available_cpus() <= len(os.sched_getaffinity(0))
    assert shutil.which("taskset"), "taskset (util-linux) is missing"
    code = ("import json; from broker import cpus; from broker.config import load_settings; "
            "s = load_settings([], {'SHARDMQ_DATA_DIR': '/nonexistent'}); "
            "print(json.dumps([cpus.available_cpus(), s.frontends, s.shards]))")
    out = subprocess.run(["taskset", "-c", "0", sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert json.loads(out.stdout) == [1, cpus.default_frontends(1), cpus.default_shards(1)]


def test_settings_default_to_the_rule_and_flags_still_win(tmp_path: Path) -> None:
    n = cpus.available_cpus()
    s = load_settings([], {"SHARDMQ_DATA_DIR": str(tmp_path)})
    assert (s.frontends, s.shards) == (cpus.default_frontends(n), cpus.default_shards(n))
    s = load_settings(["--frontends", "3"], {"SHARDMQ_DATA_DIR": str(tmp_path), "SHARDMQ_SHARDS": "5"})
    assert (s.frontends, s.shards) == (3, 5)


def test_management_api_reports_the_usable_cores_of_a_pinned_node(node_factory) -> None:
    # processors is what the node may use (the count its default process counts come from), not the
    # host's os.cpu_count(): a node pinned to one core reports 1 whatever the machine has.
    node = node_factory(name="pinned", frontends=1, shards=1, command=["taskset", "-c", "0", *DEFAULT_COMMAND])
    [entry] = Api(node.http_port).get("/api/nodes")
    assert entry["processors"] == 1
    assert Api(node.http_port).get(f"/api/nodes/{entry['name']}")["processors"] == 1
