"""A Perfetto trace's interned strings, and the slice args that are mostly
such strings, a column at a time (``perfetto.TraceWriter`` writes them).

Event names, categories, arg names and string arg values (stacks repeat for
every call) are interned: ``Interner`` gives each distinct string an id and
keeps what is new since the last chunk, for the writer to declare in that
chunk's first packet; every later use is the id. ``annotation`` encodes one
arg of every slice of a chunk (a ``debug_annotation``) with ``protowire``:
strings interned, ints, floats, bools, lists joined with ``x``.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

from probing.cli.export import protowire as wire
from probing.cli.export.protowire import FIXED64, LEN, VARINT, Message

# field numbers (perfetto's protos/perfetto/trace/track_event/debug_annotation.proto,
# and TrackEvent's debug_annotations)
ANNOTATIONS = 4
ARG_NAME_IID, ARG_BOOL, ARG_UINT, ARG_INT, ARG_DOUBLE, ARG_STRING, ARG_STRING_IID = (
    1, 2, 3, 4, 5, 6, 17)  # fmt: skip


class Interner:
    """The ids of a sequence's interned strings, by kind (an ``InternedData``
    field: names, categories, arg names, arg strings), and those not declared
    yet."""

    def __init__(self) -> None:
        self._ids: dict[str, dict[str, int]] = {}
        self._declare = pb.InternedData()  # interned since the last chunk: in its first packet

    def intern(self, kind: str, texts: list[str]) -> list[int]:
        """The interned ids of ``texts`` (``kind``: an ``InternedData`` field: names,
        categories, arg names, arg strings), declared in the next chunk's first
        packet the first time each is seen."""
        table = self._ids.setdefault(kind, {})
        out = []
        for text in texts:
            iid = table.get(text)
            if iid is None:
                iid = table[text] = len(table) + 1
                entry = getattr(self._declare, kind).add()
                entry.iid = iid
                if kind == "debug_annotation_string_values":
                    entry.str = text.encode()
                else:
                    entry.name = text
            out.append(iid)
        return out

    def intern_array(self, kind: str, values: pa.Array) -> np.ndarray:
        """Interned ids of a string column, 0 where null (dictionary-encoded: each
        distinct string looked up once)."""
        enc = pc.dictionary_encode(values)
        if isinstance(enc, pa.ChunkedArray):
            enc = enc.combine_chunks()
        words = enc.dictionary.to_pylist()  # (a dictionary array's may hold a null)
        said = [w for w in words if w is not None]
        ids = iter(self.intern(kind, said))
        iids = np.array([*(0 if w is None else next(ids) for w in words), 0], dtype=np.int64)
        return iids[enc.indices.fill_null(-1).to_numpy(zero_copy_only=False)]  # -1: the last

    def take_declared(self) -> bytes:
        """The strings interned since the last call, as a serialised
        ``InternedData`` (empty where none): they are declared once, here."""
        declared: bytes = self._declare.SerializeToString()
        self._declare = pb.InternedData()
        return declared


def annotation(strings: Interner, name: str, values: pa.Array) -> Message:
    """One arg of every slice (a debug annotation), left out where null."""
    n = len(values)
    [iid] = strings.intern("debug_annotation_names", [name])
    named = wire.tag(ARG_NAME_IID, VARINT) + wire.varint_bytes(iid)
    inner = [wire.const(named, n), *arg_value(strings, values)]
    present = values.is_valid().to_numpy(zero_copy_only=False)
    return wire.only(wire.nested(ANNOTATIONS, inner, n), present)


def arg_value(strings: Interner, values: pa.Array) -> Message:
    """An arg's value: strings interned, ints (uint64 past int64: ``uint_value``),
    floats, bools; lists joined with ``x`` (a CUDA grid: ``4x1x1``); anything
    else as its text."""
    n = len(values)
    if pa.types.is_dictionary(values.type):
        if pa.types.is_string(values.type.value_type):  # each distinct string once
            iids = strings.intern_array("debug_annotation_string_values", values)
            return [wire.const(wire.tag(ARG_STRING_IID, VARINT), n), wire.varints(iids)]
        values = values.cast(values.type.value_type)
    t = values.type
    if pa.types.is_list(t) or pa.types.is_fixed_size_list(t) or pa.types.is_large_list(t):
        values, t = joined(values), pa.string()
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        iids = strings.intern_array("debug_annotation_string_values", values)
        return [wire.const(wire.tag(ARG_STRING_IID, VARINT), n), wire.varints(iids)]
    if pa.types.is_boolean(t) or pa.types.is_integer(t):
        v = values.fill_null(pa.scalar(0, t) if pa.types.is_integer(t) else False)
        v = v.to_numpy(zero_copy_only=False)
        field = np.full(n, ARG_BOOL if pa.types.is_boolean(t) else ARG_INT, np.uint8)
        if t == pa.uint64():
            field[v >= np.uint64(1 << 63)] = ARG_UINT
        return [wire.bytes_each((field << 3)[:, None]), wire.varints(v.astype(np.uint64))]
    if pa.types.is_floating(t):
        v = values.fill_null(0).to_numpy(zero_copy_only=False)
        return [
            wire.const(wire.tag(ARG_DOUBLE, FIXED64), n),
            wire.fixed64(v.astype(np.float64)),
        ]
    text = [str(v).encode() for v in values.to_pylist()]
    return [
        wire.const(wire.tag(ARG_STRING, LEN), n),
        wire.varints(np.array([len(b) for b in text], dtype=np.int64)),
        wire.blobs(text),
    ]


def joined(values: pa.Array) -> pa.Array:
    """A list column as text, ``"x".join(str(item))`` per row (a CUDA grid: ``4x1x1``)."""
    items = values.type.value_type
    if pa.types.is_integer(items) and not pc.list_flatten(values).null_count:
        return pc.binary_join(values.cast(pa.list_(pa.string())), "x")
    rows = values.to_pylist()
    return pa.array([None if v is None else "x".join(str(x) for x in v) for v in rows], pa.string())
