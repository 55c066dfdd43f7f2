"""Planning and validation: RabbitMQ's reply codes and texts, cascades, apply."""

from __future__ import annotations

import msgpack
import pytest

from broker.amqp.errors import AMQPChannelError, AMQPConnectionError
from broker.definitions import Definitions, queue_shard

V = "/"
OWNER = [0, 7]
OTHER = [1, 3]


def declare_q(d, name, durable=True, exclusive=False, auto_delete=False, args=None, owner=None, passive=False):
    ops, qname = d.plan_queue_declare(V, name, passive, durable, exclusive, auto_delete, args or {},
                                      owner, 4)
    d.apply_all(ops)
    return qname


def declare_x(d, name, type="direct", durable=True, auto_delete=False, internal=False, args=None,
              passive=False):
    d.apply_all(d.plan_exchange_declare(V, name, type, passive, durable, auto_delete, internal, args or {}))


def fails(fn, *args, code, text, cls=AMQPChannelError, ids=None):
    with pytest.raises(cls) as info:
        fn(*args)
    err = info.value
    assert (err.code, err.text) == (code, text)
    if ids is not None:
        assert (err.class_id, err.method_id) == ids
    return err


# ----------------------------------------------------------------- exchanges
def test_predeclared_exchanges():
    d = Definitions()
    for name, type in [("", "direct"), ("amq.direct", "direct"), ("amq.fanout", "fanout"),
                       ("amq.topic", "topic"), ("amq.headers", "headers"), ("amq.match", "headers")]:
        x = d.exchange(V, name)
        assert (x.type, x.durable, x.auto_delete, x.internal) == (type, True, False, False)


def test_exchange_declare_new_then_equivalent_redeclare_is_noop():
    d = Definitions()
    ops = d.plan_exchange_declare(V, "x", "topic", False, True, False, False, {})
    assert ops == [["exchange.declare", V, "x", {"type": "topic", "durable": True, "auto_delete": False,
                                                 "internal": False, "arguments": {}}]]
    d.apply_all(ops)
    assert d.plan_exchange_declare(V, "x", "topic", False, True, False, False, {"other": 1}) == []
    assert d.plan_exchange_declare(V, "x", "", True, False, False, False, {}) == []  # passive ignores type


def test_exchange_declare_unknown_type_is_connection_error():
    d = Definitions()
    fails(d.plan_exchange_declare, V, "x", "nope", False, True, False, False, {},
          cls=AMQPConnectionError, code=503, text="unknown exchange type 'nope'", ids=(40, 10))


def test_exchange_declare_reserved_prefix():
    d = Definitions()
    fails(d.plan_exchange_declare, V, "amq.x", "direct", False, True, False, False, {},
          code=403, text="exchange name 'amq.x' contains reserved prefix 'amq.*'", ids=(40, 10))
    # an existing amq.* exchange may be redeclared equivalently
    assert d.plan_exchange_declare(V, "amq.direct", "direct", False, True, False, False, {}) == []


def test_exchange_declare_default_exchange_refused():
    d = Definitions()
    text = "operation not permitted on the default exchange"
    fails(d.plan_exchange_declare, V, "", "direct", False, True, False, False, {}, code=403, text=text)
    fails(d.plan_exchange_declare, V, "", "direct", True, True, False, False, {}, code=403, text=text)


def test_exchange_declare_passive_missing():
    d = Definitions()
    fails(d.plan_exchange_declare, V, "nope", "direct", True, False, False, False, {},
          code=404, text="no exchange 'nope' in vhost '/'", ids=(40, 10))


