"""A Perfetto trace (TrackEvent protobuf), written a chunk of rows at a time.

``TraceWriter`` writes a chunk's slices and counters with one vectorised
encoding per field (``protowire``: the protobuf wire format, numpy over the
rows) and the few other packets (tracks, the clock, a note) with Perfetto's
own protos; serialised ``Trace`` messages concatenate into one, so each
chunk goes to the file as it is written and a long window never sits whole
in memory. The layout:

* one process track per rank, named ``rank R @ node``;
* a thread track per traced thread under its rank;
* slices (begin + end packets; a call still in flight is a begin only,
  which the UI draws as "did not end"), with ``debug_annotations`` as args;
* flows: slices given the same flow id are chained by Perfetto in time
  order (n slices, n - 1 arrows): one id per collective (comm, seq);
* counter tracks (NVML) under each rank;
* named slice tracks under a rank (``track``): its training thread's Python
  functions, the spans it was not tracing (``flame``).

Event names, categories, arg names and string arg values (stacks repeat
for every call) are interned (``interning``): each is written once on the
sequence, in the first packet of the chunk that first uses it, and referred
to by id after (the intern table holds one copy of each distinct string).
A clock snapshot declares the timestamps wall-clock (REALTIME) time.

Real pids and tids are kept unless two ranks (on different nodes) share
one; those get synthetic ids above ``SYNTHETIC_BASE``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import IO, Any, NamedTuple

import numpy as np
import pyarrow as pa
from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

from probing.cli.export import protowire as wire
from probing.cli.export.interning import Interner, annotation
from probing.cli.export.protowire import FIXED64, LEN, VARINT, Bytes, Message

SEQUENCE_ID = 7919
SYNTHETIC_BASE = 1 << 22  # above Linux's pid_max default (4M)
MAX_LAYOUTS = 8  # a chunk's rows written in up to this many parts (``SliceChunk.layouts``)
TE = pb.TrackEvent
# field numbers (perfetto's protos/perfetto/trace/trace_packet.proto, track_event/*.proto)
PACKET, TIMESTAMP, SEQ_ID, TRACK_EVENT, INTERNED, SEQ_FLAGS = 1, 8, 10, 11, 12, 13
CATEGORY_IIDS, TYPE, NAME_IID, TRACK_UUID, DOUBLE_VALUE, FLOW_IDS = (
    3, 9, 10, 11, 44, 47)  # fmt: skip


def flow_ids(comms: list[str], comm: np.ndarray, seq: np.ndarray) -> np.ndarray:
    """64-bit ids of collectives (``comm``: indices into ``comms``; ``seq``), the
    same in every rank and never 0: each communicator's name hashed once
    (blake2b), mixed with the sequence number by splitmix64's finalizer."""
    names = [hashlib.blake2b(c.encode(), digest_size=8).digest() for c in comms]
    base = np.array([int.from_bytes(d, "little") for d in names], dtype=np.uint64)
    x = base[comm] ^ (seq.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15))
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    x[x == 0] = 1
    return x


def _field(field: int, wire_type: int, value: int = 0) -> bytes:
    """A whole field of constant value (a tag; for a varint, the value too)."""
    return wire.tag(field, wire_type) + (wire.varint_bytes(value) if wire_type == VARINT else b"")


def _rows(message: Message, sl: slice) -> Message:
    return [Bytes(part.size[sl], part.data[sl]) for part in message]


