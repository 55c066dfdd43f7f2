"""Headless Chromium (Debian's chromium + chromedriver, driven by selenium) with MQTT.js from npm.

MQTT.js (``mqtt`` on npm, its browser bundle ``dist/mqtt.min.js``) is installed once into a cache
dir on first use, as the Node.js client tests do; a missing chromium, chromedriver or npm fails
the test that needs it, it is never skipped (scripts/test.sh installs them).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
from pathlib import Path

MQTTJS_VERSION = "5.16.0"
NPM_TIMEOUT = 180.0


def _cache_root() -> Path:
    base = os.environ.get("SHARDMQ_TEST_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "shardmq-tests")
    return Path(base)


def mqttjs_bundle() -> Path:
    """Path of MQTT.js's browser bundle (npm install on first use)."""
    if shutil.which("npm") is None:
        raise AssertionError("npm is not installed (scripts/test.sh installs it)")
    prefix = _cache_root() / f"mqttjs-{MQTTJS_VERSION}"
    prefix.mkdir(parents=True, exist_ok=True)
    package = prefix / "node_modules" / "mqtt" / "package.json"
    with open(prefix / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent test runs install it once
        if not package.exists():
            subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--no-save", "--prefix", str(prefix),
                            f"mqtt@{MQTTJS_VERSION}"], check=True, capture_output=True, timeout=NPM_TIMEOUT)
    if json.loads(package.read_text())["version"] != MQTTJS_VERSION:
        raise AssertionError(f"{package} is not mqtt {MQTTJS_VERSION}")
    return prefix / "node_modules" / "mqtt" / "dist" / "mqtt.min.js"


def headless_chromium():
    """A selenium WebDriver for headless Chromium."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    for tool in ("chromium", "chromedriver"):
        if shutil.which(tool) is None:
            raise AssertionError(f"{tool} is not installed (scripts/test.sh installs chromium, chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