@pytest.mark.parametrize(
    "kwargs, text",
    [
        ({"type": "fanout"}, "inequivalent arg 'type' for exchange 'x' in vhost '/': "
                             "received 'fanout' but current is 'direct'"),
        ({"durable": False}, "inequivalent arg 'durable' for exchange 'x' in vhost '/': "
                             "received 'false' but current is 'true'"),
        ({"auto_delete": True}, "inequivalent arg 'auto_delete' for exchange 'x' in vhost '/': "
                                "received 'true' but current is 'false'"),
        ({"internal": True}, "inequivalent arg 'internal' for exchange 'x' in vhost '/': "
                             "received 'true' but current is 'false'"),
        ({"args": {"alternate-exchange": "ae"}},
         "inequivalent arg 'alternate-exchange' for exchange 'x' in vhost '/': "
         "received the value 'ae' of type 'longstr' but current is none"),
    ],
)
def test_exchange_declare_inequivalent(kwargs, text):
    d = Definitions()
    declare_x(d, "x")
    a = {"type": "direct", "durable": True, "auto_delete": False, "internal": False, "args": {}} | kwargs
    fails(d.plan_exchange_declare, V, "x", a["type"], False, a["durable"], a["auto_delete"], a["internal"],
          a["args"], code=406, text=text, ids=(40, 10))


def test_exchange_declare_bad_alternate_exchange_type():
    d = Definitions()
    fails(d.plan_exchange_declare, V, "x", "direct", False, True, False, False, {"alternate-exchange": 5},
          code=406, text="invalid type 'signedint' for arg 'alternate-exchange' in exchange 'x' in vhost '/'")


def test_exchange_delete_rules():
    d = Definitions()
    fails(d.plan_exchange_delete, V, "", False, code=403,
          text="operation not permitted on the default exchange", ids=(40, 20))
    fails(d.plan_exchange_delete, V, "amq.direct", False, code=403,
          text="deletion of system exchange 'amq.direct' in vhost '/' not allowed")
    assert d.plan_exchange_delete(V, "missing", False) == []  # RabbitMQ answers delete-ok
    declare_x(d, "x")
    declare_q(d, "q")
    d.apply_all(d.plan_bind(V, "x", "queue", "q", "k", {}, None))
    fails(d.plan_exchange_delete, V, "x", True, code=406, text="exchange 'x' in vhost '/' in use")
    # bound only as a destination: still unused as a source
    declare_x(d, "y")
    d.apply_all(d.plan_bind(V, "amq.fanout", "exchange", "y", "", {}, None))
    assert d.plan_exchange_delete(V, "y", True) == [["exchange.delete", V, "y"]]
    d.apply_all(d.plan_exchange_delete(V, "x", False))
    assert d.exchange(V, "x") is None
    assert d.bindings(V) == [("amq.fanout", "exchange", "y", "", {})]


# -------------------------------------------------------------------- queues
def test_queue_declare_new_places_on_shard():
    d = Definitions()
    ops, name = d.plan_queue_declare(V, "q", False, True, False, False, {"x-max-length": 5}, OWNER, 4)
    assert name == "q"
    assert ops == [["queue.declare", V, "q", {"durable": True, "exclusive_owner": None, "auto_delete": False,
                                              "arguments": {"x-max-length": 5},
                                              "shard": queue_shard(V, "q", 4)}]]
    import zlib

    assert queue_shard(V, "q", 4) == zlib.crc32(b"/\0q") % 4


def test_queue_declare_server_named():
    d = Definitions()
    ops, name = d.plan_queue_declare(V, "", False, False, True, True, {}, OWNER, 2)
    assert name.startswith("amq.gen-") and len(name) > len("amq.gen-") + 16
    d.apply_all(ops)
    q = d.queue(V, name)
    assert q.exclusive_owner == tuple(OWNER) and q.durable is False
    _, other = d.plan_queue_declare(V, "", False, False, True, True, {}, OWNER, 2)
    assert other != name


def test_queue_declare_reserved_prefix():
    d = Definitions()
    fails(d.plan_queue_declare, V, "amq.q", False, True, False, False, {}, None, 1,
          code=403, text="queue name 'amq.q' contains reserved prefix 'amq.*'", ids=(50, 10))


