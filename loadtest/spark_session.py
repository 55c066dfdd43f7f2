"""A quiet local SparkSession: the one builder the perf report and the data pipeline share.

Python workers run this interpreter (the venv), not whatever `python3` is on PATH; Spark's own
logging goes to stderr at ERROR only (a log4j2 file in the temp dir), so a report or a test run
is not buried in JVM warnings.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

_LOG4J2 = """\
rootLogger.level = error
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{HH:mm:ss} %p %c{1}: %m%n
"""


def quiet_session(master: str, app: str, conf: dict[str, str]) -> Any:
    """getOrCreate a SparkSession on `master` with `conf`, this interpreter for its workers, ERROR logs."""
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    log_conf = Path(tempfile.gettempdir()) / "shardmq-spark-log4j2.properties"
    if not log_conf.exists():
        log_conf.write_text(_LOG4J2)
    builder = SparkSession.builder.master(master).appName(app)
    for key, value in conf.items():
        builder = builder.config(key, value)
    builder = builder.config("spark.driver.extraJavaOptions", f"-Dlog4j2.configurationFile=file:{log_conf}")
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark
