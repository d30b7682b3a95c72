"""Line numbers from a code object's line table, for a bytecode offset.

3.10 (``co_linetable``): pairs of (bytecode bytes, signed line delta, -128 =
no line). 3.11+ (the location table): entries whose first byte has bit 7
set; bits 3-6 the kind, bits 0-2 the length in code units - 1; kinds 0-9 and
10-12 are short forms (line delta 0 and kind - 10), 13 a signed varint line
delta without columns, 14 the long form (line delta then end line and
columns), 15 no location. Varints are 6-bit groups, bit 6 = more.
"""

from __future__ import annotations


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


def locations_line(table: bytes, firstlineno: int, offset: int) -> int | None:
    """3.11+: the line of the instruction at byte ``offset``."""
    line, addr, i = firstlineno, 0, 0
    while i < len(table):
        first = table[i]
        i += 1
        kind, end = (first >> 3) & 15, addr + 2 * ((first & 7) + 1)
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
        if addr <= offset < end:
            return here
        addr = end
    return None


def lnotab310_line(table: bytes, firstlineno: int, offset: int) -> int | None:
    """3.10: the line of the instruction at byte ``offset``."""
    line, addr = firstlineno, 0
    for i in range(0, len(table) - 1, 2):
        sdelta, ldelta = table[i], table[i + 1]
        ldelta = ldelta - 256 if ldelta > 127 else ldelta
        end = addr + sdelta
        if ldelta != -128:
            line += ldelta
        if addr <= offset < end:
            return None if ldelta == -128 else line
        addr = end
    return None


def line_of(fmt: str, table: bytes, firstlineno: int, offset: int) -> int:
    """The line at ``offset``, or ``firstlineno`` where the table has none
    (an offset before the first instruction: a frame that has not started)."""
    if offset < 0:
        return firstlineno
    find = lnotab310_line if fmt == "lnotab310" else locations_line
    try:
        line = find(table, firstlineno, offset)
    except IndexError:  # read from another process: a table cut short, or memory reused
        return firstlineno
    return firstlineno if line is None else line