def test_queue_declare_passive():
    d = Definitions()
    fails(d.plan_queue_declare, V, "q", True, False, False, False, {}, OWNER, 1,
          code=404, text="no queue 'q' in vhost '/'", ids=(50, 10))
    declare_q(d, "q", exclusive=True, owner=OWNER)
    assert d.plan_queue_declare(V, "q", True, False, False, False, {}, OWNER, 1) == ([], "q")
    fails(d.plan_queue_declare, V, "q", True, False, False, False, {}, OTHER, 1, code=405,
          text="cannot obtain exclusive access to locked queue 'q' in vhost '/'. It could be originally "
               "declared on another connection or the exclusive property value does not match that of "
               "the original declaration.")


LOCKED = ("cannot obtain exclusive access to locked queue 'q' in vhost '/'. It could be originally declared on "
          "another connection or the exclusive property value does not match that of the original declaration.")


def test_queue_declare_exclusive_ownership():
    d = Definitions()
    declare_q(d, "q", exclusive=True, owner=OWNER)
    assert d.plan_queue_declare(V, "q", False, False, True, False, {}, OWNER, 1) == ([], "q")
    fails(d.plan_queue_declare, V, "q", False, False, True, False, {}, OTHER, 1, code=405, text=LOCKED)
    # the owner redeclaring it non-exclusive does not match either (strict check)
    fails(d.plan_queue_declare, V, "q", False, False, False, False, {}, OWNER, 1, code=405, text=LOCKED)
    d2 = Definitions()
    declare_q(d2, "q")
    fails(d2.plan_queue_declare, V, "q", False, True, True, False, {}, OWNER, 1, code=405, text=LOCKED)


@pytest.mark.parametrize(
    "kwargs, text",
    [
        ({"durable": False}, "inequivalent arg 'durable' for queue 'q' in vhost '/': "
                             "received 'false' but current is 'true'"),
        ({"auto_delete": True}, "inequivalent arg 'auto_delete' for queue 'q' in vhost '/': "
                                "received 'true' but current is 'false'"),
        ({"args": {"x-message-ttl": 300, "x-max-length": 10}},
         "inequivalent arg 'x-message-ttl' for queue 'q' in vhost '/': "
         "received the value '300' of type 'signedint' but current is none"),
        ({"args": {"x-max-length": 11}}, "inequivalent arg 'x-max-length' for queue 'q' in vhost '/': "
                                         "received the value '11' of type 'signedint' but current is "
                                         "the value '10' of type 'signedint'"),
        ({"args": {}}, "inequivalent arg 'x-max-length' for queue 'q' in vhost '/': "
                       "received none but current is the value '10' of type 'signedint'"),
        ({"args": {"x-max-length": True}}, "inequivalent arg 'x-max-length' for queue 'q' in vhost '/': "
                                           "received the value 'true' of type 'bool' but current is "
                                           "the value '10' of type 'signedint'"),
    ],
)
def test_queue_declare_inequivalent(kwargs, text):
    d = Definitions()
    declare_q(d, "q", args={"x-max-length": 10})
    a = {"durable": True, "auto_delete": False, "args": {"x-max-length": 10}} | kwargs
    fails(d.plan_queue_declare, V, "q", False, a["durable"], False, a["auto_delete"], a["args"], None, 1,
          code=406, text=text, ids=(50, 10))


def test_queue_declare_equivalence_ignores_unknown_args_and_classic_type():
    d = Definitions()
    declare_q(d, "q", args={"x-custom": 1})
    assert d.plan_queue_declare(V, "q", False, True, False, False, {"x-custom": 2, "other": "x"}, None, 1) \
        == ([], "q")
    assert d.plan_queue_declare(V, "q", False, True, False, False, {"x-queue-type": "classic"}, None, 1) \
        == ([], "q")
    # exclusive queues are never durable: durable=True on redeclare is equivalent
    declare_q(d, "e", durable=False, exclusive=True, owner=OWNER)
    assert d.plan_queue_declare(V, "e", False, True, True, False, {}, OWNER, 1) == ([], "e")


