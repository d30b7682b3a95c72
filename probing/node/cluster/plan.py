"""Split one cluster query into what each peer runs and what the asker runs.

Two shapes, chosen from the SQL:

* ``agg``: one table, no join/union/window/subquery, and a top-level
  ``GROUP BY`` that names ``rank``. A group never spans two peers, so every
  peer runs the whole query over its own rows and the asker only
  concatenates the partial results (then re-applies ``ORDER BY``/``LIMIT``).
  ``agg_node`` is the same with ``GROUP BY node``: done by each node's
  gatherer in a tree, by the asker when the fan-out is flat.
* ``scan``: anything else. DataFusion plans the query over empty tables of
  the right schema; each ``TableScan`` of the optimised plan says which
  columns are needed and which filters apply (including time windows on
  ``ts``); each peer runs ``SELECT <columns> FROM <table> WHERE <filters>``
  and the asker runs the original SQL over the union.

On a peer every table gains ``node`` and ``rank``; a table that already
has such a column keeps it as ``table_node`` / ``table_rank``
(``tagged_sql``). A job-wide table (``analyze.*``: a finding, a straggler,
a rank's evidence) is the other way round: its rows are about the ranks
they name, whichever probe keeps them (rank 0's detector keeps the
finding that blames rank 2), so its own ``node`` and ``rank`` stay as they
are and the probe that answered is ``probe_node`` / ``probe_rank``
(``tags_of``). A peer's SQL reads its tables through that tagging:
``scan_sql`` for one table's scan, ``over_tagged`` for the whole query.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

import pyarrow as pa
import pyarrow.dataset as ds
from datafusion import SessionConfig, SessionContext
from datafusion.catalog import Catalog, Schema, Table
from datafusion.unparser import Dialect, Unparser

from probing.errors import QueryError
from probing.node.sql import run
from probing.node.sql.limits import Limits, check_sql
from probing.node.sql.session import READ_ONLY, memory_exceeded, runtime_env

TAGS = (("node", pa.string()), ("rank", pa.int64()))
# a job-wide table's tags: the probe that answered, its rows' own node and rank kept
PROBE_TAGS = (("probe_node", pa.string()), ("probe_rank", pa.int64()))
# schemas whose rows are about the job's ranks, not about the probe that keeps them
JOB_WIDE = frozenset({"analyze"})
PARTIAL = "cluster_partial"  # the table the final SQL reads in agg modes

_TOKEN = re.compile(
    r"""(?P<str>'(?:[^']|'')*')|(?P<qid>"(?:[^"]|"")*"|`[^`]*`)|(?P<cmt>--[^\n]*|/\*.*?\*/)
    |(?P<word>[A-Za-z_][A-Za-z0-9_$]*)|(?P<num>\d+)|(?P<ws>\s+)|(?P<op>.)""",
    re.S | re.X,
)


@dataclass
class Token:
    kind: str
    text: str
    start: int
    depth: int

    @property
    def word(self) -> str:
        return self.text.upper() if self.kind == "word" else ""

    @property
    def name(self) -> str:
        """An identifier's name, unquoted ('' for anything else)."""
        if self.kind == "word":
            return self.text.lower()
        if self.kind == "qid":
            return self.text[1:-1]
        return ""


def tokens(sql: str) -> list[Token]:
    """SQL tokens without whitespace/comments, each with its paren depth."""
    out: list[Token] = []
    depth = 0
    for m in _TOKEN.finditer(sql):
        kind = m.lastgroup or "op"
        text = m.group()
        if kind in ("ws", "cmt"):
            continue
        if text == ")":
            depth -= 1
        out.append(Token(kind, text, m.start(), depth))
        if text == "(":
            depth += 1
    return out


@dataclass
class TableRef:
    """``schema.table`` as written in the query."""

    name: str  # "schema.table", unquoted
    start: int
    end: int
    qualified_column: bool  # written as schema.table.column


def table_refs(sql: str, schemas: set[str]) -> list[TableRef]:
    """Every ``schema.table`` whose schema is one of ``schemas``."""
    toks = tokens(sql)
    refs = []
    for i in range(len(toks) - 2):
        a, dot, b = toks[i], toks[i + 1], toks[i + 2]
        if dot.text != "." or not a.name or not b.name or a.name not in schemas:
            continue
        if i > 0 and toks[i - 1].text == ".":
            continue  # catalog.schema.table: the middle part
        qualified = i + 4 < len(toks) and toks[i + 3].text == "." and bool(toks[i + 4].name)
        refs.append(
            TableRef(
                f"{a.name}.{b.name}", a.start, b.start + len(b.text), qualified_column=qualified
            )
        )
    return refs


