"""Shards report only the queue rows that changed (issue #11): the node's table stays right across
changes, deletions and a shard's kill -9, and an idle shard sends no rows after its first report."""

from __future__ import annotations

import urllib.request

import pika
import pytest
from prometheus_client.parser import text_string_to_metric_families

from broker.node_stats import NodeStats
from tests.mgmt_api import Api, q

pytestmark = pytest.mark.integration


def shard_metrics(node) -> dict[str, dict[str, float]]:
    """{metric name: {shard label: value}} of the per-shard STATS series."""
    with urllib.request.urlopen(f"http://127.0.0.1:{node.prometheus_port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, dict[str, float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith("shardmq_shard_") and "shard" in s.labels:
                out.setdefault(s.name, {})[s.labels["shard"]] = s.value
    return out


def wait_metrics(node, predicate, timeout: float = 15.0) -> dict:
    import time

    deadline = time.monotonic() + timeout
    while True:
        m = shard_metrics(node)
        if predicate(m):
            return m
        assert time.monotonic() < deadline, f"metrics never matched: {m}"
        time.sleep(0.05)


def by_name(items: list) -> dict[str, dict]:
    return {i["name"]: i for i in items}


def publish(node, counts: dict[str, int]) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(node.url))
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        for name, n in counts.items():
            for i in range(n):
                ch.basic_publish("", name, f"m{i}".encode(), pika.BasicProperties(delivery_mode=2))
    finally:
        conn.close()


def test_table_follows_changes_deletions_and_shard_restart(node_factory):
    node = node_factory(name="node", frontends=1, shards=2, extra_args=["--stats-interval", "100"])
    api = Api(node.http_port)
    names = [f"dq-{i:02d}" for i in range(12)]
    for name in names:
        api.put(f"/api/queues/%2F/{q(name)}", {"durable": True})
    want = {name: i % 4 for i, name in enumerate(names)}
    publish(node, want)

    def matches(expected: dict[str, int], key: str = "messages"):
        def check(items: list) -> bool:
            got = by_name(items)
            return set(got) == set(expected) and all(got[n].get(key) == v for n, v in expected.items())
        return check

    api.wait_for("/api/queues", matches(want))
    items = api.wait_for("/api/queues", lambda items: all(
        i.get("message_stats", {}).get("publish") == want[i["name"]] for i in items))
    # Idle again: every rate falls back to 0 (the rows stop changing, so no report carries them).
    api.wait_for("/api/queues", lambda items: all(
        i["message_stats"]["publish_details"]["rate"] == 0.0 for i in items))

    # Changes: get (with ack) from some queues, publish to others.
    conn = pika.BlockingConnection(pika.URLParameters(node.url))
    try:
        ch = conn.channel()
        for name in names[1:4]:
            method, _props, _body = ch.basic_get(name, auto_ack=True)
            assert method is not None
            want[name] -= 1
    finally:
        conn.close()
    publish(node, {names[0]: 2})
    want[names[0]] += 2
    api.wait_for("/api/queues", matches(want))
    items = api.get("/api/queues")
    assert by_name(items)[names[0]]["message_stats"]["publish"] == 2

    # Deletions: the node drops their rows (also from the paged listing's count).
    for name in names[:5]:
        api.delete(f"/api/queues/%2F/{q(name)}")
        del want[name]
    api.wait_for("/api/queues", matches(want))
    # The listing walks the definitions; the node's own table must drop the rows too.
    wait_metrics(node, lambda m: sum(m.get("shardmq_shard_queues", {}).values()) == len(want))
    page = api.get("/api/queues?page=1&page_size=100")
    assert page["total_count"] == len(want) and {i["name"] for i in page["items"]} == set(want)

    # A shard killed with -9 and restarted: its rows come back in full (durable messages recovered),
    # the other shard's rows never leave.
    old = node.kill_worker("shard", 0)
    node.wait_worker_restarted("shard", 0, old)
    wait_metrics(node, lambda m: sum(m.get("shardmq_shard_queues", {}).values()) == len(want))
    api.wait_for("/api/queues", matches(want))
    # A queue deleted after the restart leaves no row behind either.
    gone = sorted(want)[0]
    api.delete(f"/api/queues/%2F/{q(gone)}")
    del want[gone]
    api.wait_for("/api/queues", matches(want))
    wait_metrics(node, lambda m: sum(m.get("shardmq_shard_queues", {}).values()) == len(want))


