"""Each rank's place in the job's parallel layout, from its process groups.

A job that declares its layout names its groups: Megatron-Core's
``parallel_state`` gives each a ``group_desc`` (``TENSOR_MODEL_PARALLEL_GROUP``,
``PIPELINE_MODEL_PARALLEL_GROUP``, ``DATA_PARALLEL_GROUP`` ...), a torch
``DeviceMesh`` names each dimension's ``mesh_<dim>``. ``comm.groups`` carries
torch's name of each group with that description (``22
(TENSOR_MODEL_PARALLEL_GROUP)``) and the group's global ranks; a rank's
coordinate along a dimension is its index in the group of that role that
holds it: "rank 5 (TP 1 of 2, PP stage 2, DP 0)". Pure: names and rank lists
in, words out.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

# role -> the descriptions that name it (lower case; a DeviceMesh's without "mesh_")
ROLES: dict[str, tuple[str, ...]] = {
    "tp": ("tensor_model_parallel_group", "tp"),
    "pp": ("pipeline_model_parallel_group", "pp"),
    "dp": ("data_parallel_group", "data_parallel_group_gloo", "dp"),
    "cp": ("context_parallel_group", "cp"),
    "ep": ("expert_model_parallel_group", "ep"),
}
_DESC = re.compile(r"\(([^()]+)\)\s*$")  # "22 (TENSOR_MODEL_PARALLEL_GROUP)" -> the description


def role_of(pg: str) -> str | None:
    """The role a group's name says (``tp``, ``pp``, ``dp``, ``cp``, ``ep``),
    None where its description says none (or it has none)."""
    m = _DESC.search(pg or "")
    if not m:
        return None
    desc = m.group(1).strip().lower().removeprefix("mesh_")
    return next((role for role, names in ROLES.items() if desc in names), None)


def coordinates(rank: int, ranks_of: Mapping[str, Sequence[int]]) -> dict[str, tuple[int, int]]:
    """``rank``'s (index, size) along each role its groups name; a role whose
    groups holding it disagree on its index (two layouts) is left out."""
    seen: dict[str, set[tuple[int, int]]] = {}
    for pg, ranks in ranks_of.items():
        role = role_of(pg)
        members = list(ranks)
        if role is not None and rank in members:
            seen.setdefault(role, set()).add((members.index(rank), len(members)))
    return {role: next(iter(at)) for role, at in seen.items() if len(at) == 1}


def place_text(rank: int, ranks_of: Mapping[str, Sequence[int]]) -> str:
    """``TP 1 of 2, PP stage 0, DP 0``: where ``rank`` sits, in the order
    tensor, pipeline, data, context, expert parallel; "" where no group says."""
    at = coordinates(rank, ranks_of)
    words = {"tp": "TP {i} of {n}", "pp": "PP stage {i}", "dp": "DP {i}", "cp": "CP {i}",
             "ep": "EP {i}"}  # fmt: skip
    return ", ".join(
        say.format(i=at[role][0], n=at[role][1]) for role, say in words.items() if role in at
    )
