"""What one query may cost the host: its size, its nesting, memory, time, result.

DataFusion plans an expression by recursion, once per operator: a 10,000-term
``1+1+…`` overflows any thread's stack and kills the process, and planning
costs grow with the square of a chain's length (3,000 terms: 7 s of CPU).
``check_sql`` bounds both before DataFusion sees the text, from the tokens
alone: the nesting depth the plan will have, and the planner's work.

The other limits are applied where the query runs (``probing.node.sql.run``):
a memory pool, a time limit with cancellation and a cap on the result. Each
has a ``PROBING_*`` setting, read when the database is built, and every refusal
names the limit and the setting that raises it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from probing import config
from probing.errors import QueryError


class LimitExceeded(QueryError):
    """A query went over one of the probe's limits; ``setting`` raises it."""

    def __init__(self, msg: str, *, setting: str, limit: float) -> None:
        super().__init__(msg, hint=f"raise {setting} in the target's environment to allow more")
        self.setting = setting
        self.limit = limit


@dataclass(frozen=True)
class Limits:
    """Per-query limits; ``Limits.from_env()`` reads the ``PROBING_*`` settings."""

    sql_bytes: int = 1 << 20  # PROBING_SQL_MAX_KB
    depth: int = 256  # PROBING_SQL_MAX_DEPTH: operators and relations nested in one plan
    work: int = 2_000_000  # PROBING_SQL_MAX_WORK: the planner's work, sum of token depths
    memory: int = 256 << 20  # PROBING_QUERY_MEMORY_MB: DataFusion's pool, for the probe
    timeout_s: float = 20.0  # PROBING_QUERY_TIMEOUT_S
    result_bytes: int = 128 << 20  # PROBING_QUERY_MAX_RESULT_MB: Arrow bytes of a result
    repeat: int = 1_000_000  # PROBING_SQL_MAX_REPEAT: what one repeat()/lpad()/range() makes

    @classmethod
    def from_env(cls) -> Limits:
        env = config.load()
        return cls(
            sql_bytes=env.sql_max_kb << 10,
            depth=env.sql_max_depth,
            work=env.sql_max_work,
            memory=int(env.query_memory_mb * (1 << 20)),
            timeout_s=env.query_timeout_s,
            result_bytes=int(env.query_max_result_mb * (1 << 20)),
            repeat=env.sql_max_repeat,
        )


# Strings, quoted names and comments are skipped whole; a run of operator
# characters counts each character (``<=`` twice: an over-estimate is safe).
_TOKEN = re.compile(
    r"""'(?:[^']|'')*'?|"(?:[^"]|"")*"?|`[^`]*`?|--[^\n]*|/\*.*?(?:\*/|\Z)
    |(?P<word>[A-Za-z_][A-Za-z0-9_$]*)|(?P<num>[0-9][0-9.eE_xX]*)|(?P<ws>\s+)
    |(?P<op>[-+*/%<>=!~^&|#@?:]+)|(?P<ch>.)""",
    re.S | re.X,
)
# binary and prefix operators written as words: each nests the plan one deeper
_OP_WORDS = frozenset(
    "AND OR NOT IS IN LIKE ILIKE SIMILAR BETWEEN COLLATE AT OVERLAPS ESCAPE".split()
)
# relations stacked at one level: each wraps the plan built so far
_REL_WORDS = frozenset("JOIN UNION INTERSECT EXCEPT".split())
# a new clause starts a new expression (the operator chain restarts)
_CLAUSES = frozenset(
    "SELECT FROM WHERE GROUP HAVING ORDER LIMIT OFFSET WINDOW QUALIFY ON USING "
    "THEN ELSE WHEN BY VALUES".split()
)


@dataclass
class _Level:
    chain: int = 0  # operators since the expression at this level began
    rel: int = 0  # relations stacked: JOIN, UNION, FROM a, b; WITH a AS, b AS
    clause: str = ""  # FROM or WITH while commas there stack relations
    closer: str = ")"


@dataclass(frozen=True)
class Shape:
    """What ``measure`` found: bytes, tokens, deepest nesting, planner work."""

    bytes: int
    tokens: int
    depth: int
    work: int


def measure(sql: str) -> Shape:
    """The plan's depth and the planner's work, estimated from the tokens.

    Depth counts, for every enclosing level (parentheses, brackets, CASE),
    one for the level, one for each operator before this point in the
    level's current expression, and one for each relation stacked there.
    Work is the sum of every token's depth: a chain of n operators costs
    about n*n/2, as it does the planner.
    """
    levels = [_Level()]
    depth = deepest = work = tokens = 0
    for m in _TOKEN.finditer(sql):
        kind = m.lastgroup
        if kind == "ws" or kind is None:
            continue  # whitespace, strings, quoted names, comments
        tokens += 1
        text = m.group()
        top = levels[-1]
        if kind == "word":
            word = text.upper()
            if word == "CASE":
                levels.append(_Level(closer="END"))
                depth += 1
            elif word == "END" and top.closer == "END" and len(levels) > 1:
                depth -= 1 + top.chain + top.rel
                levels.pop()
            elif word in _OP_WORDS:
                top.chain += 1
                depth += 1
            elif word in _REL_WORDS:
                top.rel += 1
                depth += 1
            elif word in _CLAUSES:
                depth -= top.chain
                top.chain = 0
                top.clause = "FROM" if word == "FROM" else "" if top.clause != "WITH" else "WITH"
                if word == "SELECT" and top.clause == "WITH":
                    top.clause = ""
            elif word == "WITH":
                top.clause = "WITH"
        elif kind == "op":
            top.chain += len(text)
            depth += len(text)
        elif text in "([{":
            levels.append(_Level(closer={"(": ")", "[": "]", "{": "}"}[text]))
            depth += 1
        elif text in ")]}":
            if len(levels) > 1:
                depth -= 1 + top.chain + top.rel
                levels.pop()
        elif text == ",":
            if top.clause in ("FROM", "WITH"):
                top.rel += 1
                depth += 1
            depth -= top.chain
            top.chain = 0
        deepest = max(deepest, depth)
        work += depth
    return Shape(len(sql.encode("utf-8", "surrogatepass")), tokens, deepest, work)