@dataclass
class ScanSpec:
    """What a peer reads of one table: ``SELECT columns FROM t WHERE where``."""

    columns: list[str] | None  # None: every column
    where: str | None

    def to_json(self) -> dict[str, Any]:
        return {"columns": self.columns, "where": self.where}


class Mode(str, Enum):
    """What the peers compute (a ``str`` enum: it reads, and crosses the wire, as its value)."""

    SCAN = "scan"  # each peer sends the rows (columns, filters) of each table; the asker runs SQL
    AGG = "agg"  # GROUP BY rank: each peer runs the whole query on its own rows
    AGG_NODE = "agg_node"  # GROUP BY node: each node's gatherer aggregates its node

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Work:
    """A peer's share of a cluster query: ``mode``, the user's ``sql``, and
    per table what to read (``scans``)."""

    mode: Mode
    sql: str = ""
    scans: dict[str, ScanSpec] = field(default_factory=dict)

    def for_member(self) -> Work:
        """What a member of a node runs: in ``AGG_NODE`` its rows (its gatherer aggregates)."""
        return replace(self, mode=Mode.SCAN) if self.mode is Mode.AGG_NODE else self

    def to_json(self) -> dict[str, Any]:
        return {
            "mode": self.mode.value,
            "sql": self.sql,
            "scans": {name: s.to_json() for name, s in self.scans.items()},
        }

    @classmethod
    def from_json(cls, data: Any) -> Work:
        """The work of a ``/cluster/gather`` request; ``ValueError`` when malformed."""
        try:
            scans = {
                str(name): ScanSpec(spec.get("columns"), spec.get("where"))
                for name, spec in dict(data.get("scans") or {}).items()
            }
            return cls(Mode(data["mode"]), str(data.get("sql", "")), scans)
        except (KeyError, TypeError, AttributeError, ValueError) as err:
            raise ValueError(f"bad work {data!r:.200}: {err}") from None


@dataclass
class Plan:
    mode: Mode
    sql: str  # the user's query
    scans: dict[str, ScanSpec] = field(default_factory=dict)
    final_sql: str = ""  # what the asker runs over the merged tables
    pushed: str = ""  # one line for humans: what the peers run

    def work(self) -> Work:
        """The share every peer gets."""
        return Work(self.mode, self.sql, dict(self.scans))


def job_wide(table: str) -> bool:
    """Whether ``table`` ("schema.name") is job-wide: its ``rank`` is the rank
    its rows are about (``analyze.*``), not the probe's that keeps them."""
    return table.split(".", 1)[0].strip('"`').lower() in JOB_WIDE


def tags_of(table: str) -> tuple[tuple[str, pa.DataType], ...]:
    """The columns a peer adds to ``table``'s rows: ``node``, ``rank`` (its
    own renamed ``table_*``), or for a job-wide table ``probe_node``,
    ``probe_rank`` (its own kept)."""
    return PROBE_TAGS if job_wide(table) else TAGS


def tagged_schema(schema: pa.Schema, table: str = "") -> pa.Schema:
    """``table``'s local schema as peers serve it: own node/rank renamed (kept,
    where ``table`` is job-wide), tags added."""
    fields = []
    for f in schema:
        if f.name in ("node", "rank") and not job_wide(table):
            f = f.with_name(f"table_{f.name}")
        fields.append(f)
    return pa.schema(fields + [pa.field(n, t) for n, t in tags_of(table)])


# -- on a peer: its tables tagged with node and rank ---------------------------------


def tagged_sql(table: str, columns: list[str], node: str, rank: int) -> str:
    """``SELECT`` of ``table`` ("schema.name", whose columns are ``columns``)
    as a peer serves it: its own ``node``/``rank`` renamed (kept, where it is
    job-wide), the tags added (``tags_of``)."""
    sch, name = table.split(".", 1)
    if ("node" in columns or "rank" in columns) and not job_wide(table):
        own = ", ".join(
            f'"{c}" AS "table_{c}"' if c in ("node", "rank") else f'"{c}"' for c in columns
        )
    else:
        own = "*"
    node = node.replace("'", "''")
    (node_tag, _), (rank_tag, _) = tags_of(table)
    return (
        f"SELECT {own}, '{node}' AS {node_tag}, CAST({int(rank)} AS BIGINT) AS {rank_tag} "
        f'FROM "{sch}"."{name}"'
    )


