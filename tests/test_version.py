"""broker/version.py says what pyproject.toml says."""

from __future__ import annotations

import tomllib
from pathlib import Path

from broker.version import __version__


def test_version_matches_pyproject():
    pyproject = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())
    assert __version__ == pyproject["project"]["version"]
