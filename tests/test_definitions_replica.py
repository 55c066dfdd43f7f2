"""Property: a replica built from a snapshot plus the broadcast ops equals the planner's state."""

from __future__ import annotations

import msgpack
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.amqp.errors import AMQPError
from broker.definitions import Definitions
from broker.defstore import DefStore

V = "/"
QUEUES = ["q1", "q2", "q3"]
EXCHANGES = ["x1", "x2", "x3", "amq.direct", "amq.topic", "amq.headers"]
OWNERS = [[0, 1], [0, 2], [1, 1]]
KEYS = ["", "a", "a.b", "#", "*.b", "a.#"]

queue_declare = st.tuples(st.just("qd"), st.sampled_from(QUEUES), st.booleans(),
                          st.sampled_from([False, False, False, True]), st.booleans(),
                          st.sampled_from(OWNERS), st.sampled_from([{}, {"x-max-length": 3}]))
exchange_declare = st.tuples(st.just("xd"), st.sampled_from(EXCHANGES[:3]),
                             st.sampled_from(["direct", "fanout", "topic", "headers"]), st.booleans(),
                             st.booleans())
dest = st.one_of(st.tuples(st.just("queue"), st.sampled_from(QUEUES)),
                 st.tuples(st.just("exchange"), st.sampled_from(EXCHANGES[:3])))
bind = st.builds(lambda verb, source, d, key, args, owner: (verb, source, d[0], d[1], key, args, owner),
                 st.sampled_from(["bind", "bind", "unbind"]), st.sampled_from(EXCHANGES), dest,
                 st.sampled_from(KEYS), st.sampled_from([{}, {"x-match": "any", "h": 1}]), st.sampled_from(OWNERS))
deletes = st.tuples(st.sampled_from(["qdel", "xdel"]), st.sampled_from(QUEUES + EXCHANGES), st.booleans())
owner_gone = st.tuples(st.just("gone"), st.sampled_from([[0], [0, 1], [1]]))
snapshot = st.tuples(st.just("snap"))
# binds are listed thrice so that states with many bindings are common
actions = st.lists(st.one_of(queue_declare, exchange_declare, bind, bind, bind, deletes, owner_gone, snapshot),
                   min_size=20, max_size=60)


def plan(d: Definitions, action: tuple) -> list:
    kind = action[0]
    if kind == "qd":
        _, name, durable, exclusive, auto_delete, owner, args = action
        return d.plan_queue_declare(V, name, False, durable, exclusive, auto_delete, args, owner, 3)[0]
    if kind == "xd":
        _, name, type, durable, auto_delete = action
        return d.plan_exchange_declare(V, name, type, False, durable, auto_delete, False, {})
    if kind in ("bind", "unbind"):
        _, source, dest_kind, dest, key, args, owner = action
        fn = d.plan_bind if kind == "bind" else d.plan_unbind
        return fn(V, source, dest_kind, dest, key, args, owner)
    if kind == "qdel":
        return d.plan_queue_delete(V, action[1], action[2], False, None, 0, 0)
    if kind == "xdel":
        return d.plan_exchange_delete(V, action[1], action[2])
    if kind == "gone":
        return d.ops_for_owner_gone(action[1])
    raise AssertionError(kind)


# Declared first in every example, so that random binds mostly find both ends.
SETUP = [("xd", "x1", "fanout", True, False), ("xd", "x2", "topic", True, True), ("xd", "x3", "headers", False, True),
         ("qd", "q1", True, False, False, [0, 1], {}), ("qd", "q2", False, False, True, [0, 1], {}),
         ("qd", "q3", True, True, False, [1, 1], {})]


def wire(value):
    return msgpack.unpackb(msgpack.packb(value, use_bin_type=True), raw=False, strict_map_key=False)


def routes(d: Definitions) -> dict:
    return {(x, k): sorted(d.route(V, x, k)) for x in EXCHANGES + [""] for k in KEYS + QUEUES}


@settings(max_examples=150, deadline=None)
@given(actions)
def test_replica_matches_planner(acts):
    node = Definitions()
    replica = Definitions.from_dict(wire(node.to_dict()))
    for action in SETUP + acts:
        if action[0] == "snap":
            replica = Definitions.from_dict(wire(node.to_dict()))
            continue
        try:
            ops = plan(node, action)
        except AMQPError:
            continue
        node.apply_all(ops)
        replica.apply_all(wire(ops))
        # invariants of the planner's own state
        vh = node.vhosts[V]
        for key in vh.bindings:
            assert key[0] in vh.exchanges
            assert key[2] in (vh.queues if key[1] == "queue" else vh.exchanges)
    assert replica.to_dict() == node.to_dict()
    assert routes(replica) == routes(node)


@settings(max_examples=40, deadline=None)
@given(actions)
def test_persisted_state_is_the_durable_part(tmp_path_factory, acts):
    data_dir = str(tmp_path_factory.mktemp("defs"))
    store = DefStore(data_dir)
    node = store.load()
    for action in SETUP + acts:
        if action[0] == "snap":
            continue
        try:
            ops = plan(node, action)
        except AMQPError:
            continue
        node.apply_all(ops)
        store.record(ops)
    store.sync()
    store.close()
    loaded = DefStore(data_dir).load()
    expected = node.to_dict(durable_only=True)
    got = loaded.to_dict(durable_only=True)
    for vname, vd in expected["vhosts"].items():
        vd["bindings"] = sorted(map(repr, vd["bindings"]))
        got["vhosts"][vname]["bindings"] = sorted(map(repr, got["vhosts"][vname]["bindings"]))
    assert got["vhosts"] == expected["vhosts"]
    assert got["users"] == expected["users"]