@pytest.mark.parametrize(
    "args, text",
    [
        ({"x-max-priority": 300}, "invalid arg 'x-max-priority' for queue 'q' in vhost '/': "
                                  "{max_value_exceeded,300}"),
        ({"x-max-length": -1}, "invalid arg 'x-max-length' for queue 'q' in vhost '/': {value_negative,-1}"),
        ({"x-expires": 0}, "invalid arg 'x-expires' for queue 'q' in vhost '/': {value_zero,0}"),
        ({"x-message-ttl": "x"}, "invalid arg 'x-message-ttl' for queue 'q' in vhost '/': "
                                 "{unacceptable_type,\"expected integer\"}"),
        ({"x-dead-letter-exchange": 1}, "invalid type 'signedint' for arg 'x-dead-letter-exchange' in "
                                        "queue 'q' in vhost '/'"),
        ({"x-dead-letter-routing-key": "rk"}, "invalid arg 'x-dead-letter-routing-key' for queue 'q' in "
                                              "vhost '/': routing_key_but_no_dlx_defined"),
        ({"x-overflow": "nope"}, "invalid arg 'x-overflow' for queue 'q' in vhost '/': invalid_overflow"),
    ],
)
def test_queue_declare_invalid_args(args, text):
    d = Definitions()
    fails(d.plan_queue_declare, V, "q", False, True, False, False, args, None, 1, code=406, text=text)


def test_queue_delete_rules():
    d = Definitions()
    assert d.plan_queue_delete(V, "missing", True, True, OWNER, 5, 5) == []
    declare_q(d, "q")
    fails(d.plan_queue_delete, V, "q", True, False, OWNER, 1, 0, code=406,
          text="queue 'q' in vhost '/' in use", ids=(50, 40))
    fails(d.plan_queue_delete, V, "q", False, True, OWNER, 0, 3, code=406, text="queue 'q' in vhost '/' not empty")
    assert d.plan_queue_delete(V, "q", True, True, OWNER, 0, 0) == [["queue.delete", V, "q"]]
    declare_q(d, "e", exclusive=True, owner=OWNER)
    fails(d.plan_queue_delete, V, "e", False, False, OTHER, 0, 0, code=405,
          text=LOCKED.replace("'q'", "'e'"))
    assert d.plan_queue_delete(V, "e", False, False, None, 0, 0) == [["queue.delete", V, "e"]]  # admin


def test_queue_delete_removes_bindings():
    d = Definitions()
    declare_q(d, "q")
    d.apply_all(d.plan_bind(V, "amq.direct", "queue", "q", "k", {}, None))
    d.apply_all(d.plan_queue_delete(V, "q", False, False, None, 0, 0))
    assert d.bindings(V) == []
    assert d.route(V, "amq.direct", "k") == ()


# ------------------------------------------------------------------ bindings
def test_bind_errors():
    d = Definitions()
    declare_q(d, "q")
    text = "operation not permitted on the default exchange"
    fails(d.plan_bind, V, "", "queue", "q", "q", {}, None, code=403, text=text, ids=(50, 20))
    fails(d.plan_bind, V, "amq.direct", "exchange", "", "k", {}, None, code=403, text=text, ids=(40, 30))
    fails(d.plan_unbind, V, "", "queue", "q", "q", {}, None, code=403, text=text, ids=(50, 50))
    fails(d.plan_bind, V, "nope", "queue", "q", "k", {}, None, code=404, text="no exchange 'nope' in vhost '/'")
    fails(d.plan_bind, V, "amq.direct", "queue", "nope", "k", {}, None, code=404,
          text="no queue 'nope' in vhost '/'")
    fails(d.plan_bind, V, "amq.direct", "exchange", "nope", "k", {}, None, code=404,
          text="no exchange 'nope' in vhost '/'")
    # unbind is idempotent in RabbitMQ 3.10: a missing source or destination answers unbind-ok
    assert d.plan_unbind(V, "amq.direct", "queue", "nope", "k", {}, None) == []
    assert d.plan_unbind(V, "nope", "queue", "q", "k", {}, None) == []
    assert d.plan_unbind(V, "nope", "exchange", "amq.direct", "k", {}, None) == []
    assert d.plan_unbind(V, "amq.direct", "exchange", "nope", "k", {}, None) == []
    fails(d.plan_unbind, V, "amq.direct", "exchange", "", "k", {}, None, code=403, text=text, ids=(40, 40))
    declare_q(d, "e", exclusive=True, owner=OWNER)
    fails(d.plan_bind, V, "amq.direct", "queue", "e", "k", {}, OTHER, code=405, text=LOCKED.replace("'q'", "'e'"))
    assert d.plan_bind(V, "amq.direct", "queue", "e", "k", {}, OWNER) != []
    fails(d.plan_unbind, V, "amq.direct", "queue", "e", "k", {}, OTHER, code=405,
          text=LOCKED.replace("'q'", "'e'"), ids=(50, 50))


