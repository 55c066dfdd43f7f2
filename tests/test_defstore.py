"""Persistence of definitions: load, record, compaction, torn log lines."""

from __future__ import annotations

import json
import os

import pytest

from broker.auth import check_password
from broker.definitions import Definitions
from broker.defstore import LOG, SNAPSHOT, DefStore

V = "/"


def run(store: DefStore, defs: Definitions, ops: list) -> None:
    """What the node does: apply, record, sync."""
    defs.apply_all(ops)
    store.record(ops)
    store.sync()


def q(defs, name, durable=True, exclusive=False, owner=None):
    ops, _ = defs.plan_queue_declare(V, name, False, durable, exclusive, False, {}, owner, 4)
    return ops


def test_fresh_dir_gets_default_user_and_files(tmp_path):
    store = DefStore(str(tmp_path))
    defs = store.load()
    assert set(defs.users) == {"guest"}
    assert defs.users["guest"].tags == ["administrator"]
    assert check_password(defs.users["guest"], "guest")
    assert os.path.exists(tmp_path / SNAPSHOT) and os.path.getsize(tmp_path / LOG) == 0
    store.close()
    custom = DefStore(str(tmp_path / "other")).load(default_user="admin", default_pass="pw")
    assert set(custom.users) == {"admin"}
    assert check_password(custom.users["admin"], "pw")


def test_existing_users_are_kept(tmp_path):
    store = DefStore(str(tmp_path))
    defs = store.load()
    run(store, defs, defs.default_user_ops("alice", "a"))
    run(store, defs, [["user.delete", "guest"]])
    store.close()
    again = DefStore(str(tmp_path)).load()
    assert set(again.users) == {"alice"}


def test_durable_entities_survive_and_transient_ones_do_not(tmp_path):
    store = DefStore(str(tmp_path))
    defs = store.load()
    run(store, defs, q(defs, "dq"))
    run(store, defs, q(defs, "tq", durable=False))
    run(store, defs, q(defs, "eq", durable=True, exclusive=True, owner=[0, 1]))
    run(store, defs, defs.plan_exchange_declare(V, "dx", "topic", False, True, False, False, {}))
    run(store, defs, defs.plan_exchange_declare(V, "tx", "fanout", False, False, False, False, {}))
    for source, dest, kind in [("dx", "dq", "queue"), ("dx", "tq", "queue"), ("tx", "dq", "queue"),
                               ("amq.direct", "dq", "queue"), ("amq.fanout", "dx", "exchange"),
                               ("dx", "eq", "queue")]:
        run(store, defs, defs.plan_bind(V, source, kind, dest, "k.#", {"a": b"\xff"}, [0, 1]))
    store.close()

    loaded = DefStore(str(tmp_path)).load()
    vh = loaded.vhosts[V]
    assert set(vh.queues) == {"dq"}
    assert set(vh.exchanges) - {"", "amq.direct", "amq.fanout", "amq.topic", "amq.headers", "amq.match"} == {"dx"}
    assert sorted((b[0], b[2]) for b in loaded.bindings(V)) == [("amq.direct", "dq"), ("amq.fanout", "dx"),
                                                                ("dx", "dq")]
    assert loaded.bindings(V)[0][4] == {"a": b"\xff"}  # non-UTF-8 bytes survive JSON
    assert loaded.route(V, "amq.fanout", "k.x") == ["dq"]


def test_log_replayed_then_compacted(tmp_path):
    store = DefStore(str(tmp_path))
    defs = store.load()
    run(store, defs, q(defs, "a"))
    run(store, defs, q(defs, "b"))
    run(store, defs, defs.plan_queue_delete(V, "a", False, False, None, 0, 0))
    store.close()
    lines = (tmp_path / LOG).read_text().splitlines()
    assert [json.loads(line)[0] for line in lines] == ["queue.declare", "queue.declare", "queue.delete"]

    loaded = DefStore(str(tmp_path)).load()
    assert set(loaded.vhosts[V].queues) == {"b"}
    assert os.path.getsize(tmp_path / LOG) == 0
    snap = json.loads((tmp_path / SNAPSHOT).read_text())
    assert set(snap["vhosts"][V]["queues"]) == {"b"}
    assert not os.path.exists(str(tmp_path / SNAPSHOT) + ".tmp")


