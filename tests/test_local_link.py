"""broker/local_link.py: what a pair's link hands over as is, what it copies, and its test-mode check.

End to end (real pairs, the check on in every test node): tests/test_colocate.py and every module
whose nodes are paired (the default on the suite's 2-core machines)."""

from __future__ import annotations

from broker import contract, local_link


def test_hot_kinds_go_as_they_are_and_every_other_kind_as_a_socket_would_carry_it():
    publish = [contract.PUBLISH, "/", ["q"], "", "q", b"\x00\x00", b"body" * 10, False, 1, 65537, 7]
    ack = [contract.ACK, 1, 65537, [3, 4294967296]]
    kept = {"items": [["k", bytearray(b"v")]], "pair": (1, 2)}  # e.g. a shard's KV values, kept by it
    reply = [contract.REPLY_DATA, 9, True, kept]
    items = [publish, reply, ack]
    size = local_link._own(items)
    assert items[0] is publish and items[2] is ack
    assert items[1] is not reply
    # As msgpack gives it: lists for tuples, bytes for a bytearray, nothing shared with the sender.
    assert items[1] == [contract.REPLY_DATA, 9, True, {"items": [["k", b"v"]], "pair": [1, 2]}]
    assert local_link._same(items[1], contract.unpack(contract.pack(0, [reply]))[1][0])
    kept["items"][0][1][:] = b"X"
    assert items[1][3]["items"][0][1] == b"v"
    # on_sent's bytes: the body and properties at least, the copied item's packed size.
    assert size >= len(publish[6]) + len(publish[5]) + len(contract.pack(0, [reply])) - 8


def test_the_check_tells_types_apart_as_unpacking_would():
    same = local_link._same
    assert same([1, "a", b"b", None, True, 1.5, {"k": [2]}], [1, "a", b"b", None, True, 1.5, {"k": [2]}])
    assert not same(["q"], ("q",))
    assert not same(b"body", bytearray(b"body"))
    assert not same(b"body", memoryview(b"body"))
    assert not same(True, 1)
    assert not same({"k": [1]}, {"k": [2]})
    assert not same([1, 2], [1, 2, 3])
