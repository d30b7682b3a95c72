"""DataFusion session, catalog/schema providers, read-only SQL."""

from probing.node.sql.providers import ProbeCatalog, ProbeSchema, as_table
from probing.node.sql.session import CATALOG, READ_ONLY, Database

__all__ = ["CATALOG", "READ_ONLY", "Database", "ProbeCatalog", "ProbeSchema", "as_table"]
