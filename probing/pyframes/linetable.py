"""Line numbers from a code object's line table, for a bytecode offset.

3.10 (``co_linetable``): pairs of (bytecode bytes, signed line delta, -128 =
no line). 3.11+ (the location table): entries whose first byte has bit 7
set; bits 3-6 the kind, bits 0-2 the length in code units - 1; kinds 0-9 and
10-12 are short forms (line delta 0 and kind - 10), 13 a signed varint line
delta without columns, 14 the long form (line delta then end line and
columns), 15 no location. Varints are 6-bit groups, bit 6 = more.
"""

from __future__ import annotations

import bisect


def _varint(data: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        b = data[i]
        i += 1
        value |= (b & 63) << shift
        shift += 6
        if not b & 64:
            return value, i


def _svarint(data: bytes, i: int) -> tuple[int, int]:
    v, i = _varint(data, i)
    return (-(v >> 1) if v & 1 else v >> 1), i


Spans = tuple[list[int], list["int | None"]]  # each span's end (byte offset, ascending), its line


def locations_spans(table: bytes, firstlineno: int) -> Spans:
    """3.11+: the whole table decoded once, a span per entry (None: no
    line); a table cut short (read from another process, or memory reused)
    gives the spans before the cut."""
    ends: list[int] = []
    lines: list[int | None] = []
    line, addr, i = firstlineno, 0, 0
    try:
        while i < len(table):
            first = table[i]
            i += 1
            kind = (first >> 3) & 15
            here: int | None = line
            if kind == 15:
                here = None
            elif kind == 14:
                delta, i = _svarint(table, i)
                line += delta
                here = line
                for _ in range(3):
                    _, i = _varint(table, i)
            elif kind == 13:
                delta, i = _svarint(table, i)
                line += delta
                here = line
            elif kind >= 10:
                line += kind - 10
                here = line
                i += 2
            else:
                i += 1
            addr += 2 * ((first & 7) + 1)
            ends.append(addr)
            lines.append(here)
    except IndexError:
        pass
    return ends, lines


def lnotab310_spans(table: bytes, firstlineno: int) -> Spans:
    """3.10: the whole table decoded once, a span per pair (None: no line)."""
    ends: list[int] = []
    lines: list[int | None] = []
    line, addr = firstlineno, 0
    for i in range(0, len(table) - 1, 2):
        sdelta, ldelta = table[i], table[i + 1]
        ldelta = ldelta - 256 if ldelta > 127 else ldelta
        addr += sdelta
        if ldelta != -128:
            line += ldelta
        ends.append(addr)
        lines.append(None if ldelta == -128 else line)
    return ends, lines


def spans(fmt: str, table: bytes, firstlineno: int) -> Spans:
    """A code object's line table decoded once (``line_at`` reads it)."""
    return (lnotab310_spans if fmt == "lnotab310" else locations_spans)(table, firstlineno)


def line_at(spans: Spans, firstlineno: int, offset: int) -> int:
    """The line at ``offset`` (a bisection of ``spans``), or ``firstlineno``
    where the table has none (an offset before the first instruction: a
    frame that has not started; or past a table cut short)."""
    line = _line(spans, offset)
    return firstlineno if line is None else line


def _line(spans: Spans, offset: int) -> int | None:
    """The line of the span ``offset`` falls in; None where none holds it or it has none."""
    ends, lines = spans
    k = bisect.bisect_right(ends, offset)
    return lines[k] if 0 <= offset and k < len(ends) else None


def locations_line(table: bytes, firstlineno: int, offset: int) -> int | None:
    """3.11+: the line of the instruction at byte ``offset``."""
    return _line(locations_spans(table, firstlineno), offset)


def lnotab310_line(table: bytes, firstlineno: int, offset: int) -> int | None:
    """3.10: the line of the instruction at byte ``offset``."""
    return _line(lnotab310_spans(table, firstlineno), offset)


def line_of(fmt: str, table: bytes, firstlineno: int, offset: int) -> int:
    """The line at ``offset``, or ``firstlineno`` where the table has none."""
    return line_at(spans(fmt, table, firstlineno), firstlineno, offset)
