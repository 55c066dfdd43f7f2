"""Log format and setup of every ShardMQ process (node, frontends, shards).

Its own module so a worker sets up logging without importing ``broker.config`` (the option table,
argparse and configparser: ~2 MB of a worker's memory it never uses).
"""

from __future__ import annotations

import logging

LOG_FORMAT = "%(asctime)s %(levelname)s [%(processName)s] %(name)s: %(message)s"


def setup_logging(level: str | int, role: str) -> None:
    """Configure the root logger of this process; ``role`` ("node", "frontend-0", "shard-3") shows in every line.

    Workers are started as fresh interpreters, so processName would say "MainProcess"
    everywhere; the role is written into the format instead (naming the process through
    ``multiprocessing`` would import it only for that).
    """
    if isinstance(level, str):
        level = logging.getLevelName(level.upper())
    fmt = LOG_FORMAT.replace("%(processName)s", role.replace("%", "%%"))
    logging.basicConfig(format=fmt, level=level, force=True)
