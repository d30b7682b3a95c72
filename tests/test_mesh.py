"""Each rank's place in the mesh, from canned ``comm.groups`` rows: the roles
Megatron-Core's and a device mesh's group descriptions name, a rank's
coordinates along them, the straggler verdict that says them, and a
function said once where the straggler is also a pipeline's slow stage."""

from __future__ import annotations

import re

import pyarrow as pa
import pytest

from probing.analyze import analyze, mesh
from tests.test_analyze import T0, job
from tests.test_pipeline import MS, gpipe
from tests.test_why import STEPS_PER_S, _samples


def megatron(tp: int, pp: int, dp: int) -> dict[str, list[int]]:
    """``comm.groups``' ``pg`` -> ranks of a Megatron-Core job laid out
    tp-dp-pp (its default order: tensor parallel innermost), with the groups
    that say no role beside them."""
    world = tp * pp * dp
    out: dict[str, list[int]] = {"0": list(range(world))}  # the default group
    n = 1
    for p in range(pp):
        for d in range(dp):
            out[f"{n} (TENSOR_MODEL_PARALLEL_GROUP)"] = [(p * dp + d) * tp + t for t in range(tp)]
            n += 1
        for t in range(tp):
            out[f"{n} (DATA_PARALLEL_GROUP)"] = [(p * dp + d) * tp + t for d in range(dp)]
            n += 1
    for i in range(tp * dp):
        out[f"{n} (PIPELINE_MODEL_PARALLEL_GROUP)"] = [i + p * tp * dp for p in range(pp)]
        out[f"{n + 1} (EMBEDDING_GROUP)"] = [i, i + (pp - 1) * tp * dp]
        n += 2
    out[f"{n} (MODEL_PARALLEL_GROUP)"] = list(range(world))
    return out


@pytest.mark.parametrize(
    ("pg", "role"),
    [
        ("22 (TENSOR_MODEL_PARALLEL_GROUP)", "tp"), ("5 (PIPELINE_MODEL_PARALLEL_GROUP)", "pp"),
        ("7 (DATA_PARALLEL_GROUP)", "dp"), ("8 (DATA_PARALLEL_GROUP_GLOO)", "dp"),
        ("9 (CONTEXT_PARALLEL_GROUP)", "cp"), ("1 (mesh_tp)", "tp"), ("2 (mesh_dp)", "dp"),
        ("3 (DATA_PARALLEL_GROUP_WITH_CP)", None), ("4 (MODEL_PARALLEL_GROUP)", None),
        ("6 (TENSOR_AND_DATA_PARALLEL_GROUP)", None), ("0", None), ("", None),
    ],
)  # fmt: skip
def test_the_role_a_groups_description_names(pg: str, role: str | None) -> None:
    assert mesh.role_of(pg) == role


def test_each_ranks_coordinates_in_a_tp_pp_dp_mesh() -> None:
    groups = megatron(tp=2, pp=2, dp=2)
    assert mesh.coordinates(5, groups) == {"tp": (1, 2), "dp": (0, 2), "pp": (1, 2)}
    assert mesh.place_text(5, groups) == "TP 1 of 2, PP stage 1, DP 0"
    assert mesh.place_text(2, groups) == "TP 0 of 2, PP stage 0, DP 1"
    assert mesh.place_text(2, {"0": [0, 1, 2, 3], "1": [0, 2]}) == ""  # no role said


def test_the_straggler_verdict_says_where_the_rank_sits() -> None:
    table = job(straggler=1, lag_ms=30, seed=2)
    d = analyze(table, now_ns=T0, ranks_of=megatron(tp=2, pp=2, dp=1))
    [s] = d.stragglers
    assert s.rank == 1 and s.place == "TP 1 of 2, PP stage 0, DP 0"
    assert d.verdict.startswith("rank 1 (TP 1 of 2, PP stage 0, DP 0) on node host0 is "), d.verdict
    plain = analyze(table, now_ns=T0, ranks_of={"0": [0, 1, 2, 3]})
    assert re.match(r"rank 1 on node host0 is \d+ ms late ", plain.verdict), plain.verdict


def test_a_straggler_that_is_also_the_slow_stage_says_its_function_once() -> None:
    """Rank 1 is late at the all-reduces and is the pipeline's slow stage: its
    function is said per step (as a straggler's), not again per second."""
    rows = job(straggler=1, lag_ms=30, seed=2).to_pylist()
    p2p = gpipe([10, 40, 10, 10], steps=20)
    rows += [{**r, "ts": T0 + r["ts"], "comm": 0x77, "nranks": 4, "pid": 1000 + r["rank"],
              "node": f"host{r['rank'] // 2}"} for r in p2p]  # fmt: skip
    keys = {k for r in rows for k in r}
    table = pa.Table.from_pylist([{k: r.get(k) for k in keys} for r in rows])
    span, steps = 60 / STEPS_PER_S, 60
    per = {
        r: [("off", "/job/model.py", "attention_block", 41, (30.0 if r == 1 else 0.3) * steps),
            ("cpu", "/job/model.py", "mlp", 12, 5.0 * steps)]
        for r in range(4)
    }  # fmt: skip
    d = analyze(table, now_ns=T0 + 200 * MS, samples=_samples(per, span))
    assert [s.rank for s in d.stragglers] == [1] and d.pipeline is not None
    assert d.pipeline.slow == 1, d.pipeline.text()
    said = [w.text for w in d.why if "attention_block" in w.text]
    assert len(said) == 1 and "ms/step" in said[0], d.why
