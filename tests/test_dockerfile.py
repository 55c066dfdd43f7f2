"""deploy/Dockerfile against the package it packs. No container engine is available here (the image
is built by any OCI builder elsewhere), so the test checks what can go stale: the wheel builds from
exactly what the Dockerfile copies, the entrypoint is the package's console script, the exposed
ports are the listeners' defaults, the environment names settings that exist, the user and volume
agree with the chart, and the HEALTHCHECK command itself answers right against a real node."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
import yaml

from broker.config import Settings
from tests.design_names import DESIGN_DEFAULT_PORTS, known_env, unknown_names

REPO = Path(__file__).resolve().parent.parent
DOCKERFILE = REPO / "deploy" / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def stages() -> list[list[tuple[str, str]]]:
    result: list[list[tuple[str, str]]] = []
    for ins in instructions():
        if ins[0] == "FROM":
            result.append([])
        result[-1].append(ins)
    return result


def args_of(word: str, stage: list[tuple[str, str]] | None = None) -> list[str]:
    return [rest for w, rest in (stage if stage is not None else instructions()) if w == word]


def test_debian12_python311_base_in_every_stage():
    assert [s[0][1].split()[0] for s in stages()] == ["python:3.11-slim-bookworm"] * 2


def test_build_stage_copies_every_package_the_wheel_includes():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    packages = [p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]]
    copied = {shlex.split(rest)[0] for rest in args_of("COPY", stages()[0])}
    missing = [p for p in packages if (REPO / p).is_dir() and p not in copied]
    assert missing == [], f"deploy/Dockerfile does not COPY {missing} into the build stage"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    # The build context as the Dockerfile sees it: only what its build stage copies.
    src = tmp_path_factory.mktemp("context")
    for rest in args_of("COPY", stages()[0]):
        *sources, _dest = shlex.split(rest)
        for name in sources:
            path = REPO / name
            if path.is_dir():
                shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy(path, src / name)
    out = tmp_path_factory.mktemp("wheels")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "--disable-pip-version-check",
                           "-w", str(out), "."], cwd=src, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (built,) = out.glob("shardmq-*.whl")
    return built


def test_wheel_builds_with_the_entrypoint_and_the_node(wheel):
    with zipfile.ZipFile(wheel) as whl:
        names = set(whl.namelist())
        entry_points = next(whl.read(n).decode() for n in names if n.endswith("entry_points.txt"))
    entrypoint = yaml.safe_load(args_of("ENTRYPOINT")[-1])
    script = Path(entrypoint[0])
    assert script.parent == Path("/opt/shardmq/venv/bin")
    assert f"{script.name} = broker.cli:main" in entry_points.splitlines()
    assert {"broker/cli.py", "broker/node.py", "broker/sdnotify.py", "broker/http/health.py"} <= names
    # The build stage installs exactly this wheel into the venv the entrypoint lives in.
    assert any("shardmq-*.whl" in run and "/opt/shardmq/venv/bin/pip install" in run for run in args_of("RUN"))


def test_exposed_ports_are_the_listener_defaults():
    exposed = {int(p) for rest in args_of("EXPOSE") for p in rest.split()}
    assert exposed == set(DESIGN_DEFAULT_PORTS.values())
    # The ones built already are the node's own defaults.
    assert {Settings.port, Settings.http_port} <= exposed


def test_environment_user_and_volume_agree_with_the_node_and_the_chart():
    env = dict(item.split("=", 1) for rest in args_of("ENV", stages()[-1]) for item in shlex.split(rest))
    shardmq_env = {k for k in env if k.startswith("SHARDMQ_")}
    assert shardmq_env and shardmq_env <= known_env()
    assert unknown_names(env=shardmq_env) == []
    assert env["SHARDMQ_DATA_DIR"] == "/var/lib/shardmq"
    assert yaml.safe_load(args_of("VOLUME")[-1]) == [env["SHARDMQ_DATA_DIR"]]
    # Created 0700, the mode the node requires of its data dir (broker/datadir.py).
    made = re.findall(r"install -d (?:-[og] \S+ )*-m (\d+) " + re.escape(env["SHARDMQ_DATA_DIR"]) + r"\b",
                      " ".join(args_of("RUN", stages()[-1])))
    assert made == ["0700"], made
    user = args_of("USER")[-1]
    values = yaml.safe_load((REPO / "helm" / "shardmq" / "values.yaml").read_text())
    uid = values["podSecurityContext"]["runAsUser"]
    assert user == f"{uid}:{values['podSecurityContext']['runAsGroup']}" and uid != 0


@pytest.mark.integration
def test_healthcheck_command_answers_for_a_real_node(node_factory):
    healthcheck = args_of("HEALTHCHECK")[-1]
    assert "/api/health/checks/ready" in healthcheck
    command = shlex.split(healthcheck[healthcheck.index("CMD ") + 4:])
    assert command[0] == "python"
    command[0] = sys.executable
    node = node_factory(frontends=1, shards=1)
    env = {"SHARDMQ_HTTP_PORT": str(node.http_port), "PATH": "/usr/bin:/bin"}
    assert subprocess.run(command, env=env, capture_output=True, timeout=30).returncode == 0
    node.stop()
    assert subprocess.run(command, env=env, capture_output=True, timeout=30).returncode != 0
