"""shardmq-perf bench: its scenario table against the perf tool's real parser, the private RabbitMQ
node's start/stop (for real, when rabbitmq-server is installed) and the benchmarks doc."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from loadtest import bench
from loadtest.rabbitmq import RABBITMQ_SERVER, PrivateRabbitMQ
from tests.harness import wait_until

pytestmark = pytest.mark.integration  # starts a private RabbitMQ and ShardMQ nodes


def _perf_parser():  # noqa: ANN202
    from loadtest import cli
    return cli.build_parser()


@pytest.mark.parametrize("scenario", bench.SCENARIOS, ids=lambda s: s.name)
def test_scenario_argv_is_accepted_by_the_perf_tool(scenario: bench.Scenario) -> None:
    parser = _perf_parser()
    for argv in filter(None, (scenario.argv, scenario.prefill)):
        cmd = bench.perf_command(bench.scenario_argv(scenario, argv, 12.0), "amqp://guest:guest@127.0.0.1:1/%2F")
        cmd += ["--json", "--results-dir", "/nonexistent", "--broker-name", "rabbitmq",
                "--scenario", scenario.name, "--broker-pid", "1"]
        assert cmd[1:4] == ["-m", "loadtest.cli", "amqp"]
        args = parser.parse_args(cmd[3:])  # exits (SystemExit) on an unknown or malformed flag
        assert args.command == argv[0]
        assert args.scenario == scenario.name
        if bench.DURATION in argv:
            assert args.time_s == 12.0
        else:
            assert args.time_s > 0 or args.command in ("queue-count", "connection-count")


def test_scenario_names_are_unique_and_match_the_brief() -> None:
    names = [s.name for s in bench.SCENARIOS]
    assert len(names) == len(set(names))
    assert {"1p1c-16b-transient-autoack", "publish-only-16b", "consume-only-drain-1m",
            "1p1c-1kib-persistent-confirm1000-ack-prefetch1000", "4p4c-16b-4queues", "fanout-4queues",
            "idle-connections-1000", "queues-10000", "queues-20000-durable", "queues-20000-transient",
            "bindings-per-second", "idle-connections-10000", "connection-churn", "delete-stall-30000"} < set(names)
    # the fixed-rate latency scenarios: 1k/10k/50k msg/s, each no-ack and with manual acks
    assert {f"latency-{k}k-{mode}" for k in (1, 10, 50) for mode in ("autoack", "ack")} < set(names)


def test_the_default_run_leaves_out_only_the_scenarios_marked_as_run_when_named() -> None:
    default = bench.build_parser().parse_args([]).scenarios.split(",")
    assert "delete-stall-100000" in bench.BY_NAME and "delete-stall-100000" not in default
    assert default == [s.name for s in bench.SCENARIOS if s.by_default]
    assert "delete-stall-30000" in default and "latency-1k-autoack" in default


def test_unknown_scenario_is_a_usage_error(tmp_path: Path) -> None:
    assert bench.main(["--scenarios", "nope", "--results-dir", str(tmp_path), "--doc", ""]) == 2


def test_doc_without_numbers_says_not_yet_measured() -> None:
    machine = bench.machine_info("3.10.8")
    assert machine["nproc"] == str(os.cpu_count())
    doc = bench.render_doc(machine, "shardmq-perf bench --repeats 3", None, None, [], None)
    assert "Not yet measured" in doc
    assert "shardmq-perf bench --repeats 3" in doc
    assert "| RabbitMQ | 3.10.8 |" in doc
    for s in bench.SCENARIOS:
        assert f"| {s.name} |" in doc
    failure = bench.RunOutcome("queues-10000", "shardmq", 2, False, 1.0, "exit 3 | refused")
    doc = bench.render_doc(machine, "x", "| table |\n", "now", [failure], "/r")
    assert "Not yet measured" not in doc
    assert "| table |" in doc
    assert "| queues-10000 | shardmq | 2 | exit 3 / refused |" in doc


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is gone for our purposes
    return "Z" not in Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0]


def test_private_rabbitmq_starts_on_loopback_and_stops_by_pid() -> None:
    # scripts/test.sh installs rabbitmq-server: a missing one fails here instead of skipping.
    assert os.path.exists(RABBITMQ_SERVER), "rabbitmq-server is not installed"
    import pika
    node = PrivateRabbitMQ(start_timeout=90)
    try:
        node.start()
        assert node.pid is not None
        assert Path(f"/proc/{node.pid}/comm").read_text().startswith("beam")
        assert node.server_version
        conn = pika.BlockingConnection(pika.URLParameters(node.url))
        ch = conn.channel()
        ch.queue_declare("bench-smoke")
        ch.basic_publish("", "bench-smoke", b"hello")
        method, _, body = next(ch.consume("bench-smoke", auto_ack=True, inactivity_timeout=10))
        assert body == b"hello"
        conn.close()
        beam, epmd, data = node.pid, node._epmd.pid, node.dir
        assert str(data) in Path(f"/proc/{beam}/environ").read_bytes().decode(errors="replace")
    finally:
        node.stop()
    assert not _alive(beam)
    assert not _alive(epmd)
    assert not data.exists()


def test_sigterm_during_a_run_still_stops_the_broker(tmp_path: Path) -> None:
    assert os.path.exists(RABBITMQ_SERVER), "rabbitmq-server is not installed"
    err = open(tmp_path / "bench.err", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "loadtest.bench", "--brokers", "rabbitmq", "--scenarios", "bindings-per-second",
         "--repeats", "1", "--duration", "60", "--results-dir", str(tmp_path / "r"), "--doc", ""],
        cwd=bench.ROOT, stdout=subprocess.DEVNULL, stderr=err)
    beam = None
    try:
        deadline = time.monotonic() + 90
        while beam is None and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
            m = re.search(r"rabbitmq up at \S+ \(pid (\d+)", (tmp_path / "bench.err").read_text())
            beam = int(m[1]) if m else None
        assert beam is not None, (tmp_path / "bench.err").read_text()
        wait_until(lambda: any(ppid == proc.pid and "loadtest.cli amqp" in cmd
                               for ppid, _state, cmd in _process_table().values()), 60, "the perf run to start")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 1  # no run finished
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        err.close()
    assert not _alive(beam)


def test_rewriting_the_doc_keeps_the_hand_written_tail() -> None:
    old = "# old page\n| stale table |\n" + bench.KEEP_MARKER + "\n## Memory\nmeasured by hand\n"
    assert bench.kept_tail(old) == bench.KEEP_MARKER + "\n## Memory\nmeasured by hand\n"
    assert bench.kept_tail("# a page without the marker\n") == ""


def _process_table() -> dict[int, tuple[int, str, str]]:
    """pid -> (parent pid, state letter, command line) of every process, from /proc."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # exited while we looked
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        table[int(entry)] = (int(ppid), state, cmdline)
    return table