class TraceWriter:
    """Tracks, slices, flows and counters, streamed to ``file``."""

    def __init__(self, file: IO[bytes]) -> None:
        self._file = file
        self._pending: list[pb.TracePacket] = []  # built, not yet written
        self._next_uuid = 1
        self._first = True
        self._procs: dict[int, tuple[int, int]] = {}  # rank -> (uuid, pid as written)
        self._threads: dict[tuple[int, int], int] = {}  # (rank, tid) -> uuid
        self._tid_owner: dict[int, int] = {}  # tid as written -> rank
        self._counters: dict[tuple[int, str], int] = {}
        self._synthetic = SYNTHETIC_BASE
        self._strings = Interner()  # declared in the first packet of the chunk that uses each
        self.thread_names: dict[tuple[int, int], str] = {}  # (rank, tid) -> name
        self.slices: dict[int, int] = {}  # rank -> slices written
        self.flow_slices: dict[int, int] = {}  # rank -> slices carrying a flow id
        self.counter_values: dict[int, int] = {}  # rank -> counter values written

    def flush(self) -> None:
        """Write the packets built so far."""
        if self._pending:
            out = []
            for p in self._pending:
                data = p.SerializeToString()
                out += [wire.tag(PACKET, LEN), wire.varint_bytes(len(data)), data]
            self._file.write(b"".join(out))
            self._pending = []

    def _packet(self, ts: int | None = None) -> pb.TracePacket:
        p = pb.TracePacket()
        self._pending.append(p)
        p.trusted_packet_sequence_id = SEQUENCE_ID
        if self._first:
            p.sequence_flags = pb.TracePacket.SEQ_INCREMENTAL_STATE_CLEARED
            self._first = False
        else:
            p.sequence_flags = pb.TracePacket.SEQ_NEEDS_INCREMENTAL_STATE
        if ts is not None:
            p.timestamp = ts
        return p

    def clock(self, ts: int) -> None:
        """Declare the timestamps REALTIME (wall clock), so the UI can show UTC."""
        p = self._packet(ts)
        for clock_id in (pb.BUILTIN_CLOCK_BOOTTIME, pb.BUILTIN_CLOCK_REALTIME):
            c = p.clock_snapshot.clocks.add()
            c.clock_id = clock_id
            c.timestamp = ts
        p.clock_snapshot.primary_trace_clock = pb.BUILTIN_CLOCK_REALTIME

    def _uuid(self) -> int:
        self._next_uuid += 1
        return self._next_uuid

    def _fresh_id(self) -> int:
        self._synthetic += 1
        return self._synthetic

    @property
    def events(self) -> int:
        return sum(self.slices.values()) + sum(self.counter_values.values())

    def process(self, rank: int, node: str, pid: int) -> int:
        """The process track of ``rank`` (written once)."""
        if rank in self._procs:
            return self._procs[rank][0]
        taken = {p for _, p in self._procs.values()}
        shown = pid if pid not in taken else self._fresh_id()
        uuid = self._uuid()
        p = self._packet()
        d = p.track_descriptor
        d.uuid = uuid
        d.process.pid = shown
        d.process.process_name = f"rank {rank} @ {node}"
        d.process.process_labels.append(f"pid {pid}")
        d.sibling_order_rank = rank
        self._procs[rank] = (uuid, shown)
        return uuid

    def thread(self, rank: int, tid: int) -> int:
        """The thread track of ``tid`` in ``rank`` (its process track must exist)."""
        key = (rank, tid)
        if key in self._threads:
            return self._threads[key]
        shown = tid if self._tid_owner.setdefault(tid, rank) == rank else self._fresh_id()
        uuid = self._uuid()
        p = self._packet()
        d = p.track_descriptor
        d.uuid = uuid
        d.parent_uuid = self._procs[rank][0]
        d.thread.pid = self._procs[rank][1]
        d.thread.tid = shown
        name = self.thread_names.get(key)
        d.thread.thread_name = f"{name} ({tid})" if name else f"tid {tid}"
        self._threads[key] = uuid
        return uuid

    def counter_track(self, rank: int, name: str, unit: str = "") -> int:
        key = (rank, name)
        if key in self._counters:
            return self._counters[key]
        uuid = self._uuid()
        p = self._packet()
        d = p.track_descriptor
        d.uuid = uuid
        d.parent_uuid = self._procs[rank][0]
        d.name = name
        if unit:
            d.counter.unit_name = unit
        self._counters[key] = uuid
        return uuid

    def track(self, rank: int, name: str) -> int:
        """A slice track of its own under ``rank``'s process (its process track
        must exist): the training thread's Python functions, its untraced spans."""
        uuid = self._uuid()
        d = self._packet().track_descriptor
        d.uuid = uuid
        d.parent_uuid = self._procs[rank][0]
        d.name = name
        return uuid

    def add_track_slices(self, track: int, chunk: SliceChunk) -> None:
        """A chunk of slices (its ``thread`` and ``threads`` unused) on ``track``,
        in the chunk's order where its rows have the same fields (not counted
        with the threads' calls in ``slices``)."""
        for part in chunk.layouts():
            self._add_slices(part, np.full(len(part.ts), track, dtype=np.int64))

    def note_track(self, name: str) -> int:
        """A top-level track (not under a rank), e.g. what the export left out."""
        uuid = self._uuid()
        p = self._packet()
        p.track_descriptor.uuid = uuid
        p.track_descriptor.name = name
        return uuid

    def add_slices(self, chunk: SliceChunk) -> None:
        """A chunk of slices on its threads' tracks (declared as first met): begin
        packets (with their args and flows) and, for the calls that ended, end
        packets (begin, end, begin, ...), the rows that have the same fields
        together (``SliceChunk.layouts``)."""
        tracks = []
        for t in chunk.threads:
            self.process(t.rank, t.node, t.pid)
            tracks.append(self.thread(t.rank, t.tid))
        uuids = np.array(tracks, dtype=np.int64)
        for part in chunk.layouts():
            self._add_slices(part, uuids[part.thread])
        ranks = [t.rank for t in chunk.threads]
        _count(self.slices, ranks, np.bincount(chunk.thread, minlength=len(ranks)))
        flows = np.bincount(chunk.thread[chunk.flow != 0], minlength=len(ranks))
        _count(self.flow_slices, ranks, flows)

    def _add_slices(self, chunk: SliceChunk, track: np.ndarray) -> None:
        n = len(chunk.ts)
        if not n:
            return
        const = wire.const
        flow = wire.only(
            [const(wire.tag(FLOW_IDS, FIXED64), n), wire.fixed64(chunk.flow.astype(np.uint64))],
            chunk.flow != 0,
        )  # fmt: skip
        event = [
            const(wire.tag(CATEGORY_IIDS, VARINT), n),
            wire.varints(self._strings.intern_array("event_categories", chunk.category)),
            *[
                part
                for name, values in chunk.args
                for part in annotation(self._strings, name, values)
            ],
            const(_field(TYPE, VARINT, TE.TYPE_SLICE_BEGIN), n),
            const(wire.tag(NAME_IID, VARINT), n),
            wire.varints(self._strings.intern_array("event_names", chunk.name)),
            *self._track(track),
            *flow,
        ]
        end_event = [const(_field(TYPE, VARINT, TE.TYPE_SLICE_END), n), *self._track(track)]
        end_ts = chunk.ts + np.maximum(chunk.dur, 0)
        end = wire.nested(PACKET, _packet(end_ts, wire.nested(TRACK_EVENT, end_event, n), n), n)
        self._write(_packet(chunk.ts, wire.nested(TRACK_EVENT, event, n), n),
                    wire.only(end, chunk.ended), n)  # fmt: skip

    def add_counters(
        self, rank: np.ndarray, track: np.ndarray, ts: np.ndarray, value: np.ndarray
    ) -> None:
        """Counter values (one packet each) on the counter tracks ``track``."""
        n = len(ts)
        if not n:
            return
        event = [
            wire.const(_field(TYPE, VARINT, TE.TYPE_COUNTER), n),
            *self._track(track),
            wire.const(wire.tag(DOUBLE_VALUE, FIXED64), n),
            wire.fixed64(value.astype(np.float64)),
        ]
        self._write(_packet(ts, wire.nested(TRACK_EVENT, event, n), n), [], n)
        ranks, per = np.unique(rank, return_counts=True)
        _count(self.counter_values, ranks.tolist(), per)

    @staticmethod
    def _track(track: np.ndarray) -> Message:
        return [wire.const(wire.tag(TRACK_UUID, VARINT), len(track)), wire.varints(track)]

    def _write(self, packet: Message, after: Message, n: int) -> None:
        """n packets (each followed by ``after``'s row, if any), the strings
        interned for them declared in the first."""
        if self._first:  # the sequence starts here: its first packet clears the state
            self._packet()
        self.flush()
        declared = self._strings.take_declared()
        start = 0
        if declared:  # the first packet, with the interned data before its flags
            first = _rows(packet, slice(0, 1))
            interned = wire.tag(INTERNED, LEN) + wire.varint_bytes(len(declared)) + declared
            first = [*first[:-1], wire.const(interned, 1), first[-1]]
            head = wire.join([*wire.nested(PACKET, first, 1), *_rows(after, slice(0, 1))])
            self._file.write(head.data)
            start = 1
        if start < n:
            rest = wire.nested(PACKET, _rows(packet, slice(start, n)), n - start)
            self._file.write(wire.join([*rest, *_rows(after, slice(start, n))]).data)

    def instant(self, track: int, ts: int, name: str, args: dict[str, Any]) -> None:
        p = self._packet(ts)
        e = p.track_event
        e.type = TE.TYPE_INSTANT
        e.track_uuid = track
        e.name = name
        for k, v in args.items():
            a = e.debug_annotations.add()
            a.name = k
            a.string_value = str(v)


