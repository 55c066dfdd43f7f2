"""ShardMQ's version, as the AMQP server properties and the management API report it.

A constant, not ``importlib.metadata.version("shardmq")``: that import (with email, zipfile, csv)
and its scan of site-packages cost every frontend ~1 MB. tests/test_version.py checks it matches
pyproject.toml.
"""

__version__ = "0.1.0"
