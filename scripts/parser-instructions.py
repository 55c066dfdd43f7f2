#!/usr/bin/env python3
"""Instructions the AMQP parser spends per publish, counted by valgrind (load-independent).

    scripts/parser-instructions.py [TREE ...]     (default: this tree)

For each TREE (a source tree: its broker/ is imported) and each workload, runs
`valgrind --tool=cachegrind --cache-sim=no` on a Python process that feeds a server-role
FrameParser(publish_runs=True) READS reads of PUBLISHES 16 B publishes on one channel, once with
READS=1 and once with READS=1+FEEDS; the difference in instructions over FEEDS*PUBLISHES is the
cost of one publish (start-up, imports and the first read cancel out). Workloads:
  same        one exchange and routing key (every read is one run)
  new-key     a new routing key on each publish (PUBLISHES keys of one length, the last byte the
              same, so the run probe's two byte tests pass and only its compare tells them apart)
  alternate   two keys of one length taking turns (a run never forms)
  blocks      runs of 8 publishes with one key, then 8 with the next (PUBLISHES keys)
  lone        one key, each publish a read of its own (a low rate: no run can form)
The parser is fed the same bytes objects each time; the events are dropped.
Environment: WORKLOADS=same,new-key picks workloads; PARSER_RUNS=0 measures the parser without runs
(publish_runs=False), the floor a publish that never joins a run should stay at.
"""

import os
import re
import subprocess
import sys
import tempfile

PUBLISHES = 2200
FEEDS = 10
WORKLOADS = tuple(os.environ.get("WORKLOADS", "same,new-key,alternate,blocks,lone").split(","))


def keys(workload: str) -> list[str]:
    if workload in ("same", "lone"):
        return ["perf-test"] * PUBLISHES
    if workload == "new-key":
        return [f"dev.{i:05d}.t" for i in range(PUBLISHES)]
    if workload == "alternate":
        return [("dev.00001.t", "dev.00002.t")[i % 2] for i in range(PUBLISHES)]
    return [f"dev.{i // 8:05d}.t" for i in range(PUBLISHES)]


def inner(workload: str, times: int) -> None:
    from broker.amqp import encoder
    from broker.amqp.constants import PROTOCOL_HEADER
    from broker.amqp.parser import FrameParser

    publishes = [encoder.encode_publish(1, "ex", k, False, b"\x10\x00\x01", bytes(16)) for k in keys(workload)]
    reads = publishes if workload == "lone" else [b"".join(publishes)]
    try:
        parser = FrameParser("server", publish_runs=os.environ.get("PARSER_RUNS", "1") == "1")
    except TypeError:  # a tree from before publish runs
        parser = FrameParser("server")
    parser.feed(PROTOCOL_HEADER)
    feed = parser.feed
    for _ in range(times):
        for data in reads:
            feed(data)
    if parser.dead:
        raise SystemExit("parser failed")


def instructions(tree: str, workload: str, reads: int) -> int:
    with tempfile.NamedTemporaryFile(suffix=".cg") as out:
        env = dict(os.environ, PYTHONPATH=tree, PYTHONHASHSEED="0")
        proc = subprocess.run(["valgrind", "--tool=cachegrind", "--cache-sim=no", f"--cachegrind-out-file={out.name}",
                               sys.executable, os.path.abspath(__file__), "--inner", workload, str(reads)],
                              env=env, capture_output=True, text=True, cwd=tree)
        match = re.search(r"I\s+refs:\s+([\d,]+)", proc.stderr)
        if proc.returncode or not match:
            raise SystemExit(f"valgrind failed for {tree} {workload}:\n{proc.stderr[-2000:]}")
        return int(match.group(1).replace(",", ""))


def main() -> None:
    if sys.argv[1:2] == ["--inner"]:
        return inner(sys.argv[2], int(sys.argv[3]))
    trees = [os.path.abspath(t) for t in sys.argv[1:]] or [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
    for tree in trees:
        for workload in WORKLOADS:
            base = instructions(tree, workload, 1)
            more = instructions(tree, workload, 1 + FEEDS)
            print(f"{tree} {workload:9s} {(more - base) / (FEEDS * PUBLISHES):9,.0f} instructions per publish",
                  flush=True)


if __name__ == "__main__":
    main()
