"""The ``shardmq`` command: parse settings, set up logging, hand over to the node supervisor."""

from __future__ import annotations

import importlib
import sys

from broker.config import PROG, load_settings, setup_logging, tls_problem

# `shardmq SUBCOMMAND ...`: the module whose ``main(argv: list[str]) -> int`` runs it. A bare
# `shardmq [flags]` runs a node. Modules are imported only when their subcommand is used.
SUBCOMMANDS: dict[str, str] = {
    "cluster": "replication.cluster_cli",
    "verify": "shard.verify",  # shardmq verify DATA_DIR: check every stored record offline
}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in SUBCOMMANDS:
        module = importlib.import_module(SUBCOMMANDS[sys.argv[1]])
        sys.exit(module.main(sys.argv[2:]))
    settings = load_settings(sys.argv[1:])
    problem = tls_problem(settings)  # here, not in load_settings: it reads the certificate files
    if problem:
        print(f"{PROG}: error: {problem}", file=sys.stderr)
        sys.exit(2)
    setup_logging(settings.log_level, "node")
    # Imported late so `shardmq --help` and config errors do not pay for (or depend on) the node's imports.
    from broker.node import run

    sys.exit(run(settings))


if __name__ == "__main__":
    main()