def test_idle_shard_sends_no_rows_after_its_first_report(node_factory):
    node = node_factory(name="node", frontends=1, shards=1, extra_args=["--stats-interval", "100"])
    api = Api(node.http_port)
    n = 200
    for i in range(n):
        api.put(f"/api/queues/%2F/idle-{i:03d}", {"durable": True})
    m = wait_metrics(node, lambda m: m.get("shardmq_shard_queues", {}).get("0") == n)
    # Past the report that carried the last declare: take the counters once they stop moving.
    reports0 = m["shardmq_shard_stats_reports_total"]["0"]
    m = wait_metrics(node, lambda m: m["shardmq_shard_stats_reports_total"]["0"] >= reports0 + 2)
    rows0, reports1 = m["shardmq_shard_stats_rows_sent_total"]["0"], m["shardmq_shard_stats_reports_total"]["0"]
    assert n <= rows0 <= 2 * n  # every queue sent once (a declare between two reports: maybe twice)
    m = wait_metrics(node, lambda m: m["shardmq_shard_stats_reports_total"]["0"] >= reports1 + 5)
    assert m["shardmq_shard_stats_rows_sent_total"]["0"] == rows0, "an idle shard sent rows"

    # One message into one queue: exactly that one row is sent, once.
    publish(node, {"idle-007": 1})
    m = wait_metrics(node, lambda m: m["shardmq_shard_stats_rows_sent_total"]["0"] > rows0)
    reports2 = m["shardmq_shard_stats_reports_total"]["0"]
    m = wait_metrics(node, lambda m: m["shardmq_shard_stats_reports_total"]["0"] >= reports2 + 3)
    assert m["shardmq_shard_stats_rows_sent_total"]["0"] == rows0 + 1
    assert api.get("/api/queues/%2F/idle-007")["messages"] == 1


def test_seq_gap_asks_for_a_full_snapshot_and_full_replaces_the_table():
    st = NodeStats()
    row = ["/", "a", 1, 0, 0, 10, 1, 0, 0, 0, 0, 0, 0]
    assert st.update("shard", 0, {"seq": 1, "full": True, "queues": [row, ["/", "b", *row[2:]]], "removed": []}) is False
    assert st.update("shard", 0, {"seq": 2, "full": False, "queues": [], "removed": [["/", "b"]]}) is False
    assert set(st.queues()) == {("/", "a")}
    # seq 3 lost: the node must ask for every row
    assert st.update("shard", 0, {"seq": 4, "full": False, "queues": [["/", "c", *row[2:]]], "removed": []}) is True
    assert st.update("shard", 0, {"seq": 5, "full": False, "queues": [], "removed": []}) is False
    # the full snapshot drops what the shard no longer has ("a" went in the lost report)
    assert st.update("shard", 0, {"seq": 6, "full": True, "queues": [["/", "c", *row[2:]]], "removed": []}) is False
    assert set(st.queues()) == {("/", "c")}
    # a changed row shows its new counters; an unchanged one reads a rate of 0
    st.update("shard", 1, {"seq": 1, "full": True, "queues": [["/", "d", *row[2:]]], "removed": []})
    changed = ["/", "d", 0, 0, 0, 0, 11, 0, 0, 0, 0, 0, 0]
    st.update("shard", 1, {"seq": 2, "full": False, "queues": [changed], "removed": []})
    assert st.message_stats(st.queues()[("/", "d")])["publish"] == 11
    assert st.message_stats(st.queues()[("/", "c")])["publish_details"]["rate"] == 0.0
    st.forget("shard", 0)
    assert set(st.queues()) == {("/", "d")}


