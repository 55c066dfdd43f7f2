"""broker/contract.py's kind registry: one number per kind per namespace, every kind listed, its version stated."""

from __future__ import annotations

import inspect
import re

from broker import contract


def test_kind_numbers_are_unique_per_namespace():
    for namespace, kinds in contract.KINDS.items():
        numbers = [number for number, _since in kinds.values()]
        taken_twice = {n for n in numbers if numbers.count(n) > 1}
        assert not taken_twice, f"{namespace}: kind numbers used twice: {sorted(taken_twice)}"
        for name, (number, _since) in kinds.items():
            assert getattr(contract, name) == number, name  # the table names the module's own constant


def test_every_kind_constant_is_in_the_registry():
    listed = {name for kinds in contract.KINDS.values() for name in kinds}
    constants = {name for name, value in vars(contract).items()
                 if re.fullmatch(r"[A-Z][A-Z0-9_]*", name) and type(value) is int}
    assert not constants - listed - set(contract.NOT_KINDS), "kinds missing from contract.KINDS"
    assert not listed & set(contract.NOT_KINDS)
    assert contract.CONTROL_LANE_KINDS <= {number for number, _ in contract.KINDS["data"].values()}


def test_version_is_stated_for_every_kind():
    assert isinstance(contract.VERSION, int) and contract.VERSION >= 1
    # The history comment above VERSION: "# N: KIND, ..." names each kind added after version 1.
    source = inspect.getsource(contract)
    history = source[:source.index("\nVERSION = ")]
    for kinds in contract.KINDS.values():
        for name, (_number, since) in kinds.items():
            assert 1 <= since <= contract.VERSION, name
            if since > 1:
                entry = re.search(rf"\b{since}: (.*?)(?=\b{since + 1}: |\Z)", history, re.S)
                assert entry and re.search(rf"\b{name}\b", entry.group(1)), f"{name}: not in the history of {since}"
    assert re.search(rf"\b{contract.VERSION}: ", history), "VERSION bumped without a history entry"



def test_a_big_batch_then_small_ones_pack_and_unpack_the_same():
    """pack() drops its Packer after a batch over _PACKER_KEEP (its buffer would stay that big)."""
    big = [[contract.STATS, {"queues": [["/", f"q{i}", i, 0, 0] for i in range(100_000)]}]]
    small = [[contract.PROCESSED, 7]]
    for header, items in ((1, small), (2, big), (3, small), (4, big)):
        data = contract.pack(header, items)
        assert contract.unpack(data) == (header, items)
    assert len(contract.pack(0, big)) > contract._PACKER_KEEP
