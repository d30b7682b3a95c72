"""A Perfetto trace (TrackEvent protobuf), written packet by packet.

``TraceWriter`` builds packets with the ``perfetto`` package's trace builder
(``TraceProtoBuilder``) and streams them to the file every ``BATCH`` packets
(serialised ``Trace`` messages concatenate into one), so a long window never
sits whole in memory; a packet is built in place, never copied. The layout:

* one process track per rank, named ``rank R @ node``;
* a thread track per traced thread under its rank;
* slices (begin + end packets; a call still in flight is a begin only,
  which the UI draws as "did not end"), with ``debug_annotations`` as args;
* flows: slices given the same flow id are chained by Perfetto in time
  order (n slices, n - 1 arrows): one id per collective (comm, seq);
* counter tracks (NVML) under each rank.

Event names, categories, arg names and string arg values (stacks repeat
for every call) are interned: each is written once on the sequence and
referred to by id after (the intern table holds one copy of each distinct
string). A clock snapshot declares the timestamps wall-clock (REALTIME) time.

Real pids and tids are kept unless two ranks (on different nodes) share
one; those get synthetic ids above ``SYNTHETIC_BASE``.
"""

from __future__ import annotations

import hashlib
from typing import IO, Any

from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb
from perfetto.trace_builder.proto_builder import TraceProtoBuilder

SEQUENCE_ID = 7919
BATCH = 4096  # packets built before they are written
SYNTHETIC_BASE = 1 << 22  # above Linux's pid_max default (4M)
TE = pb.TrackEvent


def flow_id(comm: str, seq: int) -> int:
    """A 64-bit id for collective ``seq`` of communicator ``comm``, the same in every rank."""
    digest = hashlib.blake2b(f"{comm}#{seq}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") or 1


class TraceWriter:
    """Tracks, slices, flows and counters, streamed to ``file``."""

    def __init__(self, file: IO[bytes]) -> None:
        self._file = file
        self._builder = TraceProtoBuilder()
        self._pending = 0
        self._next_uuid = 1
        self._first = True
        self._procs: dict[int, tuple[int, int]] = {}  # rank -> (uuid, pid as written)
        self._threads: dict[tuple[int, int], int] = {}  # (rank, tid) -> uuid
        self._tid_owner: dict[int, int] = {}  # tid as written -> rank
        self._counters: dict[tuple[int, str], int] = {}
        self._synthetic = SYNTHETIC_BASE
        self._interned: dict[str, dict[str, int]] = {}
        self.thread_names: dict[tuple[int, int], str] = {}  # (rank, tid) -> name
        self.slices: dict[int, int] = {}  # rank -> slices written
        self.flow_slices: dict[int, int] = {}  # rank -> slices carrying a flow id
        self.counter_values: dict[int, int] = {}  # rank -> counter values written

    def flush(self) -> None:
        """Write the packets built so far."""
        if self._pending:
            self._file.write(self._builder.serialize())
            self._builder = TraceProtoBuilder()
            self._pending = 0

    def _packet(self, ts: int | None = None) -> pb.TracePacket:
        if self._pending >= BATCH:
            self.flush()
        self._pending += 1
        p = self._builder.add_packet()
        p.trusted_packet_sequence_id = SEQUENCE_ID
        if self._first:
            p.sequence_flags = pb.TracePacket.SEQ_INCREMENTAL_STATE_CLEARED
            self._first = False
        else:
            p.sequence_flags = pb.TracePacket.SEQ_NEEDS_INCREMENTAL_STATE
        if ts is not None:
            p.timestamp = ts
        return p

    def _iid(self, p: pb.TracePacket, kind: str, text: str) -> int:
        """The interned id of ``text`` (names, categories, arg names, arg strings),
        declaring it in ``p`` the first time it is seen."""
        table = self._interned.setdefault(kind, {})
        iid = table.get(text)
        if iid is None:
            iid = table[text] = len(table) + 1
            entry = getattr(p.interned_data, kind).add()
            entry.iid = iid
            if kind == "debug_annotation_string_values":
                entry.str = text.encode()
            else:
                entry.name = text
        return iid

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

    def note_track(self, name: str) -> int:
        """A top-level track (not under a rank), e.g. what the export left out."""
        uuid = self._uuid()
        p = self._packet()
        p.track_descriptor.uuid = uuid
        p.track_descriptor.name = name
        return uuid

    def slice(
        self,
        rank: int,
        track: int,
        ts: int,
        dur: int | None,
        name: str,
        category: str,
        args: dict[str, Any],
        flow: int | None = None,
    ) -> None:
        """A slice from ``ts`` for ``dur`` ns (``None``: still running)."""
        p = self._packet(ts)
        e = p.track_event
        e.type = TE.TYPE_SLICE_BEGIN
        e.track_uuid = track
        e.name_iid = self._iid(p, "event_names", name)
        e.category_iids.append(self._iid(p, "event_categories", category))
        for k, v in args.items():
            if v is None:
                continue
            a = e.debug_annotations.add()
            a.name_iid = self._iid(p, "debug_annotation_names", k)
            if isinstance(v, str):
                a.string_value_iid = self._iid(p, "debug_annotation_string_values", v)
            elif isinstance(v, bool):
                a.bool_value = v
            elif isinstance(v, int):
                if -(1 << 63) <= v < 1 << 63:
                    a.int_value = v
                else:
                    a.uint_value = v
            elif isinstance(v, float):
                a.double_value = v
            else:
                a.string_value = str(v)
        if flow is not None:
            e.flow_ids.append(flow)
            self.flow_slices[rank] = self.flow_slices.get(rank, 0) + 1
        if dur is not None:
            end = self._packet(ts + max(0, dur))
            end.track_event.type = TE.TYPE_SLICE_END
            end.track_event.track_uuid = track
        self.slices[rank] = self.slices.get(rank, 0) + 1

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

    def counter(self, rank: int, track: int, ts: int, value: float) -> None:
        p = self._packet(ts)
        e = p.track_event
        e.type = TE.TYPE_COUNTER
        e.track_uuid = track
        e.double_counter_value = float(value)
        self.counter_values[rank] = self.counter_values.get(rank, 0) + 1


def read_trace(data: bytes) -> pb.Trace:
    """A written trace parsed back with Perfetto's protos."""
    trace = pb.Trace()
    trace.ParseFromString(data)
    return trace