class _Q:
    """A queue as the stats' generic path reads it (info() and counters)."""

    def __init__(self, name: str, messages: int = 0) -> None:
        from types import SimpleNamespace

        self.vhost, self.name = "/", name
        self.messages = messages
        self.store = SimpleNamespace(ready_bytes=0, n_redelivered=0)
        self.unacked, self.consumers = {}, []
        self.n_published = self.n_delivered = self.n_acked = 0

    def info(self) -> dict:
        return {"messages": self.messages}


def _worker(*names: str):
    from types import SimpleNamespace

    from shard.stats import SyncHistogram

    return SimpleNamespace(queues={("/", n): _Q(n) for n in names}, sync_histogram=SyncHistogram(),
                           dead_letters=SimpleNamespace(pending={}))


def test_reporter_sends_changes_and_removals_and_full_on_request():
    from shard.stats import StatsReporter

    worker = _worker("a", "b")
    rep = StatsReporter()
    first = rep.report(worker)
    assert first["full"] and first["seq"] == 1 and len(first["queues"]) == 2
    assert rep.report(worker)["queues"] == []
    a = worker.queues[("/", "a")]
    a.messages = 3
    a.n_published = 3
    rep.touched.add(a)
    rep.touched.add(worker.queues[("/", "b")])  # touched but unchanged: no row
    second = rep.report(worker)
    assert [r[1] for r in second["queues"]] == ["a"] and second["removed"] == []
    assert second["totals"][0] == 3  # published, summed over the rows
    # one queue gone and one new in the same interval (same count): both are reported
    del worker.queues[("/", "b")]
    rep.gone(("/", "b"))
    worker.queues[("/", "c")] = c = _Q("c")
    c.n_published = 2
    rep.touched.add(c)
    third = rep.report(worker)
    assert [r[1] for r in third["queues"]] == ["c"] and third["removed"] == [["/", "b"]]
    assert third["totals"][0] == 5
    # a queue deleted and declared again under its name before the report: its row, not a removal
    worker.queues[("/", "a")] = a2 = _Q("a")
    rep.gone(("/", "a"))
    rep.touched.add(a2)
    fourth = rep.report(worker)
    assert [r[1] for r in fourth["queues"]] == ["a"] and fourth["removed"] == []
    assert fourth["totals"][0] == 2  # the old "a"'s publishes left the sums with it
    rep.full_next = True  # what QUERY "stats_full" sets
    full = rep.report(worker)
    assert full["full"] and sorted(r[1] for r in full["queues"]) == ["a", "c"] and full["removed"] == []
    assert full["rows_sent"] == 2 + 1 + 1 + 1 + 2 and full["seq"] == 6 and full["totals"][0] == 2


def test_reporter_reads_only_the_touched_queues_and_its_check_names_a_missed_change(caplog):
    from shard.stats import StatsReporter

    worker = _worker(*(f"q{i}" for i in range(1000)))
    rep = StatsReporter(check=True)
    rep.report(worker)
    reads = []
    for queue in worker.queues.values():  # count what a report reads
        queue.info = (lambda x=queue: reads.append(x.name) or {"messages": x.messages})
    q5 = worker.queues[("/", "q5")]
    q5.messages = 1
    pending = {q5}  # marked for the next delivery pass: read as touched
    with caplog.at_level("ERROR", logger="shardmq.shard"):
        out = rep.report(worker, pending)
        assert [r[1] for r in out["queues"]] == ["q5"]
        assert "stats check failed" not in caplog.text
        worker.queues[("/", "q7")].messages = 4  # changed, and nobody told the reporter
        out = rep.report(worker)
    assert out["queues"] == []
    assert "stats check failed" in caplog.text and "'q7'" in caplog.text
    # without the check, a report reads only the queues it was given
    rep.check = False
    reads.clear()
    rep.touched.add(q5)
    rep.report(worker)
    assert reads == ["q5"]


def _send_in_parts(rep, worker, st: NodeStats, index: int = 0, budget: int = 1000, between=None) -> list[dict]:
    """One report as the shard sends it (begin, then a part per loop turn), each part given to the node."""
    rep.begin(worker)
    parts = []
    while rep.busy:
        parts.append(rep.part(worker, budget=budget))
        assert st.update("shard", index, parts[-1]) is False
        if between is not None and rep.busy:
            between(parts)
    return parts