def test_bind_headers_x_match_validation():
    d = Definitions()
    declare_q(d, "q")
    fails(d.plan_bind, V, "amq.headers", "queue", "q", "", {"x-match": "some"}, None, code=406,
          text='Invalid x-match field value <<"some">>; expected all, any, all-with-x, or any-with-x')
    fails(d.plan_bind, V, "amq.headers", "queue", "q", "", {"x-match": 1}, None, code=406,
          text="Invalid x-match field type signedint (value 1); expected longstr")
    for mode in ("all", "any", "all-with-x", "any-with-x"):
        assert d.plan_bind(V, "amq.headers", "queue", "q", "", {"x-match": mode}, None)
    # other exchange types do not care about x-match
    assert d.plan_bind(V, "amq.direct", "queue", "q", "", {"x-match": "some"}, None)


def test_bind_and_unbind_are_idempotent():
    d = Definitions()
    declare_q(d, "q")
    ops = d.plan_bind(V, "amq.direct", "queue", "q", "k", {"a": 1}, None)
    assert ops == [["bind", V, "amq.direct", "queue", "q", "k", {"a": 1}]]
    d.apply_all(ops)
    assert d.plan_bind(V, "amq.direct", "queue", "q", "k", {"a": 1}, None) == []
    assert d.plan_bind(V, "amq.direct", "queue", "q", "k", {"a": 2}, None) != []  # args are part of identity
    assert d.plan_unbind(V, "amq.direct", "queue", "q", "other", {}, None) == []
    d.apply_all(d.plan_unbind(V, "amq.direct", "queue", "q", "k", {"a": 1}, None))
    assert d.bindings(V) == []


def test_auto_delete_exchange_deleted_with_last_binding():
    d = Definitions()
    declare_q(d, "q1")
    declare_q(d, "q2")
    declare_x(d, "ax", "fanout", auto_delete=True)
    assert d.plan_exchange_delete(V, "ax", True)  # never bound: stays until deleted
    d.apply_all(d.plan_bind(V, "ax", "queue", "q1", "", {}, None))
    d.apply_all(d.plan_bind(V, "ax", "queue", "q2", "", {}, None))
    assert d.plan_unbind(V, "ax", "queue", "q1", "", {}, None) == [["unbind", V, "ax", "queue", "q1", "", {}]]
    d.apply_all(d.plan_unbind(V, "ax", "queue", "q1", "", {}, None))
    ops = d.plan_queue_delete(V, "q2", False, False, None, 0, 0)
    assert ops == [["queue.delete", V, "q2"], ["exchange.delete", V, "ax"]]
    d.apply_all(ops)
    assert d.exchange(V, "ax") is None


def test_auto_delete_cascades_through_exchange_chain():
    d = Definitions()
    declare_q(d, "q")
    declare_x(d, "a", "fanout", auto_delete=True)
    declare_x(d, "b", "fanout", auto_delete=True)
    d.apply_all(d.plan_bind(V, "a", "exchange", "b", "", {}, None))
    d.apply_all(d.plan_bind(V, "b", "queue", "q", "", {}, None))
    ops = d.plan_queue_delete(V, "q", False, False, None, 0, 0)
    assert ops == [["queue.delete", V, "q"], ["exchange.delete", V, "b"], ["exchange.delete", V, "a"]]
    d.apply_all(ops)
    assert d.exchange(V, "a") is None and d.exchange(V, "b") is None