# functions whose output grows with an argument, allocated outside DataFusion's
# memory pool (``repeat('x', 1e9)`` took a session to 7 GB): their arguments
# must be literals no larger than the limit. ``range``/``generate_series`` as a
# table (after FROM, JOIN or a FROM list's comma) stream, bounded by the
# result cap and the time limit, and are not checked.
_AMPLIFIERS = frozenset("REPEAT LPAD RPAD ARRAY_REPEAT RANGE GENERATE_SERIES".split())
_TABLE_FUNCTIONS = frozenset(("RANGE", "GENERATE_SERIES"))
_LITERAL_WORDS = frozenset("TRUE FALSE NULL CAST AS BIGINT INT INTEGER DOUBLE FLOAT".split())


def amplifier(sql: str, limit: int) -> str | None:
    """The first call of an output-growing function whose arguments are not
    literals within ``limit`` (its text), or None."""
    toks = [
        (m.lastgroup, m.group())
        for m in _TOKEN.finditer(sql)
        if m.lastgroup not in ("ws", None) or m.group()[:1] in "'\""
    ]
    from_list = False
    for i, (kind, text) in enumerate(toks):
        word = text.upper() if kind == "word" else ""
        if word in ("FROM", "JOIN"):
            from_list = True
        elif word in _CLAUSES:
            from_list = False
        if word not in _AMPLIFIERS or i + 1 >= len(toks) or toks[i + 1][1] != "(":
            continue
        prev = toks[i - 1][1].upper() if i else ""
        if word in _TABLE_FUNCTIONS and (prev in ("FROM", "JOIN") or (prev == "," and from_list)):
            continue
        nest, j, arg = 0, i + 1, 0
        sized = (1,) if word not in _TABLE_FUNCTIONS else None  # the size argument(s)
        while j < len(toks):
            k, t = toks[j]
            if t == "(":
                nest += 1
            elif t == ")":
                nest -= 1
                if nest == 0:
                    break
            elif t == "," and nest == 1:
                arg += 1
            elif sized is None or arg in sized:
                bad = k == "word" and t.upper() not in _LITERAL_WORDS  # a column: per row
                if k == "num":
                    try:
                        bad = abs(float(t.replace("_", ""))) > limit
                    except ValueError:
                        bad = True
                if bad:
                    return "".join(x for _, x in toks[i : j + 1])
            j += 1
    return None


def check_sql(sql: str, limits: Limits | None = None) -> Shape:
    """Refuse ``sql`` before planning when it is too big, too deep or too costly
    to plan; returns what it measured. Linear in the text, a few µs per token."""
    lim = limits or Limits.from_env()
    size = len(sql)  # characters: a cheap first bound before any scan
    if size > lim.sql_bytes:
        raise LimitExceeded(
            f"the query is {size >> 10} KiB of SQL, over the limit of {lim.sql_bytes >> 10} KiB",
            setting="PROBING_SQL_MAX_KB",
            limit=lim.sql_bytes >> 10,
        )
    shape = measure(sql)
    if shape.bytes > lim.sql_bytes:
        raise LimitExceeded(
            f"the query is {shape.bytes >> 10} KiB of SQL, "
            f"over the limit of {lim.sql_bytes >> 10} KiB",
            setting="PROBING_SQL_MAX_KB",
            limit=lim.sql_bytes >> 10,
        )
    if shape.depth > lim.depth:
        raise LimitExceeded(
            f"the query nests {shape.depth} operators or relations deep, over the limit "
            f"of {lim.depth} (DataFusion plans by recursion); split long chains such as "
            "a+b+c+... or x=1 OR x=2 OR ... (use IN (...)) or nested subqueries",
            setting="PROBING_SQL_MAX_DEPTH",
            limit=lim.depth,
        )
    if shape.work > lim.work:
        raise LimitExceeded(
            f"planning the query would take too long: its work estimate is {shape.work}, "
            f"over the limit of {lim.work}; use fewer or shorter expressions",
            setting="PROBING_SQL_MAX_WORK",
            limit=lim.work,
        )
    if (call := amplifier(sql, lim.repeat)) is not None:
        raise LimitExceeded(
            f"{call[:80]}...: functions whose output grows with an argument (repeat, lpad, "
            f"rpad, array_repeat, range) take only literal sizes up to {lim.repeat}",
            setting="PROBING_SQL_MAX_REPEAT",
            limit=lim.repeat,
        )
    return shape
