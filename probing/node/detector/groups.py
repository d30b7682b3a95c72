"""torch's names for a job's Gloo contexts, kept by its detector between
asks (``Groups``): the look's thread and the full detection's name windows
by them, under one lock. A window's Gloo contexts are
``probing.analyze.detection.contexts``."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from probing.analyze.detection import GROUP_KEYS, GROUPS_KEEP, GROUPS_RETRY_S, GROUPS_S, contexts

if TYPE_CHECKING:
    import pyarrow as pa


class Groups:
    """torch's names for the job's Gloo contexts (``comm.groups``, asked of
    every rank), kept between asks: a context belongs to one process group
    for its life, so what an answer said stays true. A window is named by
    them only where they name every Gloo context in it (``names``): a
    context one rank's answer left out (it had traced none yet, it did not
    answer in time) would make that rank's rows a communicator of their own
    (``gloo/n4#0`` beside ``gloo/pg0``) and split the group; such a window
    keeps the names by size and order, the same for every rank. Asked
    again every ``GROUPS_S`` (a job makes groups as it goes), and sooner,
    from ``GROUPS_RETRY_S`` on and twice as long after each answer that
    named none of them, while a window holds a context they do not name."""

    KEYS = GROUP_KEYS

    def __init__(self) -> None:
        self.rows: dict[tuple[Any, ...], dict[str, Any]] = {}  # a context -> its comm.groups row
        self.asked_ns = 0
        self.retry_s = GROUPS_RETRY_S
        self.lock = threading.Lock()  # the look's and the full detection's threads name windows
        # the last window's Gloo contexts: a detection asks of one window several times
        self._window: tuple[pa.Table | None, set[tuple[Any, ...]]] = (None, set())

    def due(self, table: pa.Table, now: int) -> bool:
        """Whether to ask for them again, for the window ``table`` at ``now``."""
        with self.lock:
            since = now - self.asked_ns
            if not self.asked_ns or since >= GROUPS_S * 1e9:
                return True
            return since >= self.retry_s * 1e9 and bool(self._unnamed(table))

    def learn(self, got: pa.Table | None, table: pa.Table, now: int) -> None:
        """What an ask answered (``got``; None: a probe without the table),
        asked for the window ``table``."""
        rows = got.to_pylist() if got is not None else []
        with self.lock:
            before = len(self._unnamed(table))
            if len(self.rows) + len(rows) > GROUPS_KEEP:
                self.rows = {}
            for g in rows:
                self.rows[tuple(g.get(c) for c in self.KEYS)] = g
            named = len(self._unnamed(table)) < before
            self.retry_s = GROUPS_RETRY_S if named else min(2 * self.retry_s, GROUPS_S)
            self.asked_ns = now

    def unnamed(self, table: pa.Table) -> bool:
        """Whether ``table`` holds a Gloo context no group known names."""
        with self.lock:
            return bool(self._unnamed(table))

    def names(self, table: pa.Table) -> pa.Table:
        """``table`` with its Gloo contexts named by torch's groups (``pg``,
        ``gather.with_groups``) where the groups known name every one."""
        import pyarrow as pa

        from probing.analyze.gather import with_groups

        with self.lock:
            if not self.rows or self._unnamed(table):
                return table
            groups = pa.Table.from_pylist(list(self.rows.values()))
        return with_groups(table, groups)

    def _unnamed(self, table: pa.Table) -> set[tuple[Any, ...]]:
        """The Gloo contexts of ``table`` no group known names. Holding the lock."""
        of, held = self._window
        if of is not table:
            held = contexts(table)
            self._window = (table, held)
        return {k for k in held if k not in self.rows}