def test_ops_for_owner_gone():
    d = Definitions()
    declare_q(d, "c1", exclusive=True, owner=[0, 1])
    declare_q(d, "c2", exclusive=True, owner=[0, 2])
    declare_q(d, "f1", exclusive=True, owner=[1, 1])
    declare_q(d, "shared")
    assert d.ops_for_owner_gone([0, 1]) == [["queue.delete", V, "c1"]]
    assert sorted(op[2] for op in d.ops_for_owner_gone([0])) == ["c1", "c2"]
    d.apply_all(d.ops_for_owner_gone([0]))
    assert sorted(d.vhosts[V].queues) == ["f1", "shared"]


def test_rebalance_moves_only_queues_of_shards_that_are_gone():
    d = Definitions()
    for i in range(20):
        declare_q(d, f"q{i}")  # placed for 4 shards
    before = {q.name: q.shard for q in d.vhosts[V].queues.values()}
    assert d.rebalance(5) == []  # more shards: every queue stays
    d.rebalance(3)
    after = {q.name: q.shard for q in d.vhosts[V].queues.values()}
    assert {n: s for n, s in after.items() if before[n] < 3} == {n: s for n, s in before.items() if s < 3}
    assert all(0 <= s < 3 for s in after.values())
    assert d.rebalance(3) == []


def test_exchange_for_publish():
    d = Definitions()
    declare_x(d, "int", internal=True)
    fails(d.exchange_for_publish, V, "nope", code=404, text="no exchange 'nope' in vhost '/'", ids=(60, 40))
    fails(d.exchange_for_publish, V, "int", code=403, text="cannot publish to internal exchange 'int' in vhost '/'")
    assert d.exchange_for_publish(V, "amq.direct").name == "amq.direct"


def test_unknown_vhost_is_connection_error():
    d = Definitions()
    fails(d.plan_queue_declare, "nope", "q", False, True, False, False, {}, None, 1,
          cls=AMQPConnectionError, code=530, text="vhost nope not found")


# ------------------------------------------------------------ apply, dicts
def test_apply_replay_is_safe_and_version_counts_ops():
    d = Definitions()
    ops = [
        ["vhost.put", "v2"],
        ["exchange.declare", "v2", "x", {"type": "fanout", "durable": True, "auto_delete": False,
                                         "internal": False, "arguments": {}}],
        ["queue.declare", "v2", "q", {"durable": True, "exclusive_owner": None, "auto_delete": False,
                                      "arguments": {}, "shard": 0}],
        ["bind", "v2", "x", "queue", "q", "", {}],
        ["bind", "v2", "x", "queue", "missing", "", {}],
        ["unbind", "v2", "x", "queue", "q", "nope", {}],
        ["exchange.delete", "v2", "missing"],
        ["queue.delete", "v2", "missing"],
    ]
    d.apply_all(ops)
    once = d.to_dict()
    d.apply_all(ops)
    twice = d.to_dict()
    assert once["version"] == len(ops) and twice["version"] == 2 * len(ops)
    once.pop("version"), twice.pop("version")
    assert once == twice
    assert d.route("v2", "x", "") == ("q",)
    with pytest.raises(ValueError):
        d.apply(["no.such.op"])


def test_exchange_redeclare_keeps_bindings():
    d = Definitions()
    declare_q(d, "q")
    declare_x(d, "x", "fanout")
    d.apply_all(d.plan_bind(V, "x", "queue", "q", "", {}, None))
    d.apply(["exchange.declare", V, "x", {"type": "fanout", "durable": False, "auto_delete": False,
                                          "internal": False, "arguments": {}}])
    assert d.route(V, "x", "") == ("q",)


