"""Queue placement (--queue-placement balanced, the default): the shard with the fewest queues of the
vhost, recorded in the queue's definition and kept across restarts, shard-count changes and
definitions export/import.

The queue names are chosen so that crc32(vhost, name) % 2 puts three of four on one shard: placement
by name alone fails these tests.
"""
from __future__ import annotations

import collections

import pika

from broker.definitions import Definitions, queue_shard
from broker.definitions.rabbit_format import plan_import
from tests.mgmt_api import Api, q
from tests.test_recovery import drain, publish_confirmed

V = "/"


def skewed_names(prefix: str, shards: int = 2, count: int = 4) -> list[str]:
    """count names of which all but one hash to shard 0 of `shards`."""
    on0 = [n for n in (f"{prefix}{i}" for i in range(200)) if queue_shard(V, n, shards) == 0][:count - 1]
    other = next(n for n in (f"{prefix}x{i}" for i in range(200)) if queue_shard(V, n, shards) != 0)
    return [*on0, other]


def declare(d: Definitions, name: str, shards: int, vhost: str = V) -> int:
    ops, _ = d.plan_queue_declare(vhost, name, False, True, False, False, {}, None, shards)
    d.apply_all(ops)
    return d.queue(vhost, name).shard


def recount(d: Definitions) -> dict[int, int]:
    counts = collections.Counter(qu.shard for v in d.vhosts.values() for qu in v.queues.values())
    return {s: n for s, n in counts.items() if n}


def live(counts: dict[int, int]) -> dict[int, int]:
    return {s: n for s, n in counts.items() if n}


# ------------------------------------------------------------------ the model
def test_four_queues_on_two_shards_are_two_and_two():
    names = skewed_names("q")
    assert collections.Counter(queue_shard(V, n, 2) for n in names) == {0: 3, 1: 1}
    d = Definitions()
    assert collections.Counter(declare(d, n, 2) for n in names) == {0: 2, 1: 2}
    hashed = Definitions()
    hashed.placement = "hash"
    assert [declare(hashed, n, 2) for n in names] == [queue_shard(V, n, 2) for n in names]


def test_balance_is_per_vhost_then_per_node():
    d = Definitions()
    d.apply(["vhost.put", "other"])
    assert [declare(d, n, 2, "other") for n in skewed_names("o", count=3)[:3]].count(0) == 2  # other: 2 + 1
    # "/" is empty: its first queue goes to the shard with fewer queues on the node, whatever its name.
    crowded = max((0, 1), key=lambda s: d.shard_queues.get(s, 0))
    name = next(n for n in (f"f{i}" for i in range(100)) if queue_shard(V, n, 2) == crowded)
    assert declare(d, name, 2) == 1 - crowded


def test_counts_follow_deletes_redeclares_moves_and_vhost_deletes():
    d = Definitions()
    d.apply(["vhost.put", "gone"])
    for i in range(7):
        declare(d, f"a{i}", 3)
        declare(d, f"g{i}", 3, "gone")
    declare(d, "a1", 3)  # redeclare: no second count
    d.apply(["queue.declare", V, "a2", {"durable": True, "shard": 2}])  # a replace with another shard
    d.apply(["queue.delete", V, "a3"])
    d.apply(["queue.shard", V, "a4", 0])
    assert live(d.shard_queues) == recount(d)
    assert live(d.vhosts[V].shard_queues) == collections.Counter(qu.shard for qu in d.vhosts[V].queues.values())
    d.apply(["vhost.delete", "gone"])
    assert live(d.shard_queues) == recount(d)
    # The next declare fills the emptiest shard of the vhost.
    fewest = min(range(3), key=lambda s: (d.vhosts[V].shard_queues.get(s, 0), d.shard_queues.get(s, 0)))
    assert declare(d, "next", 3) == fewest


def test_snapshot_round_trip_keeps_shards_and_counts():
    d = Definitions()
    for n in skewed_names("s"):
        declare(d, n, 2)
    copy = Definitions.from_dict(d.to_dict(durable_only=True))
    assert {qu.name: qu.shard for qu in copy.vhosts[V].queues.values()} == \
        {qu.name: qu.shard for qu in d.vhosts[V].queues.values()}
    assert live(copy.shard_queues) == {0: 2, 1: 2}