def test_a_report_of_many_queues_goes_in_parts_and_the_node_merges_them(caplog):
    from shard.stats import StatsReporter

    caplog.set_level("ERROR", logger="shardmq.shard")
    worker = _worker(*(f"q{i:04d}" for i in range(2500)))
    rep = StatsReporter(check=True)
    st = NodeStats()
    parts = _send_in_parts(rep, worker, st)
    # 2,500 queues, 1,000 a part (the test asks for 1,000): three parts of one seq, only the last with totals and no "more"
    assert [len(p["queues"]) for p in parts] == [1000, 1000, 500]
    assert [p.get("more", False) for p in parts] == [True, True, False]
    assert {p["seq"] for p in parts} == {1} and all(p["full"] for p in parts)
    assert "totals" not in parts[0] and parts[-1]["rows_sent"] == 2500
    assert len(st.queues()) == 2500 and st.seq[0] == 1
    # Deltas in parts: 1,500 deleted, 1,000 published to; while the parts go out, a queue whose part was
    # read changes again and another is deleted: the next report carries both, the check finds nothing.
    for i in range(1500):
        key = ("/", f"q{i:04d}")
        del worker.queues[key]
        rep.gone(key)
    for i in range(1500, 2500):
        q_ = worker.queues[("/", f"q{i:04d}")]
        q_.messages, q_.n_published = 1, 1
        rep.touched.add(q_)
    late: list[str] = []

    def meanwhile(parts: list[dict]) -> None:
        if len(parts) == 2:  # parts 1 and 2 were read: one of their queues changes, another goes
            name, gone_name = parts[1]["queues"][0][1], parts[1]["queues"][1][1]
            late.append(name)
            q_ = worker.queues[("/", name)]
            q_.messages, q_.n_published = 7, 7
            rep.touched.add(q_)
            del worker.queues[("/", gone_name)]
            rep.gone(("/", gone_name))
            late.append(gone_name)

    parts = _send_in_parts(rep, worker, st, between=meanwhile)
    assert len(parts) == 3 and all(p["seq"] == 2 and not p["full"] for p in parts)
    assert sum(len(p["removed"]) for p in parts) == 1500
    assert sum(len(p["queues"]) for p in parts) == 1000
    assert parts[-1]["totals"][0] == 1000
    rows = st.queues()
    assert len(rows) == 1000 and rows[("/", "q2000")][2] == 1
    assert st.message_stats(rows[("/", late[0])])["publish"] == 1
    last = rep.report(worker)  # small: one part, as before
    assert "more" not in last and [r[1] for r in last["queues"]] == [late[0]]
    assert last["removed"] == [["/", late[1]]] and last["totals"][0] == 1000 - 1 + 6
    assert st.update("shard", 0, last) is False
    assert len(st.queues()) == 999 and st.queues()[("/", late[0])][2] == 7
    assert "stats check failed" not in caplog.text


def test_a_full_report_in_parts_replaces_the_table_at_its_last_part_and_a_lost_last_part_asks_again():
    from shard.stats import StatsReporter

    worker = _worker(*(f"q{i:04d}" for i in range(2200)))
    rep = StatsReporter()
    st = NodeStats()
    st.update("shard", 0, {"seq": 1, "full": True, "queues": [["/", "old", *([0] * 11)]], "removed": []})
    rep.seq = 1
    rep.full_next = True
    seen = []
    _send_in_parts(rep, worker, st, between=lambda parts: seen.append(("/", "old") in st.queues()))
    assert seen == [True, True]  # a full report drops the rows it does not carry only at its end
    assert ("/", "old") not in st.queues() and len(st.queues()) == 2200
    # A shard that restarts in the middle of a report: its parts are dropped with it, its next report
    # (full, seq 1) replaces the table.
    rep2 = StatsReporter()
    rep2.seq = 9
    rep2.begin(worker)
    st.update("shard", 0, rep2.part(worker, budget=1000))
    fresh = StatsReporter()
    del worker.queues[("/", "q0000")]
    assert st.update("shard", 0, fresh.report(worker)) is False
    assert len(st.queues()) == 2199 and ("/", "q0000") not in st.queues()
