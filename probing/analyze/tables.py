"""The ``analyze.*`` tables of a diagnosis (``sql_tables``): its findings'
dataclasses as tables, the rows it gathered, each rank's evidence."""

from __future__ import annotations

import pyarrow as pa

from probing.analyze import cause as ca
from probing.analyze import hangs as hg
from probing.analyze import links as ln
from probing.analyze import pipeline as pp
from probing.analyze import stragglers as sg
from probing.analyze.diagnose import Diagnosis


def sql_tables(d: Diagnosis, table: pa.Table) -> dict[str, pa.Table]:
    """``analyze.stragglers``, ``analyze.slow_links``, ``analyze.hangs``,
    ``analyze.ranks``, ``analyze.collectives`` (the gathered rows),
    ``analyze.why``, ``analyze.stages`` and ``analyze.transfers`` (pipelines):
    the findings' dataclasses as tables (``probing.schema``)."""
    from probing.schema import table_of

    return {
        "stragglers": table_of(sg.Straggler, d.stragglers),
        "slow_links": table_of(ln.SlowLink, d.slow_links),
        "hangs": table_of(hg.Hang, d.hangs),
        "ranks": pa.Table.from_pylist(d.ranks, schema=RANKS_SCHEMA),
        "collectives": table,
        "why": table_of(ca.Why, d.why),
        "stages": table_of(pp.Stage, d.pipeline.stages if d.pipeline else []),
        "transfers": table_of(pp.Transfer, d.transfers),
    }


RANKS_SCHEMA = pa.schema(
    [
        ("rank", pa.int64()), ("node", pa.string()), ("collectives", pa.int64()),
        ("last_pct", pa.float64()), ("lag_ms_mean", pa.float64()), ("lag_ms_p99", pa.float64()),
        ("excess_ms_median", pa.float64()), ("count", pa.int64()), ("in_collective", pa.bool_()),
    ]
)  # fmt: skip
