"""A small local SparkSession with the formats registered (tests, the example CLI, the benchmark).

JVM start-up costs seconds: one process makes one session (`getOrCreate`) and shares it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

CONF = {
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.driver.memory": "768m",
    "spark.driver.host": "127.0.0.1",
    "spark.driver.bindAddress": "127.0.0.1",
    "spark.sql.shuffle.partitions": "2",
    "spark.sql.session.timeZone": "UTC",
    "spark.python.worker.reuse": "true",
}


def local_session(master: str = "local[2]", app: str = "shardmq-pipeline", **conf: str) -> Any:
    """getOrCreate a local session (UI off, small memory, quiet logs) and register the shardmq formats."""
    from loadtest.spark_session import quiet_session
    from pipeline import register

    # Python workers must import this checkout's packages.
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if str(ROOT) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *[p for p in paths if p]])
    spark = quiet_session(master, app, {**CONF, **conf})
    register(spark)
    return spark