def test_restart_with_fewer_shards_moves_only_the_orphans_and_spreads_them():
    d = Definitions()
    shards = {n: declare(d, n, 4) for n in (f"r{i}" for i in range(8))}
    assert collections.Counter(shards.values()) == {0: 2, 1: 2, 2: 2, 3: 2}
    moved = d.rebalance(2)
    assert sorted(op[2] for op in moved) == sorted(n for n, s in shards.items() if s >= 2)
    assert all(d.queue(V, n).shard == s for n, s in shards.items() if s < 2)
    assert live(d.shard_queues) == {0: 4, 1: 4}
    assert d.rebalance(4) == []  # more shards again: nobody moves back


def test_a_follower_applying_the_leaders_ops_gets_the_leaders_placement():
    """A cluster follower (and every worker) applies the leader's queue.declare ops, whose attrs
    carry the shard: it never places a queue itself, whatever its own counts or setting."""
    leader = Definitions()
    ops = []
    for n in skewed_names("l"):
        new, _ = leader.plan_queue_declare(V, n, False, True, False, False, {}, None, 2)
        leader.apply_all(new)
        ops += new
    follower = Definitions()
    follower.placement = "hash"
    follower.apply_all(ops)
    assert {qu.name: qu.shard for qu in follower.vhosts[V].queues.values()} == \
        {qu.name: qu.shard for qu in leader.vhosts[V].queues.values()}
    assert follower.rebalance(2) == []  # a promotion with the same shard count moves nothing


def test_definitions_import_spreads_queues_and_keeps_existing_ones():
    names = skewed_names("i")
    data = {"queues": [{"name": n, "vhost": V, "durable": True, "auto_delete": False, "arguments": {}}
                       for n in names]}
    d = Definitions()
    d.apply_all(plan_import(d, data, 2))
    assert collections.Counter(d.queue(V, n).shard for n in names) == {0: 2, 1: 2}
    d.apply(["queue.shard", V, names[0], 1])  # wherever a queue is, a re-import leaves it there
    assert plan_import(d, data, 2) == []


# ------------------------------------------------------------------ a real node
def shards_of(api: Api, names) -> dict[str, int]:
    return {n: api.get(f"/api/queues/{q(V)}/{q(n)}")["shard"] for n in names}


def test_node_places_balanced_and_keeps_placement_across_restarts_with_other_shard_counts(node_factory):
    node = node_factory(frontends=1, shards=2)
    api = Api(node.http_port)
    names = skewed_names("pq")
    conn = node.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    for n in names:
        ch.queue_declare(n, durable=True)
        publish_confirmed(ch, "", n, [n.encode()])
    conn.close()
    placed = shards_of(api, names)
    assert collections.Counter(placed.values()) == {0: 2, 1: 2}

    node.stop()
    node.shards = 3
    node.start()
    assert shards_of(api, names) == placed
    conn = node.connect()
    conn.channel().queue_declare("newcomer", durable=True)
    conn.close()
    assert shards_of(api, ["newcomer"]) == {"newcomer": 2}  # the empty shard

    node.stop()
    node.shards = 1
    node.start()
    assert set(shards_of(api, [*names, "newcomer"]).values()) == {0}
    for n in names:  # each queue's message is still there after moving shards
        assert drain(node, n) == [n.encode()]


def test_definitions_export_import_round_trip_places_like_declares(node_factory):
    a = node_factory(name="a", frontends=1, shards=2)
    b = node_factory(name="b", frontends=1, shards=2)
    api_a, api_b = Api(a.http_port), Api(b.http_port)
    names = skewed_names("ex")
    conn = a.connect()
    ch = conn.channel()
    for n in names:
        ch.queue_declare(n, durable=True)
    conn.close()
    exported = api_a.get("/api/definitions")
    status, body = api_b.call("POST", "/api/definitions", exported)
    assert status == 204, body
    assert collections.Counter(shards_of(api_b, names).values()) == {0: 2, 1: 2}
    placed = shards_of(api_a, names)
    status, body = api_a.call("POST", "/api/definitions", exported)  # importing what exists moves nothing
    assert status == 204, body
    assert shards_of(api_a, names) == placed
    conn = b.connect()  # and the imported queues work on the shard they got
    ch = conn.channel()
    ch.confirm_delivery()
    for n in names:
        ch.basic_publish("", n, n.encode(), pika.BasicProperties(delivery_mode=2), mandatory=True)
    conn.close()
    for n in names:
        assert drain(b, n) == [n.encode()]
