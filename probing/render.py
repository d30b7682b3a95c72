"""Render query results for a terminal: aligned columns that fit the width."""

from __future__ import annotations

from typing import Any

MIN_COL = 6


def _cell(v: Any) -> str:
    if v is None:
        return "NULL"
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v).replace("\n", " ")


def format_rows(names: list[str], rows: list[list[Any]], width: int = 80) -> str:
    """Aligned text, numbers right-aligned, shrinking the widest columns to fit."""
    cells = [[_cell(v) for v in row] for row in rows]
    numeric = [
        all(isinstance(r[i], int | float) or r[i] is None for r in rows) and bool(rows)
        for i in range(len(names))
    ]
    widths = [max([len(n)] + [len(r[i]) for r in cells]) for i, n in enumerate(names)]
    budget = width - 2 * (len(names) - 1)
    while sum(widths) > budget and max(widths) > MIN_COL:
        widest = widths.index(max(widths))
        widths[widest] -= 1

    def fit(text: str, w: int, right: bool) -> str:
        if len(text) > w:
            text = text[: max(w - 1, 0)] + "…"
        return text.rjust(w) if right else text.ljust(w)

    lines = ["  ".join(fit(n, w, num) for n, w, num in zip(names, widths, numeric, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    for row in cells:
        lines.append(
            "  ".join(fit(c, w, num) for c, w, num in zip(row, widths, numeric, strict=True))
        )
    return "\n".join(line.rstrip() for line in lines)


def format_arrow(table: Any, width: int = 80) -> str:
    names = list(table.column_names)
    cols = [table.column(i).to_pylist() for i in range(table.num_columns)]
    rows = [list(r) for r in zip(*cols, strict=True)] if cols else []
    text = format_rows(names, rows, width)
    n = table.num_rows
    return f"{text}\n({n} row{'s' if n != 1 else ''})"


def format_stacks(info: dict[str, Any], frames: list[dict[str, Any]]) -> str:
    """``process.stacks`` rows as ``py-spy dump`` prints them: one block per thread."""
    cmdline = " ".join(str(info.get("cmdline") or "").split())
    out = [
        f"Process {info.get('pid')}: {cmdline[:100]}{'…' if len(cmdline) > 100 else ''}",
        f"Python v{info.get('python', '?')} ({info.get('python_executable', '?')})",
    ]
    threads: dict[Any, list[dict[str, Any]]] = {}
    for f in frames:
        threads.setdefault((f["tid"], f["thread"]), []).append(f)
    for (tid, name), rows in threads.items():
        head = rows[0]
        state = head["state"]
        if head.get("syscall") and state != "active":
            state += f", in {head['syscall']}"
        out.append("")
        out.append(f'Thread {tid if tid is not None else "?"} ({state}): "{name}"')
        for r in sorted(rows, key=lambda r: r["depth"]):
            out.append(f"    {r['func']} ({r['file']}:{r['line']})")
    return "\n".join(out)