def test_record_skips_transient_declares_and_shard_moves(tmp_path):
    store = DefStore(str(tmp_path))
    defs = store.load()
    assert store.record(q(defs, "t", durable=False)) == 0
    assert store.record([["queue.shard", V, "x", 1]]) == 0
    assert store.record(q(defs, "d")) == 1
    store.sync()
    store.close()


def test_torn_last_line_is_ignored(tmp_path):
    store = DefStore(str(tmp_path))
    defs = store.load()
    run(store, defs, q(defs, "kept"))
    store.close()
    with open(tmp_path / LOG, "a") as f:
        f.write('["queue.declare","/","torn",{"dura')
    loaded = DefStore(str(tmp_path)).load()
    assert set(loaded.vhosts[V].queues) == {"kept"}


def test_corrupt_middle_line_is_an_error(tmp_path):
    store = DefStore(str(tmp_path))
    store.load()
    store.close()
    (tmp_path / LOG).write_text('garbage\n["vhost.put","v"]\n')
    with pytest.raises(ValueError):
        DefStore(str(tmp_path)).load()


def test_sync_and_close_without_records(tmp_path):
    store = DefStore(str(tmp_path))
    store.sync()
    store.close()


def test_exclusive_queues_gone_and_vhosts_users_persist(tmp_path):
    store = DefStore(str(tmp_path))
    defs = store.load()
    run(store, defs, [["vhost.put", "v2"], ["permission.put", "guest", "v2", {}]])
    run(store, defs, [["exchange.declare", "v2", "x", {"type": "direct", "durable": True, "auto_delete": False,
                                                       "internal": False, "arguments": {}}]])
    store.close()
    loaded = DefStore(str(tmp_path)).load()
    assert set(loaded.vhosts) == {V, "v2"}
    assert loaded.exchange("v2", "x") is not None
    assert "v2" in loaded.permissions["guest"]
    # a second load of the compacted state is stable
    again = DefStore(str(tmp_path)).load()
    a, b = loaded.to_dict(), again.to_dict()
    assert a["vhosts"] == b["vhosts"] and a["permissions"] == b["permissions"]


def test_transient_bindings_and_deletes_are_not_logged(tmp_path):
    """A binding with a transient end, or deleting a transient queue/exchange, survives nothing: not
    logged (so its *-Ok waits for no fsync); the durable ones are, and a restart has exactly them."""
    from broker.defstore import durable_ops

    store = DefStore(str(tmp_path))
    defs = store.load()
    run(store, defs, q(defs, "dq") + q(defs, "tq", durable=False)
        + defs.plan_exchange_declare(V, "dx", "direct", False, True, False, False, {})
        + defs.plan_exchange_declare(V, "tx", "direct", False, False, False, False, {}))
    transient = [defs.plan_bind(V, "tx", "queue", "dq", "k", {}, None),
                 defs.plan_bind(V, "dx", "queue", "tq", "k", {}, None)]
    for ops in transient:
        assert durable_ops(defs, ops) == []
        defs.apply_all(ops)
    durable = defs.plan_bind(V, "dx", "queue", "dq", "k", {}, None)
    assert durable_ops(defs, durable) == durable
    defs.apply_all(durable)
    store.record(durable)
    assert durable_ops(defs, [["queue.delete", V, "tq"], ["exchange.delete", V, "tx"]]) == []
    assert durable_ops(defs, [["queue.delete", V, "dq"]]) == [["queue.delete", V, "dq"]]
    # An end declared in the same batch is not known yet: logged, which is always safe.
    assert durable_ops(defs, [["bind", V, "new-x", "queue", "dq", "k", {}]]) != []
    store.close()
    again = DefStore(str(tmp_path)).load()
    assert again.bindings(V) == [("dx", "queue", "dq", "k", {})]