def _packet(ts: np.ndarray, event: Message, n: int) -> Message:
    """TracePacket fields around a track event (flags last: the interned data goes before)."""
    return [
        wire.const(wire.tag(TIMESTAMP, VARINT), n),
        wire.varints(ts),
        wire.const(_field(SEQ_ID, VARINT, SEQUENCE_ID), n),
        *event,
        wire.const(_field(SEQ_FLAGS, VARINT, pb.TracePacket.SEQ_NEEDS_INCREMENTAL_STATE), n),
    ]


def _count(counts: dict[int, int], ranks: list[int], each: np.ndarray) -> None:
    """``counts[ranks[i]] += each[i]``."""
    for r, k in zip(ranks, each.tolist(), strict=True):
        counts[r] = counts.get(r, 0) + k


class ThreadTrack(NamedTuple):
    """A traced thread of a rank: the track its slices go on."""

    rank: int
    tid: int
    node: str
    pid: int


@dataclass
class SliceChunk:
    """A chunk of slices, column by column (one entry per slice, in the order written)."""

    thread: np.ndarray  # int64: each slice's thread, an index into ``threads``
    threads: list[ThreadTrack]
    ts: np.ndarray  # int64 ns
    dur: np.ndarray  # int64 ns (anything where not ``ended``)
    ended: np.ndarray  # bool: False for a call still in flight (a begin only)
    name: pa.Array  # string
    category: pa.Array  # string
    args: list[tuple[str, pa.Array]]  # in the order shown; null: left out of that slice
    flow: np.ndarray  # uint64 flow ids (``flow_ids``), 0: none

    def take(self, rows: np.ndarray) -> SliceChunk:
        """The slices ``rows`` (indices, in the order given)."""
        index = pa.array(rows)
        return SliceChunk(
            thread=self.thread[rows], threads=self.threads, ts=self.ts[rows], dur=self.dur[rows],
            ended=self.ended[rows], name=self.name.take(index),
            category=self.category.take(index),
            args=[(k, v.take(index)) for k, v in self.args], flow=self.flow[rows],
        )  # fmt: skip

    def layouts(self) -> list[SliceChunk]:
        """The chunk cut by which fields its rows have (args not null, a flow, an
        end), in the order of each kind's first row, so that every part lays out
        in one (n, width) matrix with no mask (``protowire.join``): the chunk
        whole where there would be more than ``MAX_LAYOUTS`` parts. Perfetto
        sorts the packets by time; a slice's end stays right after its begin."""
        n = len(self.ts)
        has = [v.is_valid().to_numpy(zero_copy_only=False) for _, v in self.args if v.null_count]
        mixed = [h for h in [*has, self.flow != 0, self.ended] if h.any() and not h.all()]
        if not mixed or len(mixed) > 16:  # (a key of 16 bits at most: counted, not hashed)
            return [self]
        key = np.zeros(n, dtype=np.int64)
        for bit, h in enumerate(mixed):
            key |= h.astype(np.int64) << bit
        kinds = np.flatnonzero(np.bincount(key))
        if len(kinds) > MAX_LAYOUTS:
            return [self]
        rows = [np.flatnonzero(key == k) for k in kinds.tolist()]
        return [self.take(r) for r in sorted(rows, key=lambda r: int(r[0]))]


def read_trace(data: bytes) -> pb.Trace:
    """A written trace parsed back with Perfetto's protos."""
    trace = pb.Trace()
    trace.ParseFromString(data)
    return trace
