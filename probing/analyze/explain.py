"""What makes a diagnosis's stragglers slow, asked of ``probing.analyze.why``
for each (``explain_stragglers``) and for a pipeline's slow stage
(``explain_stage``), and the small stragglers whose samples show nothing of
their own told from noise (``explained``)."""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa

from probing.analyze import cause as ca
from probing.analyze import collectives as coll
from probing.analyze import pipeline as pp
from probing.analyze import stragglers as sg
from probing.analyze import why as wy
from probing.analyze.gather import unheard_ranks

# a straggler costing less than this share of the step is named only with a
# cause of its own: on a loaded machine one rank stays 2 ms late a 60 ms step,
# and its samples show nothing of its own
SMALL_SHARE = 0.10
# ... and one late only now and then (a slow step in ten) costing less than this
# is named only with something of its own: on a node loaded 5 times over, a
# healthy rank was 28 ms late at 2 in 10 steps (11 %), its samples as the others'
SMALL_SPARSE = 0.20


def explained(
    stragglers: list[sg.Straggler], why: list[ca.Why]
) -> tuple[list[sg.Straggler], list[ca.Why]]:
    """``stragglers`` and ``why`` less a small straggler (``SMALL_SHARE`` of the
    step) whose samples show no cause that explains most of its lateness
    (nothing of its own, ``why.NOTHING``, or no single cause), and less one
    late now and then costing under ``SMALL_SPARSE`` whose samples show
    nothing of its own: the machine's noise favouring a rank, not a problem
    to page anyone about. One whose samples were not read is kept (nothing
    says it is noise)."""
    from probing.analyze.verdict import MOST

    def noise(s: sg.Straggler) -> bool:
        mine = [w for w in why if w.rank == s.rank and w.kind in (*wy.CAUSES, wy.NOTHING)]
        if not mine:
            return False
        head = wy.headline(why, s.rank)
        if s.share_of_step >= SMALL_SHARE:  # late now and then, with nothing of its own
            return (
                s.late_steps < 1.0
                and s.share_of_step < SMALL_SPARSE
                and (head is None or head.kind == wy.NOTHING)
            )
        explains = head is not None and (head.share is None or head.share >= MOST)
        return head is None or head.kind == wy.NOTHING or not explains

    drop = {s.rank for s in stragglers if noise(s)}
    return [s for s in stragglers if s.rank not in drop], [w for w in why if w.rank not in drop]


def explain_stage(
    pipe: pp.Pipeline | None,
    samples: pa.Table | None,
    stragglers: Sequence[sg.Straggler] = (),
) -> list[ca.Why]:
    """What keeps a pipeline's slow stage busy: its functions against the
    other stages', per second of the window (a pipeline has no step the
    collectives would give); nothing where the stage is a straggler of
    ``stragglers``, explained per step already (a function is said once)."""
    if pipe is None or pipe.slow is None or samples is None:
        return []
    if pipe.slow in {s.rank for s in stragglers}:
        return []
    st = pipe.stage(pipe.slow)
    extra = (st.busy_share - pp.others_busy(pipe.stages, st.rank)) * 1000.0  # ms/s of work
    stage = sg.Straggler(
        rank=st.rank, node=st.node, lag_ms_mean=0.0, lag_ms_p99=0.0, excess_ms_median=extra,
        last_share=0.0, share_of_step=0.0, since="", since_ns=0, since_start=True,
        comm="", op="send/recv", collectives=0, p_value=0.0,
    )  # fmt: skip
    return wy.explain(stage, samples.to_pylist(), [], step=1000.0, unit="s")


def explain_stragglers(
    stragglers: list[sg.Straggler],
    matched: list[coll.Collective],
    samples: pa.Table | None,
    cuda: pa.Table | None,
    nvml: pa.Table | None = None,
    cpu: pa.Table | None = None,
) -> list[ca.Why]:
    """What makes each straggler slow (``why.explain``), from SAMPLES_SQL,
    CUDA_SQL, NVML_SQL and CPU_SQL rows (None: that part is left out); where
    nothing is found, why not (``why.unread``: its samples not answered...)."""
    rows = samples.to_pylist() if samples is not None else []
    calls = cuda.to_pylist() if cuda is not None else []
    gpus = nvml.to_pylist() if nvml is not None else []
    cpus = cpu.to_pylist() if cpu is not None else []
    unheard = unheard_ranks(samples) if samples is not None else set()
    out = []
    for s in stragglers:
        mine = wy.explain(s, rows, matched, calls, gpus=gpus, cpus=cpus)
        if not any(w.kind in (*wy.CAUSES, wy.NOTHING) for w in mine):  # say why not
            mine.insert(0, wy.unread(s, rows if samples is not None else None, unheard))
        out += mine
    return out
