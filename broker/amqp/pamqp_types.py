"""pamqp's ``amqp_type`` from a table, without building a new name string per argument.

pamqp looks up the AMQP type of each argument of every method (and property) it encodes or
decodes with ``getattr(cls, '_' + name)``: a new ``str`` per argument. CPython's type attribute
cache (4,096 slots) keeps a reference to the name of the last lookup in each slot, so a few
thousand of those strings outlive the connections whose handshakes made them. Made during a wave
of 10,000 connections, they lie scattered over every pymalloc arena the wave used, and each one
keeps its 1 MiB arena from ever being returned: a frontend stayed ~40 MB above its fresh size
after 10,000 connections closed (docs/benchmarks.md "Memory"). The table is filled at import, so
the strings it was built from belong to the boot, not to any connection.

Imported for its effect by the modules that use pamqp's codec (broker/amqp/parser.py, encoder.py
and properties.py): pamqp's ``_AMQData.amqp_type`` is replaced in this process.
"""

from __future__ import annotations

from pamqp import base, commands

_TYPES: dict[tuple[type, str], str] = {}


def _amqp_type(cls: type, attr: str) -> str:
    try:
        return _TYPES[cls, attr]
    except KeyError:  # a class not in the table (none in pamqp 3.3-4.0): pamqp's own lookup, once
        kind = _TYPES[cls, attr] = getattr(cls, "_" + attr)
        return kind


def _fill() -> None:
    for cls in (*commands.INDEX_MAPPING.values(), commands.Basic.Properties):
        for name in cls.__slots__:
            _TYPES[cls, name] = getattr(cls, "_" + name)


_fill()
base._AMQData.amqp_type = classmethod(_amqp_type)  # type: ignore[method-assign, assignment]
