"""The probe's database: one DataFusion session over the ``probing`` catalog."""

from __future__ import annotations

import re
from collections.abc import Callable

import pyarrow as pa
from datafusion import RuntimeEnvBuilder, SessionConfig, SessionContext, SQLOptions

from probing.errors import LIST_TABLES, ProbingError, QueryError
from probing.node.sql import run
from probing.node.sql.limits import LimitExceeded, Limits, check_sql
from probing.node.sql.providers import (
    ProbeCatalog,
    ProbeSchema,
    Producer,
    Resolver,
    provider_failure,
    set_code_allowed,
)
from probing.node.store import Store

CATALOG = "probing"

_MISSING_TABLE = re.compile(r"table '([^']+)' not found")

READ_ONLY = SQLOptions().with_allow_ddl(False).with_allow_dml(False).with_allow_statements(False)


# the chunk files' footers kept by each session (one a rank, and the node's
# together): bounded low, as each is filled by every chunk a long trace seals
# and an engine keeps its sessions for hours (the RSS growth of an hour's trace
# stayed with 2 MB as with 16: it is not here; docs/measurements.md, issue 52)
FOOTERS_CACHE = "2M"


class Database:
    """Read-only SQL over every table the probe knows.

    Tables are addressed ``schema.table``; the catalog is ``probing``.
    ``information_schema`` is on, so ``SHOW TABLES`` and
    ``information_schema.columns`` work.
    """

    def __init__(
        self,
        store: Store | None = None,
        *,
        target_partitions: int = 2,
        limits: Limits | None = None,
    ) -> None:
        self.store = store if store is not None else Store()
        self.limits = limits or Limits.from_env()
        self.threads = run.QUERY_THREADS  # the process's query threads
        self.catalog = ProbeCatalog(self.store)
        config = (
            SessionConfig()
            .with_default_catalog_and_schema(CATALOG, "probing")
            .with_information_schema(True)
            .with_target_partitions(target_partitions)
        )
        self.ctx = SessionContext(config, runtime_env(self.limits))
        self.ctx.register_catalog_provider(CATALOG, self.catalog)
        self.catalog.ctx = self.ctx
        # Chunk directories change between queries: never reuse a file
        # listing. Footers of immutable chunk files may be cached, a little.
        self.ctx.sql("SET datafusion.runtime.list_files_cache_limit = 0")
        self.ctx.sql(f"SET datafusion.runtime.metadata_cache_limit = '{FOOTERS_CACHE}'")

    def close(self) -> None:
        """Drop every table (the probe is retired): what they hold is freed."""
        self.catalog.close()

    def schema(self, name: str) -> ProbeSchema:
        return self.catalog.schema_for(name)

    def register_table(self, schema: str, name: str, producer: Producer) -> None:
        """A static table whose rows ``producer()`` returns at query time."""
        self.schema(schema).add_table(name, producer)

    def register_view(self, schema: str, name: str, sql: str) -> None:
        """``schema.name`` answers as ``sql`` (read at every query that names it)."""
        self.catalog.add_view(schema, name, sql)

    def defer(self, schema: str, install: Callable[[], None]) -> None:
        """``install()`` registers tables of ``schema`` at the first query
        that names the schema or lists tables; the schema is listed now."""
        self.schema(schema).defer(install)

    def register_resolver(self, schema: str, resolver: Resolver) -> None:
        """Resolve unknown names in ``schema`` on demand (dynamic tables)."""
        self.schema(schema).set_resolver(resolver)

    def kinds(self) -> list[dict[str, str]]:
        """Every table of the catalog (not the resolved ``python.`expr```):
        its ``schema``, ``table`` and ``kind`` (``ProbeSchema.kind``:
        live, view, stored), sorted; no table's rows are made."""
        out = []
        for name in sorted(self.catalog.schema_names()):
            schema = self.schema(name)
            for table in schema.table_names:
                kind = schema.kind(table)
                if kind is not None:
                    out.append({"schema": name, "table": table, "kind": kind})
        return out

    def no_table(self, name: str, query: str) -> QueryError:
        """The error of a query naming ``name`` (DataFusion's
        ``probing.schema.table``), no table of the catalog: the name as the
        query gave it, and the nearest ones there are."""
        parts = name.split(".")
        if len(parts) == 3 and parts[0] == CATALOG:
            parts = parts[1:]
        said = ".".join(parts)
        if len(parts) == 2 and parts[0] == "probing":  # the default schema
            named = rf"\bprobing\s*\.\s*\"?{re.escape(parts[1])}"
            if not re.search(named, query, re.IGNORECASE):
                said = parts[1]  # the query gave no schema
        known = [f"{k['schema']}.{k['table']}" for k in self.kinds()]
        near = nearest(said, known)
        guess = f"; did you mean {' or '.join(near)}?" if near else ""
        return QueryError(f"no table {said}{guess}", hint=LIST_TABLES)

    def sql(
        self,
        query: str,
        *,
        read_only: bool = True,
        allow_code: bool = True,
        gone: Callable[[], bool] | None = None,
    ) -> pa.Table:
        """Run one query; raise ``QueryError`` with the engine's message.

        ``allow_code=False`` refuses tables that evaluate Python
        (``python.`expr```): what a peer asking over TCP gets. The query is
        checked against ``self.limits`` before planning and runs on a query
        thread (``probing.node.sql.run``) under a time limit; ``gone()`` true
        (the client hung up) cancels it too. Over a limit: ``LimitExceeded``.
        """
        if not query or not query.strip():
            raise QueryError("empty query")
        check_sql(query, self.limits)

        def job() -> pa.Table:
            provider_failure()  # none left over from this thread's last query
            old = set_code_allowed(allow_code)
            try:
                return self._sql(query, read_only)
            finally:
                set_code_allowed(old)

        return self.threads.run(job, timeout_s=self.limits.timeout_s, gone=gone)

    def _sql(self, query: str, read_only: bool) -> pa.Table:
        for attempt in (1, 2):
            try:
                with self.catalog.snapshot(self.ctx, query):
                    if read_only:
                        df = self.ctx.sql_with_options(query, READ_ONLY)
                    else:
                        df = self.ctx.sql(query)
                return run.collect(df, self.limits)
            except QueryError:
                raise
            except Exception as err:  # DataFusion raises plain Exception; sorted here
                failure = provider_failure()
                if failure is not None:  # a provider's bug, not the SQL's
                    raise failure from err
                # what a table raises on purpose (``produce`` lets it through)
                # answers as before; anything else is a bug of probing's, not
                # the SQL's: 500, its traceback in the probe's log
                if not run.datafusion_error(err) and not isinstance(err, ON_PURPOSE):
                    raise
                msg = _clean(str(err))
                if (missing := _MISSING_TABLE.search(msg)) is not None:
                    raise self.no_table(missing.group(1), query) from err
                if "Resources exhausted" in msg:
                    raise memory_exceeded(msg, self.limits) from err
                # retention removed a chunk between snapshot and scan: once more
                if attempt == 1 and "No such file" in msg:
                    continue
                raise QueryError(msg) from err
        raise AssertionError("unreachable")


