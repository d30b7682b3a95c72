"""The SQL reference of every table, read from docs/sql.md when asked.

docs/sql.md is the source of truth (``tests/test_docs.py`` fails when a table
a probe answers is missing from it): this module parses it, it keeps no copy.
A checkout reads ``docs/sql.md`` beside the package; a wheel carries the same
file as ``probing/cli/mcp/sql.md`` (``force-include`` in pyproject.toml).

Each ``## `` section names its tables in backticks in its heading; a table
named only at the start of a paragraph (``nccl.inflight``) belongs to the
first section that names it so. A column's meaning is what follows its name in
parentheses: ``tid`` (native id).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from probing.errors import ProbingError

HERE = Path(__file__).resolve().parent
PLACES = (HERE / "sql.md", HERE.parents[2] / "docs" / "sql.md")  # a wheel's, a checkout's

# a span in backticks (``double`` ones may hold a single backtick: python.`expr`)
_SPAN = re.compile(r"``\s?(.+?)\s?``|`([^`]+)`")
_TABLE = re.compile(r"^[a-z_]+\.(?:[a-z_<>]+|`[^`]+`)$")
_COLUMN = re.compile(r"^[a-z_][a-z0-9_]*$")
_FENCE = re.compile(r"^```.*?^```\s*$", re.M | re.S)


@dataclass
class TableDoc:
    """One table's entry: the section that documents it and the meaning of
    each column the page explains."""

    name: str
    title: str  # the section's heading, backticks dropped
    text: str  # the section, Markdown, heading included
    columns: dict[str, str] = field(default_factory=dict)  # name -> meaning ("" where none)

    @property
    def uri(self) -> str:
        return f"probing://sql/{self.name}"


@dataclass
class Reference:
    """Every table docs/sql.md documents, in the page's order; ``source``: the file read."""

    source: Path
    preamble: str
    tables: dict[str, TableDoc]

    def find(self, name: str) -> TableDoc | None:
        """The entry of table ``name`` (``schema.table``, any case); a table
        of ``python.`` with no entry of its own is an ``ExternalTable``
        (``python.<name>``) or an expression (``python.`expr```)."""
        key = name.strip().strip('"')
        got = self.tables.get(key) or self.tables.get(key.lower())
        if got is not None or not key.lower().startswith("python."):
            return got
        generic = "python.`expr`" if "`" in key else "python.<name>"
        return self.tables.get(generic)


def spans(text: str) -> list[tuple[str, int, int]]:
    """The backticked spans of ``text``: (content, start, end)."""
    return [(m.group(1) or m.group(2), m.start(), m.end()) for m in _SPAN.finditer(text)]


def table_names(text: str) -> list[str]:
    """The ``schema.table`` names in backticks in ``text``, in order."""
    out: list[str] = []
    for content, _, _ in spans(text):
        name = content.strip()
        if _TABLE.match(name) and name not in out:
            out.append(name)
    return out


def _paren(text: str, start: int) -> tuple[str, int] | None:
    """The balanced parenthesised text at ``start`` (after blanks), and where it ends."""
    i = start
    while i < len(text) and text[i] in " \t":
        i += 1
    if i >= len(text) or text[i] != "(":
        return None
    depth = 0
    for j in range(i, len(text)):
        depth += {"(": 1, ")": -1}.get(text[j], 0)
        if depth == 0:
            return " ".join(text[i + 1 : j].split()), j + 1
    return None


def column_meanings(text: str) -> dict[str, str]:
    """Column names in backticks in ``text`` (``a, b, c`` lists too) with
    the parenthesised words after them; code blocks and the spans inside a
    meaning are not columns."""
    text = _FENCE.sub("", text)
    out: dict[str, str] = {}
    pos = 0
    for m in _SPAN.finditer(text):
        if m.start() < pos:
            continue  # inside the meaning just read
        names = [n.strip() for n in (m.group(1) or m.group(2)).split(",")]
        names = [n for n in names if _COLUMN.match(n)]
        if not names:
            continue
        meaning = _paren(text, m.end())
        for n in names:
            out.setdefault(n, "")
        if meaning is not None:
            out[names[-1]] = out[names[-1]] or meaning[0]
            pos = meaning[1]
    return out


def _chunks(body: str, names: list[str]) -> list[tuple[list[str], str]]:
    """``body`` cut where a sentence, paragraph or table row starts with
    some of ``names``: (the tables it is about, [] for all of them; text)."""
    if len(names) < 2:
        return [([], body)]
    alt = "|".join(re.escape(f"`{n}`") for n in names)
    starts = re.compile(rf"(?:(?<=\n)|(?<=\n\| )|(?<=\. )|^)(?=(?:{alt}))")
    cuts = sorted({0, *(m.start() for m in starts.finditer(body))})
    out = []
    for a, b in zip(cuts, [*cuts[1:], len(body)], strict=True):
        piece = body[a:b]
        lead = re.match(rf"((?:{alt})(?:\s*(?:,|and)\s*(?:{alt}))*)", piece)
        about = table_names(lead.group(1)) if lead else []
        out.append((about, piece))
    return out


def parse(text: str, source: Path) -> Reference:
    """The reference in docs/sql.md's ``text``."""
    parts = re.split(r"^## ", text, flags=re.M)
    preamble, sections = parts[0], parts[1:]
    tables: dict[str, TableDoc] = {}
    mentioned: list[tuple[str, TableDoc]] = []
    for sec in sections:
        heading, _, body = sec.partition("\n")
        names = table_names(heading)
        title = _SPAN.sub(lambda m: m.group(1) or m.group(2), heading).strip()
        full = f"## {sec.rstrip()}\n"
        own = [n for n in names if n not in tables]
        shared = "".join(t for about, t in _chunks(body, names) if not about)
        for name in own:
            mine = "".join(t for about, t in _chunks(body, names) if name in about)
            doc = TableDoc(name, title, full, column_meanings(shared + "\n" + mine))
            tables[name] = doc
        for para in re.split(r"\n\s*\n", body):  # a paragraph that starts with tables
            lead = re.match(r"\s*((?:`[^`]+`(?:\s*(?:,|and)\s*)?)+)", para)
            for name in table_names(lead.group(1)) if lead else []:
                mentioned.append((name, TableDoc(name, title, full, column_meanings(body))))
    for name, doc in mentioned:  # named only where a paragraph starts: the first such
        tables.setdefault(name, doc)
    return Reference(source, preamble.strip(), tables)


_CACHE: dict[Path, tuple[float, Reference]] = {}


def load(path: Path | None = None) -> Reference:
    """The reference of docs/sql.md (``path``, else the wheel's copy or the
    checkout's page), parsed again when the file changes."""
    candidates = [path] if path is not None else list(PLACES)
    for p in candidates:
        try:
            mtime = p.stat().st_mtime
        except OSError:
            continue
        hit = _CACHE.get(p)
        if hit is None or hit[0] != mtime:
            hit = (mtime, parse(p.read_text(encoding="utf-8"), p))
            _CACHE[p] = hit
        return hit[1]
    raise ProbingError(
        "the SQL reference (docs/sql.md) is not installed: looked at "
        + ", ".join(str(p) for p in candidates),
        hint="reinstall probing from its wheel, or run it from a checkout; meanwhile "
        "the columns of a live probe are in information_schema.columns",
    )
