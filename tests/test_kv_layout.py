"""broker/kv_layout.py on a data dir without a node: the old shared log read once, keys moved to
their owner's log when the shard count changes, a crash during the swap finished at the next boot."""

from __future__ import annotations

import logging
import os

from broker.datadir import name_hash
from broker.kv_layout import place_logs
from broker.kv_log import encode, log_name, read_log, replay

VHOST = "/"
SPACE = "sessions"
STAYS = "marks"  # keys with no owner: they stay in the shard log they are in


def owner(_vhost: str, space: str, key: str) -> int | None:
    return None if space == STAYS else int(key.split("-")[1]) % COUNT[0]


COUNT = [2]


def _vdir(tmp_path) -> str:
    d = os.path.join(tmp_path, "kv", name_hash(VHOST))
    os.makedirs(d, exist_ok=True)
    return d


def _write(path: str, records: list) -> None:
    with open(path, "wb") as fh:
        fh.write(b"".join(encode(k, v) for k, v in records))


def _items(vdir: str, space: str, shard: int) -> dict:
    return replay(read_log(os.path.join(vdir, log_name(space, shard)))[0])


def _place(tmp_path, count: int) -> int:
    COUNT[0] = count
    return place_logs(str(tmp_path), count, [VHOST], [SPACE, STAYS], owner)


def test_the_old_shared_log_is_read_up_to_its_first_bad_record_once(tmp_path, caplog):
    vdir = _vdir(tmp_path)
    old = os.path.join(vdir, name_hash(SPACE) + ".log")
    good = [("c-0", {"subs": 1}), ("c-1", {"subs": 2}), ("c-0", {"subs": 3}), ("c-3", None)]
    _write(old, good)
    with open(old, "ab") as fh:
        fh.write(b"\x05\x00\x00\x00garbage-of-another-writer")
        fh.write(encode("c-5", {"subs": 5}))  # after the bad record: not trusted
    with caplog.at_level(logging.WARNING, "shardmq.kv"):
        assert _place(tmp_path, 2) == 1
    assert "4 records" in caplog.text and "bytes after offset" in caplog.text and "lost" in caplog.text
    assert not os.path.exists(old)
    assert _items(vdir, SPACE, 0) == {"c-0": {"subs": 3}}
    assert _items(vdir, SPACE, 1) == {"c-1": {"subs": 2}}
    assert _place(tmp_path, 2) == 0  # placed: nothing to do at the next boot


def test_a_shard_count_change_moves_keys_to_their_owner_and_leaves_unowned_ones(tmp_path):
    vdir = _vdir(tmp_path)
    _write(os.path.join(vdir, log_name(SPACE, 0)), [("c-0", "a"), ("c-2", "b"), ("c-4", "x"), ("c-4", None)])
    _write(os.path.join(vdir, log_name(SPACE, 1)), [("c-1", "c"), ("c-3", "d")])
    _write(os.path.join(vdir, log_name(STAYS, 0)), [("c-1", [7])])
    _write(os.path.join(vdir, log_name(STAYS, 1)), [("c-1", [8])])
    with open(os.path.join(vdir, "unknown-file"), "wb") as fh:
        fh.write(b"kept")
    assert _place(tmp_path, 2) == 0
    assert _place(tmp_path, 3) == 1
    assert [_items(vdir, SPACE, i) for i in range(3)] == [{"c-0": "a", "c-3": "d"}, {"c-1": "c"}, {"c-2": "b"}]
    assert [_items(vdir, STAYS, i) for i in range(3)] == [{"c-1": [7]}, {"c-1": [8]}, {}]
    assert _place(tmp_path, 1) == 1
    assert _items(vdir, SPACE, 0) == {"c-0": "a", "c-1": "c", "c-2": "b", "c-3": "d"}
    assert _items(vdir, STAYS, 0) == {"c-1": [7]}  # shard 1's marks: no shard 1 to keep them
    assert sorted(os.listdir(vdir)) == sorted([log_name(SPACE, 0), log_name(STAYS, 0), "unknown-file"])


def test_a_leftover_old_log_next_to_per_shard_logs_is_dropped_unread(tmp_path):
    vdir = _vdir(tmp_path)
    _write(os.path.join(vdir, log_name(SPACE, 0)), [("c-0", "new")])
    _write(os.path.join(vdir, name_hash(SPACE) + ".log"), [("c-0", "old"), ("c-2", "deleted since")])
    assert _place(tmp_path, 2) == 1
    assert _items(vdir, SPACE, 0) == {"c-0": "new"}
    assert not os.path.exists(os.path.join(vdir, name_hash(SPACE) + ".log"))


def test_a_swap_cut_by_a_crash_is_finished_or_dropped(tmp_path):
    vdir = _vdir(tmp_path)
    _write(os.path.join(vdir, log_name(SPACE, 0)), [("c-0", "live")])
    # Crash while the new directory was written: the live one is the truth.
    os.makedirs(vdir + ".new")
    _write(os.path.join(vdir + ".new", log_name(SPACE, 0)), [("c-0", "half")])
    assert _place(tmp_path, 2) == 0
    assert not os.path.exists(vdir + ".new") and _items(vdir, SPACE, 0) == {"c-0": "live"}
    # Crash between the two renames: the new directory was complete.
    os.makedirs(vdir + ".new")
    _write(os.path.join(vdir + ".new", log_name(SPACE, 0)), [("c-0", "moved")])
    os.replace(vdir, vdir + ".old")
    assert _place(tmp_path, 2) == 0
    assert _items(vdir, SPACE, 0) == {"c-0": "moved"}
    assert sorted(os.listdir(os.path.dirname(vdir))) == [name_hash(VHOST), "placed-for"]


def test_verify_reads_the_kv_logs(tmp_path, capsys):
    from shard.verify import main

    vdir = _vdir(tmp_path)
    path = os.path.join(vdir, log_name(SPACE, 0))
    _write(path, [("c-0", "a"), ("c-2", "b")])
    assert main([str(tmp_path)]) == 0
    assert "checked 2 records in 1 KV logs" in capsys.readouterr().out
    with open(path, "ab") as fh:
        fh.write(encode("c-4", "c")[:-2])  # a put torn by a crash: not damage
    assert main([str(tmp_path)]) == 0
    assert "torn-tail" in capsys.readouterr().out
    with open(path, "r+b") as fh:  # another writer's record over the first one: damage
        fh.write(encode("c-9", "zz")[:7])
    assert main([str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "damaged:" in out and "a valid record follows" in out
    _write(os.path.join(vdir, name_hash(SPACE) + ".log"), [("c-1", "old")])
    main([str(tmp_path)])
    assert "old-layout" in capsys.readouterr().out
