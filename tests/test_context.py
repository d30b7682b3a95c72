"""``ProbeContext``: one probe's parts in one object, isolated from another's."""

from __future__ import annotations

import os

import pyarrow as pa

from probing.cli.client import ProbeClient, UnixTransport
from probing.node.probe.context import ProbeContext
from probing.node.tables.external import ExternalTable


def test_two_probes_in_one_process_are_isolated(runtime_dir) -> None:
    user_dir = runtime_dir / f"probing-{os.getuid()}"
    a = ProbeContext(socket_path=str(user_dir / "a.sock"))
    b = ProbeContext(socket_path=str(user_dir / "b.sock"))
    a.serve()
    b.serve()
    try:
        steps = ExternalTable("steps", ["step"], store=a.store)
        steps.append_many([[1], [2], [3]])
        ExternalTable("steps", ["step"], store=b.store).append([7])
        assert a.store is not b.store and a.database is not b.database
        # their queries run on the process's one pool of query threads
        assert a.database.threads is b.database.threads

        def ask(ctx: ProbeContext, sql: str) -> list[dict]:
            client = ProbeClient(UnixTransport(ctx.socket_path, pid=os.getpid()))
            return client.query(sql).to_pylist()

        assert ask(a, "SELECT sum(step) AS s FROM python.steps") == [{"s": 6}]
        assert ask(b, "SELECT sum(step) AS s FROM python.steps") == [{"s": 7}]
        # each probe counts its own queries, and only its own NVML sampler exists
        assert (a.queries, b.queries) == (1, 1)
        assert a.nvml is not b.nvml and a.nvml.store is a.store
        # stopping one leaves the other serving, with its data
        a.stop()
        assert not os.path.exists(a.socket_path) and not a.serving
        assert ask(b, "SELECT count(*) AS n FROM python.steps") == [{"n": 1}]
        assert a.database.sql("SELECT count(*) AS n FROM python.steps").to_pylist() == [{"n": 3}]
    finally:
        a.stop()
        b.stop()


def test_tables_see_their_own_probes_tracer_and_peers() -> None:
    class FakeTracer:
        def probes_table(self) -> pa.Table:
            return pa.table({"family": ["gloo"]})

    a, b = ProbeContext(), ProbeContext()
    a.tracer = FakeTracer()  # type: ignore[assignment]
    assert a.database.sql("SELECT family FROM probing.uprobes").to_pylist() == [{"family": "gloo"}]
    assert b.database.sql("SELECT count(*) AS n FROM probing.uprobes").to_pylist() == [{"n": 0}]
    assert b.database.sql("SELECT count(*) AS n FROM probing.peers").to_pylist() == [{"n": 0}]


def test_the_probe_keeps_no_module_state() -> None:
    """No module of the probe's core keeps its parts in globals: an engine's
    contexts (one per process it serves) are all there is."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "probing" / "node"
    core = ["probe", "store", "sql", "tables", "cluster", "bpf"]
    found = []
    paths = [root / p for p in core if p.endswith(".py")]
    paths += [f for p in core if not p.endswith(".py") for f in (root / p).glob("**/*.py")]
    for path in sorted(paths):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Global):
                found += [f"{path.relative_to(root)}:{name}" for name in node.names]
    assert found == []


def test_two_probes_tracers_share_no_helper_and_no_stacks() -> None:
    """Each tracer has its own helper process for what it attaches, and each
    store its own record of the stacks already in python.stacks."""
    from probing.node.bpf.pystacks import STACKS_SCHEMA, PyStacks
    from probing.node.bpf.tracer import Tracer

    a, b = ProbeContext(), ProbeContext()
    ta, tb = Tracer(["gloo"], store=a.store), Tracer(["gloo"], store=b.store)
    assert ta.holder is not tb.holder and ta.holder.pid is None  # started by start()
    row = {"stack_id": [7], "depth": [0], "file": ["x.py"], "func": ["f"], "line": [1],
           "user": [True]}  # fmt: skip
    a.store.table("python", "stacks", STACKS_SCHEMA).append_batch(
        pa.RecordBatch.from_pydict(row, schema=STACKS_SCHEMA)
    )
    sa, sb = PyStacks(a.store), PyStacks(b.store)
    assert sa.known == {7} and sb.known == set()
    sa.known.add(8)  # a collector beside it (the sampler) shares the tracer's
    assert PyStacks(a.store, sa.known).known is sa.known and sb.known == set()