def scan_sql(table: str, tagged: str, spec: ScanSpec) -> str:
    """What a peer runs for ``spec`` of ``table``, whose tagged ``SELECT`` is ``tagged``."""
    select = ", ".join(f'"{c}"' for c in spec.columns) if spec.columns else "*"
    bare = table.split(".", 1)[1]
    sql = f'SELECT {select} FROM ({tagged}) AS "{bare}"'
    if spec.where:
        sql += f" WHERE {spec.where}"
    return sql


def over_tagged(sql: str, refs: list[TableRef], tagged: dict[str, str]) -> str:
    """``sql`` with every table of ``refs`` read through its tagged ``SELECT``
    (``tagged`` by table name), aliased as the bare table name unless the
    query gives it an alias of its own."""
    text = sql
    for ref in sorted(refs, key=lambda r: -r.start):
        source = f"({tagged[ref.name]})"
        if not _has_alias(sql, ref.end):
            source += f' AS "{ref.name.split(".", 1)[1]}"'
        text = text[: ref.start] + source + text[ref.end :]
    return text


# what may follow a table in FROM without being its alias
_ALIAS_STOP = {
    "WHERE",
    "GROUP",
    "ORDER",
    "LIMIT",
    "HAVING",
    "JOIN",
    "ON",
    "INNER",
    "LEFT",
    "RIGHT",
    "FULL",
    "CROSS",
    "UNION",
    "OFFSET",
    "WINDOW",
}


def _has_alias(sql: str, end: int) -> bool:
    rest = tokens(sql[end:])
    if not rest:
        return False
    first = rest[0]
    return first.word == "AS" or (first.kind in ("word", "qid") and first.word not in _ALIAS_STOP)


# -- on the asker: planning, and the final SQL over the peers' tables ---------------


def planning_context(
    tables: Mapping[str, pa.Table | pa.Schema], *, execute: bool = False
) -> SessionContext:
    """A fresh session whose catalog holds exactly ``tables`` ("schema.name").

    For planning, an empty table is a plain scan (its name stays in the
    plan); to ``execute``, one NULL row filtered out (one partition, which
    a sort or union above it needs)."""
    ctx = SessionContext(
        SessionConfig()
        .with_default_catalog_and_schema("probing", "probing")
        .with_target_partitions(2),
        runtime_env(Limits.from_env()),
    )
    catalog = Catalog.memory_catalog()
    ctx.register_catalog_provider("probing", catalog)
    schemas: dict[str, Any] = {"probing": Schema.memory_schema()}
    catalog.register_schema("probing", schemas["probing"])
    for qualified, data in tables.items():
        sch, name = qualified.split(".", 1)
        if sch not in schemas:
            schemas[sch] = Schema.memory_schema()
            catalog.register_schema(sch, schemas[sch])
        if isinstance(data, pa.Schema):
            data = data.empty_table()
        if data.num_rows == 0 and execute:
            null_row = pa.Table.from_pylist([{}], schema=data.schema)
            df = ctx.read_table(Table(ds.dataset(null_row))).filter("false")
            schemas[sch].register_table(name, df.into_view())
        else:
            schemas[sch].register_table(name, Table(ds.dataset(data)))
    return ctx


def _message(err: Exception) -> str:
    """DataFusion's message on one line, without its prefix."""
    return " ".join(str(err).split()).removeprefix("DataFusion error: ")


def run_final(
    sql: str, tables: Mapping[str, pa.Table | pa.Schema], threads: run.QueryThreads | None = None
) -> pa.Table:
    """Run read-only ``sql`` in a fresh session over ``tables``, under the
    probe's limits (``probing.node.sql.limits``), on a query thread of
    ``threads`` (the probe engine's; a pool of its own when None)."""
    limits = Limits.from_env()
    check_sql(sql, limits)

    def job() -> pa.Table:
        ctx = planning_context(tables, execute=True)
        try:
            return run.collect(ctx.sql_with_options(sql, READ_ONLY), limits)
        except QueryError:
            raise
        except Exception as err:  # DataFusion raises plain Exception; sorted here
            if not run.datafusion_error(err):
                raise  # a bug of probing's, not the SQL's: 500, its traceback logged
            msg = _message(err)
            if "Resources exhausted" in msg:
                raise memory_exceeded(msg, limits) from err
            raise QueryError(msg) from err

    return (threads or run.QUERY_THREADS).run(job, timeout_s=limits.timeout_s)