ON_PURPOSE = (ProbingError, PermissionError)  # what a table raises on purpose


def runtime_env(limits: Limits) -> RuntimeEnvBuilder:
    """DataFusion's memory pool of ``limits.memory`` bytes. Nothing spills to
    disk: a query over the pool fails rather than fill the host's /tmp."""
    return RuntimeEnvBuilder().with_disk_manager_disabled().with_greedy_memory_pool(limits.memory)


def memory_exceeded(msg: str, limits: Limits) -> LimitExceeded:
    return LimitExceeded(
        f"the query needs more than the probe's {limits.memory >> 20} MiB of working memory "
        f"({msg.splitlines()[0][:200]}); aggregate or filter more, or add a LIMIT",
        setting="PROBING_QUERY_MEMORY_MB",
        limit=limits.memory >> 20,
    )


def nearest(name: str, known: list[str], n: int = 3) -> list[str]:
    """The names of ``known`` (``schema.table``) nearest ``name``, the
    nearest first: by the whole name, or by the table's alone (a name
    given no schema, or the wrong one)."""
    from difflib import SequenceMatcher

    def ratio(a: str, b: str) -> float:
        return SequenceMatcher(None, a, b).ratio()

    name = name.lower()
    schema, _, table = name.rpartition(".")
    scores = {}
    for k in known:
        k_schema, _, k_table = k.partition(".")
        other = 0.05 if schema and schema != k_schema else 0.0  # the schema named counts a little
        scores[k] = max(ratio(name, k), ratio(table, k_table) - other)
    ranked = sorted(
        (k for k in known if scores[k] >= 0.6), key=lambda k: (-scores[k], -ratio(name, k), k)
    )
    best = scores[ranked[0]] if ranked else 0.0
    return [k for k in ranked if scores[k] >= best - 0.15][:n]


def _clean(msg: str) -> str:
    return msg.strip().removeprefix("DataFusion error: ").strip()
