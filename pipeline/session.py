"""A small local SparkSession with the formats registered (tests, the example CLI, the benchmark).

JVM start-up costs seconds: one process makes one session (`getOrCreate`) and shares it.
"""

from __future__ import annotations

import os
import sys
import tempfile
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

_LOG4J2 = """\
rootLogger.level = error
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{HH:mm:ss} %p %c{1}: %m%n
"""


def local_session(master: str = "local[2]", app: str = "shardmq-pipeline", **conf: str) -> Any:
    """getOrCreate a local session (UI off, small memory, quiet logs) and register the shardmq formats."""
    from pyspark.sql import SparkSession

    from pipeline import register

    # Python workers must run this interpreter (the venv) and import this checkout's packages.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if str(ROOT) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *[p for p in paths if p]])
    log_conf = Path(tempfile.gettempdir()) / "shardmq-pipeline-log4j2.properties"
    if not log_conf.exists():
        log_conf.write_text(_LOG4J2)
    builder = SparkSession.builder.master(master).appName(app)
    for key, value in {**CONF, **conf}.items():
        builder = builder.config(key, value)
    builder = builder.config("spark.driver.extraJavaOptions", f"-Dlog4j2.configurationFile=file:{log_conf}")
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    register(spark)
    return spark
