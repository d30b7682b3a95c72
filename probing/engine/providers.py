"""DataFusion catalog and schema providers backed by Python callables.

Two kinds of tables, as in the seed design:

* static tables: a fixed name whose rows a callable produces at query time
  (``process.info``), registered with ``ProbeSchema.add_table``;
* dynamic tables: names resolved on demand, either from the store (a table
  appears in its schema the moment something appends to it) or from a
  resolver callable (``python.`expr```).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pyarrow as pa
import pyarrow.dataset as ds
from datafusion.catalog import CatalogProvider, SchemaProvider, Table

from probing.store import Store

TableData = pa.Table | ds.Dataset
Producer = Callable[[], TableData]
Resolver = Callable[[str], TableData | None]


def as_table(data: TableData) -> Table:
    if isinstance(data, pa.Table):
        data = ds.dataset(data)
    return Table(data)


class ProbeSchema(SchemaProvider):
    """One SQL schema: static producers, store tables, then an optional resolver."""

    def __init__(self, name: str, store: Store | None = None) -> None:
        self.name = name
        self._store = store
        self._producers: dict[str, Producer] = {}
        self._resolver: Resolver | None = None
        self._lock = threading.Lock()

    def add_table(self, name: str, producer: Producer) -> None:
        with self._lock:
            self._producers[name] = producer

    def set_resolver(self, resolver: Resolver) -> None:
        self._resolver = resolver

    # -- SchemaProvider -------------------------------------------------------
    def owner_name(self) -> str | None:
        return "probing"

    # datafusion-python reads ``table_names`` as an attribute holding a
    # sequence (not a method) when it lists tables for information_schema.
    @property
    def table_names(self) -> list[str]:  # type: ignore[override]
        with self._lock:
            names = set(self._producers)
        if self._store is not None:
            names.update(t.name for t in self._store.tables(self.name))
        return sorted(names)

    def table(self, name: str) -> Table | None:
        with self._lock:
            producer = self._producers.get(name)
        if producer is not None:
            return as_table(producer())
        if self._store is not None and (tbl := self._store.get(self.name, name)) is not None:
            return Table(tbl.dataset())
        if self._resolver is not None and (data := self._resolver(name)) is not None:
            return as_table(data)
        return None

    def table_exist(self, name: str) -> bool:
        return name in self.table_names()


class ProbeCatalog(CatalogProvider):
    """The ``probing`` catalog: schemas registered by name, plus every store schema."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._schemas: dict[str, ProbeSchema] = {}
        self._lock = threading.Lock()

    def schema_for(self, name: str) -> ProbeSchema:
        """The schema ``name``, created (backed by the store) on first use."""
        with self._lock:
            sch = self._schemas.get(name)
            if sch is None:
                sch = self._schemas[name] = ProbeSchema(name, self._store)
            return sch

    def schema_names(self) -> set[str]:
        with self._lock:
            names = set(self._schemas)
        names.update(t.schema_name for t in self._store.tables())
        return names

    def schema(self, name: str) -> ProbeSchema | None:  # type: ignore[override]
        # datafusion-python accepts the provider itself here and wraps it.
        if name not in self.schema_names():
            return None
        return self.schema_for(name)