def _broker_trees(root: int) -> dict[str, list[tuple[int, str]]]:
    """The live processes under ``root`` by role: each perf run's ("perf:<broker>"), the ShardMQ node and
    its workers ("shardmq"), RabbitMQ's server, VM, helpers and epmd ("rabbitmq"); zombies left out."""
    table = _process_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)

    def tree(pid: int) -> list[int]:
        out, todo = [], [pid]
        while todo:
            p = todo.pop()
            out.append(p)
            todo += children.get(p, [])
        return out

    roles: dict[str, list[tuple[int, str]]] = {}
    for child in children.get(root, []):
        cmd = table[child][2]
        m = re.search(r"loadtest\.cli amqp .*--broker-name (\S+)", cmd)
        role = f"perf:{m[1]}" if m else "shardmq" if "broker.cli" in cmd else "rabbitmq" if (
            "rabbitmq" in cmd or "epmd" in cmd or "beam" in cmd) else None
        if role is not None:
            roles.setdefault(role, []).extend(
                (p, table[p][1]) for p in tree(child) if p in table and table[p][1] != "Z")
    return roles


def test_only_the_measured_broker_runs_during_a_measurement(tmp_path: Path) -> None:
    # The bench alternates brokers; while one is measured the other must not exist at all (an idle
    # broker still takes CPU on a small host). A thread samples this process's children from /proc
    # while the bench runs one round of each broker here, in the main thread (it installs a signal handler).
    assert os.path.exists(RABBITMQ_SERVER), "rabbitmq-server is not installed"
    import threading

    samples: list[dict[str, list[tuple[int, str]]]] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            samples.append(_broker_trees(os.getpid()))
            done.wait(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    args = bench.build_parser().parse_args(["--duration", "2", "--repeats", "1"])
    previous = signal.getsignal(signal.SIGTERM)
    sampler.start()
    try:
        outcomes, version = bench._run_all(args, ["bindings-per-second"], ["shardmq", "rabbitmq"], tmp_path)
    finally:
        done.set()
        sampler.join()
        signal.signal(signal.SIGTERM, previous)
    assert [(o.broker, o.ok) for o in outcomes] == [("shardmq", True), ("rabbitmq", True)], outcomes
    assert version
    measured = {"shardmq": 0, "rabbitmq": 0}
    for roles in samples:
        assert not ("shardmq" in roles and "rabbitmq" in roles), roles  # never both brokers at once
        for name in measured:
            if f"perf:{name}" in roles:
                other = "rabbitmq" if name == "shardmq" else "shardmq"
                assert other not in roles, roles
                assert roles.get(name), roles  # the measured broker itself is there, and not stopped
                assert all(state != "T" for _, state in roles[name]), roles
                measured[name] += 1
    assert all(measured.values()), measured  # both measurements were seen (each ran >= 2 s)
    assert not _broker_trees(os.getpid()), "a broker outlived the bench"


def test_each_run_records_its_invocation_and_a_results_dir_with_other_runs_needs_append(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Every run directory carries what the page needs (RUN_RECORD: the bench's command and commit, the
    run's start, end and load); a bench into a --results-dir holding another invocation's runs is
    refused unless --append, and then reports this invocation's runs only; --from-results renders one
    invocation. The Spark report itself is tested in test_bench_doc: here it records which runs it got."""
    from loadtest.results import list_runs

    results = tmp_path / "r"
    reported: list[set[str]] = []

    def report(source: Path, out: Path, master: str) -> int:
        reported.append({p.name for p in list_runs(source)})
        return 1  # no table: the page is not written (--doc '' anyway)

    monkeypatch.setattr(bench, "report", report)
    argv = ["--brokers", "shardmq", "--scenarios", "bindings-per-second", "--repeats", "1", "--duration", "1",
            "--results-dir", str(results), "--doc", ""]
    previous = signal.getsignal(signal.SIGTERM)
    try:
        assert bench.main(argv) == 0, capsys.readouterr().err
        (first,) = list_runs(results)
        record = json.loads((first / bench.RUN_RECORD).read_text())
        assert record["command"] == "shardmq-perf bench " + shlex.join(argv)
        assert record["commit"] == bench._git_commit() and record["broker"] == "shardmq" and record["repeat"] == 1
        started, ended = (datetime.fromisoformat(record[k]) for k in ("started_at", "ended_at"))
        assert (ended - started).total_seconds() >= 1.0  # the 1 s run lies between them
        assert isinstance(record["load1_start"], float) and isinstance(record["load1_end"], float)
        assert reported == [{first.name}]

        # Again into the same directory: refused before anything runs, naming the flag and the runs there.
        capsys.readouterr()
        assert bench.main(argv) == 2
        err = capsys.readouterr().err
        assert "--results-dir" in err and "--append" in err and record["invocation"] in err
        assert list_runs(results) == [first] and len(reported) == 1

        assert bench.main([*argv, "--append"]) == 0
        (second,) = set(list_runs(results)) - {first}
        again = json.loads((second / bench.RUN_RECORD).read_text())
        assert again["invocation"] != record["invocation"] and again["command"].endswith("--append")
        assert reported[-1] == {second.name}  # this invocation's run only

        # --from-results renders one invocation: the choice is the caller's when there are several.
        capsys.readouterr()
        assert bench.main(["--from-results", str(results), "--doc", ""]) == 2
        err = capsys.readouterr().err
        assert "--invocation" in err and record["invocation"] in err and again["invocation"] in err
        assert bench.main(["--from-results", str(results), "--invocation", "nope", "--doc", ""]) == 2
        assert bench.main(["--from-results", str(results), "--invocation", record["invocation"], "--doc", ""]) == 1
        assert reported[-1] == {first.name}
        (old,) = [g for g in bench.invocations(results) if g.id == record["invocation"]]
        assert old.info["command"] == record["command"] and old.info["commit"] == record["commit"]
        assert old.info["load1"] == [record["load1_start"], record["load1_start"]]
        assert old.info["when"] == f"{started:%Y-%m-%d %H:%M}–{ended:%H:%M} UTC" or started.date() != ended.date()
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_run_ends_once_the_node_has_removed_its_deleted_queues_directories(tmp_path: Path) -> None:
    """The shard's reaper removes a deleted queue's directory after the delete-ok: a declare scenario's
    run (declare, then delete) ends only when the node's data dir holds none of them any more, so that
    removal does not overlap the next run; the run's record says how long that took."""
    import shutil
    import threading

    from loadtest.results import list_runs

    node = bench.ShardMQNode([]).start()
    try:
        s = bench.Scenario("declare-delete", ("queue-count", "--count", "1500", "--durable", "--time", "60"), "test")
        outcome = bench.run_one(s, node, 1, tmp_path, 1.0, tmp_path / "bench.log", {"invocation": "t"})
        assert outcome.ok, outcome.detail
        assert node.queue_dirs() == (0, 0)  # right after the run: nothing of the 1,500 queues on disk
        (run,) = list_runs(tmp_path)
        record = json.loads((run / bench.RUN_RECORD).read_text())
        assert record["reaped"] is True and record["queues"] == 0 and record["settle_s"] >= 0, record

        # A queue the node still has keeps its directory: settled all the same.
        import pika
        with pika.BlockingConnection(pika.URLParameters(node.url)) as conn:
            conn.channel().queue_declare("kept", durable=True)
        assert node.queue_dirs() == (1, 0)
        assert node.settle(timeout=30)["reaped"]
        # A trash directory is waited for until it is gone; one that stays ends the wait at the timeout.
        vhost_dir = next(p for p in (node.dir / "data").iterdir() if bench._is_sha1(p.name))
        trash = vhost_dir / "deleted-test-0"
        trash.mkdir()
        (trash / "segment").write_bytes(b"x")
        stuck = node.settle(timeout=0.3)
        assert not stuck["reaped"] and (stuck["trash_dirs"], stuck["queue_dirs"]) == (1, 1) and stuck["settle_s"] >= 0.3
        removed_at: list[float] = []

        def remove() -> None:
            time.sleep(0.5)
            shutil.rmtree(trash)
            removed_at.append(time.monotonic())

        remover = threading.Thread(target=remove)
        remover.start()
        settled = node.settle(timeout=30)
        returned_at = time.monotonic()
        remover.join()
        assert settled["reaped"] and settled["trash_dirs"] == 0 and removed_at[0] <= returned_at, settled
    finally:
        node.stop()
