"""Node.js AMQP clients for tests: amqplib, installed once with npm into a cache dir.

The scripts the tests run live in ``tests/js/``; each prints one JSON line as its result.
``scripts/test.sh`` installs node and npm (Debian's nodejs, npm) when they are missing; a
missing node or npm fails the test that needs it, it is never skipped.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
from pathlib import Path

AMQPLIB_VERSION = "0.10.9"
JS_DIR = Path(__file__).resolve().parent / "js"
NPM_TIMEOUT = 180.0


def _cache_root() -> Path:
    base = os.environ.get("SHARDMQ_TEST_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "shardmq-tests")
    return Path(base)


def amqplib_prefix() -> Path:
    """A directory whose node_modules holds amqplib AMQPLIB_VERSION (npm install on first use)."""
    for tool in ("node", "npm"):
        if shutil.which(tool) is None:
            raise AssertionError(f"{tool} is not installed (scripts/test.sh installs nodejs and npm)")
    prefix = _cache_root() / f"amqplib-{AMQPLIB_VERSION}"
    prefix.mkdir(parents=True, exist_ok=True)
    marker = prefix / "node_modules" / "amqplib" / "package.json"
    with open(prefix / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two test runs at once install it once
        if not marker.exists():
            subprocess.run(
                ["npm", "install", "--no-audit", "--no-fund", "--no-save", "--prefix", str(prefix),
                 f"amqplib@{AMQPLIB_VERSION}"],
                check=True, capture_output=True, timeout=NPM_TIMEOUT)
    if json.loads(marker.read_text())["version"] != AMQPLIB_VERSION:
        raise AssertionError(f"{marker} is not amqplib {AMQPLIB_VERSION}")
    return prefix


def run_amqplib(script: str, *args: str, timeout: float = 30.0) -> dict:
    """Run tests/js/<script> with amqplib on NODE_PATH; its last stdout line, parsed as JSON."""
    prefix = amqplib_prefix()
    env = dict(os.environ, NODE_PATH=str(prefix / "node_modules"))
    proc = subprocess.run(["node", str(JS_DIR / script), *args], env=env, capture_output=True, text=True,
                          timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise AssertionError(f"{script} printed no result (exit {proc.returncode})\n"
                             f"stdout: {proc.stdout}\nstderr: {proc.stderr}")
    result = json.loads(lines[-1])
    result["_exit"] = proc.returncode
    result["_stdout"] = proc.stdout
    return result
