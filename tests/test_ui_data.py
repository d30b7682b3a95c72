"""The web UI's job page (``probing.cli.ui.data.JobView``) on canned answers:
its straggler is said in the verdict's words, with the verdict's numbers;
its groups carry torch's names only once they name every Gloo context,
asked again until they do."""

from __future__ import annotations

import time
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from probing.cli.ui.data import JobView
from tests.test_analyze import job
from tests.test_watch import groups_of


class Canned:
    """What ``JobView`` asks of a ``Source``: the collectives of a job that
    ran until now, and its ranks' ``comm.groups`` (scripted per ask)."""

    remote = True
    missing: list[str] = []

    def __init__(self, table: pa.Table, groups: list[list[dict[str, Any]]]) -> None:
        shift = time.time_ns() - 10**9 - int(pc.max(table.column("ts")).as_py())
        i = table.schema.get_field_index("ts")
        self.table = table.set_column(i, "ts", pc.add(table.column("ts"), shift))
        self.groups = groups
        self.asked: list[str] = []

    def ask(self, sql: str) -> pa.Table:
        self.asked.append(sql)
        if "FROM comm.groups" in sql:
            rows = self.groups.pop(0) if len(self.groups) > 1 else self.groups[0]
            return (
                pa.Table.from_pylist(rows) if rows else pa.table({"rank": pa.array([], pa.int64())})
            )
        return self.table

    def ranks(self) -> list[Any]:
        return []


def test_the_job_pages_straggler_is_the_verdicts_sentence() -> None:
    from probing.analyze import analyze
    from probing.analyze.verdict import straggler_text

    source = Canned(job(straggler=2, lag_ms=60, seed=1), [])
    source.groups = [groups_of(source.table)]
    view = JobView(source)  # type: ignore[arg-type]
    data = view.job(60)
    [s] = data["stragglers"]
    [want] = analyze(view._named(source.table, time.time_ns())).stragglers  # as diagnose says it
    assert s["text"] == straggler_text(want, ()), s["text"]
    assert f"is {s['late_ms']:.0f} ms late each {s['step_ms']:.0f} ms step" in s["text"]
    assert s["comm"] == "gloo/pg0" and "gloo/pg0" in s["text"]


def test_the_job_page_names_groups_by_torch_only_once_they_name_every_context() -> None:
    """The first answer names ranks 0, 1 and 3 only: the page names the group
    by size and order (one group of 4, not two); the next, at the next page
    asked after GROUPS_RETRY_S, names rank 2's too: torch's name."""
    from probing.analyze import detection as dt

    table = job(straggler=2, lag_ms=60, seed=1)
    source = Canned(table, [])
    source.groups = [groups_of(source.table, [0, 1, 3]), groups_of(source.table)]
    view = JobView(source)  # type: ignore[arg-type]
    first = view.job(60)
    assert [s["comm"] for s in first["stragglers"]] == ["gloo/n4#0"], first["stragglers"]
    view._cache.clear()
    view._groups.asked_ns -= int(dt.GROUPS_RETRY_S * 1e9)  # the retry is due
    second = view.job(60)
    assert [s["comm"] for s in second["stragglers"]] == ["gloo/pg0"], second["stragglers"]
    assert sum("FROM comm.groups" in q for q in source.asked) == 2