# shapes the peers cannot finish on their own (OFFSET: each would skip its own first rows)
_BLOCKERS = {"JOIN", "UNION", "INTERSECT", "EXCEPT", "OVER", "WITH", "DISTINCT", "OFFSET"}
_CLAUSE_END = {"HAVING", "ORDER", "LIMIT", "OFFSET", "WINDOW", "QUALIFY"}


def _group_keys(toks: list[Token]) -> list[list[Token]] | None:
    """The top-level GROUP BY items, or None without one."""
    for i, t in enumerate(toks):
        if t.depth == 0 and t.word == "GROUP" and i + 1 < len(toks) and toks[i + 1].word == "BY":
            items: list[list[Token]] = [[]]
            for u in toks[i + 2 :]:
                if u.depth == 0 and (u.word in _CLAUSE_END or u.text == ";"):
                    break
                if u.depth == 0 and u.text == ",":
                    items.append([])
                else:
                    items[-1].append(u)
            return items
    return None


def _order_items(sql: str, toks: list[Token]) -> tuple[list[tuple[str, str]], str] | None:
    """Top-level ``ORDER BY`` items as (expression text, direction) and the
    ``LIMIT``/``OFFSET`` tail, or None when there is no ORDER BY."""
    for i, t in enumerate(toks):
        if t.depth == 0 and t.word == "ORDER" and i + 1 < len(toks) and toks[i + 1].word == "BY":
            items: list[tuple[str, str]] = []
            cur: list[Token] = []
            tail = ""
            for u in toks[i + 2 :]:
                if u.depth == 0 and u.word in ("LIMIT", "OFFSET"):
                    tail = sql[u.start :].rstrip().rstrip(";")
                    break
                if u.depth == 0 and u.text == ",":
                    items.append(_order_item(sql, cur))
                    cur = []
                else:
                    cur.append(u)
            items.append(_order_item(sql, cur))
            return items, tail
    return None


def _order_item(sql: str, toks: list[Token]) -> tuple[str, str]:
    words = [t.word for t in toks]
    cut = len(toks)
    for j, w in enumerate(words):
        if w in ("ASC", "DESC", "NULLS"):
            cut = j
            break
    expr = sql[toks[0].start : toks[cut - 1].start + len(toks[cut - 1].text)] if cut else ""
    direction = (
        sql[toks[cut].start : toks[-1].start + len(toks[-1].text)] if cut < len(toks) else ""
    )
    return expr, direction


def _limit_tail(sql: str, toks: list[Token]) -> str:
    for t in toks:
        if t.depth == 0 and t.word in ("LIMIT", "OFFSET"):
            return sql[t.start :].rstrip().rstrip(";")
    return ""


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _agg_final(sql: str, toks: list[Token], out_names: list[str]) -> str | None:
    """``SELECT * FROM cluster_partial`` + the query's ORDER BY/LIMIT, or None
    when an ORDER BY item is not an output column (then: scan mode)."""
    final = f"SELECT * FROM {PARTIAL}"
    order = _order_items(sql, toks)
    if order is None:
        tail = _limit_tail(sql, toks)
        return f"{final} {tail}".strip()
    items, tail = order
    lowered = {n.lower(): n for n in out_names}
    keys = []
    for expr, direction in items:
        bare = expr.strip()
        if bare.isdigit():
            key = bare
        elif bare in out_names:
            key = _quote(bare)
        elif bare.strip('"').lower() in lowered:
            key = _quote(lowered[bare.strip('"').lower()])
        else:
            return None
        keys.append(f"{key} {direction}".strip())
    return f"{final} ORDER BY {', '.join(keys)} {tail}".strip()


