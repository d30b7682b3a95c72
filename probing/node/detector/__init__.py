"""The always-on detector of a traced job, run by the node's engine for its
probe: ``watch`` (the threads: its looks, its full detections, who detects),
``window`` (what it asks of the ranks and of its own rank), ``analyst`` (a
window's analysis, as ``diagnose``'s), ``groups`` (torch's names for the
job's groups), ``book`` (its findings, ``findings.jsonl``). What it
decides over tables is ``probing.analyze`` (``detection``, ``findings``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import pyarrow as pa

    from probing.node.sql import Database


class Missing(Protocol):
    """A rank that did not answer (the cluster's ``wire.MissingPeer``)."""

    @property
    def rank(self) -> int: ...
    @property
    def node(self) -> str: ...
    @property
    def addr(self) -> str: ...
    @property
    def reason(self) -> str: ...


class Answered(Protocol):
    """A rank that answered (the cluster's ``wire.PeerTiming``)."""

    @property
    def rank(self) -> int: ...


class Answers(Protocol):
    """Who answered a query over the job (the cluster's ``fanout.Collected``)."""

    @property
    def missing(self) -> Sequence[Missing]: ...
    @property
    def peers(self) -> Sequence[Answered]: ...


class Job(Protocol):
    """The detector's probe's cluster node, as the detector sees it
    (``probing.node.cluster.node.ClusterNode``): who it is, its own rows,
    and a query or a request over every rank of the job."""

    @property
    def rank(self) -> int: ...
    @property
    def pid(self) -> int: ...
    @property
    def learning(self) -> bool: ...
    @property
    def database(self) -> Callable[[], Database]: ...

    def coordinate(self, sql: str, *, timeout: float) -> tuple[pa.Table, Answers, object]: ...

    def control(
        self, path: str, body: bytes, timeout: float, ranks: set[int] | None = None
    ) -> list[dict[str, object]]: ...