def test_to_dict_round_trip_through_json_and_msgpack():
    d = Definitions()
    d.apply_all(d.default_user_ops())
    declare_q(d, "q", args={"x-max-length": 3, "blob": b"\xff\x00"})
    declare_q(d, "t", durable=False)
    declare_q(d, "e", exclusive=True, owner=OWNER)
    declare_x(d, "x", "topic", args={"alternate-exchange": "amq.fanout"})
    d.apply_all(d.plan_bind(V, "x", "queue", "q", "a.*", {"k": [1, "two"]}, None))
    d.apply_all(d.plan_bind(V, "x", "queue", "t", "#", {}, None))
    d.apply_all(d.plan_bind(V, "amq.headers", "queue", "q", "", {"x-match": "any", "h": 1}, None))
    snap = d.to_dict()
    wire = msgpack.unpackb(msgpack.packb(snap, use_bin_type=True), raw=False, strict_map_key=False)
    copy = Definitions.from_dict(wire)
    assert copy.to_dict() == snap
    assert copy.version == d.version
    assert set(copy.route(V, "x", "a.b")) == {"q", "t"}
    assert copy.queue(V, "e").exclusive_owner == tuple(OWNER)
    durable = d.to_dict(durable_only=True)
    assert set(durable["vhosts"][V]["queues"]) == {"q"}
    assert [b[2] for b in durable["vhosts"][V]["bindings"]] == ["q", "q"]


def test_snapshot_queue_columns_round_trip_through_msgpack():
    """The workers' SNAPSHOT carries queues as columns (to_dict(queue_columns=True)): a copy made
    from it has the same queues, attributes, shards, routes and placement counts as one made from
    the per-queue maps of definitions.json."""
    d = Definitions()
    d.apply_all(d.default_user_ops())
    d.apply_all(d.plan_vhost_put("v2"))
    declare_q(d, "q", args={"x-max-length": 3, "blob": b"\xff\x00"})
    declare_q(d, "t", durable=False)
    declare_q(d, "e", exclusive=True, owner=OWNER)
    for i in range(50):
        d.apply(["queue.declare", "v2" if i % 3 else V, f"n{i}", {"durable": i % 2 == 0, "auto_delete": i % 5 == 0,
                                                               "arguments": {}, "shard": i % 4}])
    declare_x(d, "x", "topic")
    d.apply_all(d.plan_bind(V, "x", "queue", "q", "a.*", {}, None))
    cols = d.to_dict(queue_columns=True)
    assert "queues" not in cols["vhosts"][V] and len(cols["vhosts"][V]["queue_columns"][0]) == 3 + 17
    wire = msgpack.unpackb(msgpack.packb(cols, use_bin_type=True), raw=False, strict_map_key=False)
    copy = Definitions.from_dict(wire)
    assert copy.to_dict() == d.to_dict()
    assert copy.version == d.version
    assert copy.shard_queues == d.shard_queues
    assert {v: c.shard_queues for v, c in copy.vhosts.items()} == {v: c.shard_queues for v, c in d.vhosts.items()}
    assert copy.queue(V, "e").exclusive_owner == tuple(OWNER)
    assert copy.route(V, "", "n3") == ("n3",) and copy.route(V, "x", "a.b") == ("q",)
    assert copy.place_queue("v2", "new", 4) == d.place_queue("v2", "new", 4)


def test_management_plans():
    from broker.auth import authenticate

    d = Definitions()
    assert d.plan_vhost_put(V) == []
    d.apply_all(d.plan_vhost_put("v2"))
    assert d.exchange("v2", "amq.topic").type == "topic"
    d.apply_all(d.plan_user_put("bob", "pw", ["management"]))
    assert authenticate(d, "PLAIN", b"\0bob\0pw", True) == "bob"
    with pytest.raises(KeyError):
        d.plan_permission_put("nobody", V)
    with pytest.raises(KeyError):
        d.plan_permission_put("bob", "missing")
    d.apply_all(d.plan_permission_put("bob", "v2", read="^r"))
    assert d.permissions["bob"]["v2"] == {"configure": ".*", "write": ".*", "read": "^r"}
    d.apply_all(d.plan_permission_delete("bob", "v2"))
    assert d.plan_permission_delete("bob", "v2") == []
    d.apply_all(d.plan_vhost_delete("v2"))
    assert "v2" not in d.vhosts and d.plan_vhost_delete("v2") == []
    d.apply_all(d.plan_user_delete("bob"))
    assert "bob" not in d.users and d.plan_user_delete("bob") == []
