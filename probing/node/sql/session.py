"""The probe's SQL engine: one DataFusion session over the ``probing`` catalog."""

from __future__ import annotations

from collections.abc import Callable

import pyarrow as pa
from datafusion import RuntimeEnvBuilder, SessionConfig, SessionContext, SQLOptions

from probing.errors import ProbingError, QueryError
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

READ_ONLY = SQLOptions().with_allow_ddl(False).with_allow_dml(False).with_allow_statements(False)


class Engine:
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
        self.threads = run.QueryThreads()  # the threads this engine's queries run on
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
        self.ctx.sql("SET datafusion.runtime.metadata_cache_limit = '16M'")

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
            except Exception as err:  # noqa: BLE001 - DataFusion raises plain Exception; sorted here
                failure = provider_failure()
                if failure is not None:  # a provider's bug, not the SQL's
                    raise failure from err
                # what a table raises on purpose (``produce`` lets it through)
                # answers as before; anything else is a bug of probing's, not
                # the SQL's: 500, its traceback in the probe's log
                if not run.datafusion_error(err) and not isinstance(err, ON_PURPOSE):
                    raise
                msg = _clean(str(err))
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


def _clean(msg: str) -> str:
    return msg.strip().removeprefix("DataFusion error: ").strip()