def plan(sql: str, schemas: dict[str, pa.Schema | None], known_schemas: set[str]) -> Plan:
    """The plan for ``sql``; ``schemas`` maps each table the query names to its
    tagged schema (None when the asker does not know it: every column is
    fetched). ``known_schemas`` are the SQL schema names (``comm``, ...)."""
    check_sql(sql)  # before any planning: DataFusion recurses per operator
    refs = table_refs(sql, known_schemas)
    if not refs:
        raise QueryError(
            "a cluster query must name its tables as schema.table "
            "(e.g. process.threads, comm.collectives)"
        )
    names = sorted({r.name for r in refs})
    toks = tokens(sql)
    statements = sum(1 for t in toks if t.word == "SELECT")
    keys = _group_keys(toks)
    simple = (
        len(refs) == 1
        and statements == 1
        and not refs[0].qualified_column
        and not any(t.word in _BLOCKERS for t in toks)
        and schemas.get(refs[0].name) is not None
        # a job-wide table's rank (or node) spans probes: two may keep rows about one rank
        and not job_wide(refs[0].name)
    )
    if simple and keys is not None:
        key_names = {item[0].name for item in keys if len(item) == 1}
        mode = Mode.AGG if "rank" in key_names else Mode.AGG_NODE if "node" in key_names else None
        if mode is not None:
            ctx = planning_context({refs[0].name: schemas[refs[0].name]})
            try:
                out = ctx.sql(sql).schema().names
            except Exception as err:  # DataFusion raises plain Exception
                if not run.datafusion_error(err):
                    raise
                raise QueryError(_message(err)) from err
            final = _agg_final(sql, toks, out)
            if final is not None:
                by = "rank" if mode is Mode.AGG else "node"
                scans = _scan_plan(sql, names, schemas).scans if mode is Mode.AGG_NODE else {}
                pushed = f"the whole query, per {by} (GROUP BY {by})"
                return Plan(mode, sql, scans=scans, final_sql=final, pushed=pushed)
    return _scan_plan(sql, names, schemas)


def plan_scan(sql: str, schemas: dict[str, pa.Schema | None], known_schemas: set[str]) -> Plan:
    """The ``scan`` plan whatever the query's shape."""
    check_sql(sql)
    names = sorted({r.name for r in table_refs(sql, known_schemas)})
    return _scan_plan(sql, names, schemas)


def _scan_plan(sql: str, names: list[str], schemas: dict[str, pa.Schema | None]) -> Plan:
    scans: dict[str, ScanSpec] = {n: ScanSpec(None, None) for n in names}
    known = {n: s for n, s in schemas.items() if s is not None and n in scans}
    if len(known) == len(names):
        ctx = planning_context(known)
        try:
            logical = ctx.sql(sql).optimized_logical_plan()
        except Exception as err:  # DataFusion raises plain Exception
            if not run.datafusion_error(err):
                raise
            raise QueryError(_message(err)) from err
        found: dict[str, list[ScanSpec]] = {}
        _collect_scans(logical, None, found)
        for name, specs in found.items():
            if name in scans:
                scans[name] = _with_filter_columns(_merge_specs(specs), known[name], name)
    pushed = "; ".join(
        f"{n}: {', '.join(s.columns) if s.columns else '*'}"
        + (f" WHERE {s.where}" if s.where else "")
        for n, s in scans.items()
    )
    return Plan(Mode.SCAN, sql, scans=scans, final_sql=sql, pushed=pushed)


def _collect_scans(node: Any, parent: Any, found: dict[str, list[ScanSpec]]) -> None:
    variant = node.to_variant()
    if type(variant).__name__ == "TableScan":
        _, sch, tbl = variant.fqn()
        columns = [name for _, name in variant.projection()] or ["rank"]
        where = None
        target = node
        if parent is not None and type(parent.to_variant()).__name__ == "Filter":
            target = parent  # a filter the scan could not take (LIKE, ...) goes too
        if target is not node or variant.filters():
            text = str(Unparser(Dialect.default()).plan_to_sql(target))
            _, sep, rest = text.partition(" WHERE ")
            where = rest if sep else None
        found.setdefault(f"{sch}.{tbl}", []).append(ScanSpec(columns, where))
        return
    for child in node.inputs():
        _collect_scans(child, node, found)


def _with_filter_columns(spec: ScanSpec, schema: pa.Schema, table: str = "") -> ScanSpec:
    """The columns the filters name, too: a filter the scan takes whole
    leaves its columns out of the scan's projection, but the asker runs the
    original SQL, filters included, over what the peers send."""
    if spec.columns is None or not spec.where:
        return spec
    names = set(schema.names) - {n for n, _ in tags_of(table)}  # every peer sends its tags
    columns = list(spec.columns)
    for t in tokens(spec.where):
        if t.name in names and t.name not in columns:
            columns.append(t.name)
    return ScanSpec(columns, spec.where)


def _merge_specs(specs: list[ScanSpec]) -> ScanSpec:
    """One table read twice (a self-join): every column either needs, and
    the rows either keeps."""
    columns: list[str] = []
    for s in specs:
        for c in s.columns or []:
            if c not in columns:
                columns.append(c)
    wheres = [s.where for s in specs]
    where = None if any(w is None for w in wheres) else " OR ".join(f"({w})" for w in wheres)
    if len(set(wheres)) == 1:
        where = wheres[0]
    return ScanSpec(columns, where)
