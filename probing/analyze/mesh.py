"""Each rank's place in the job's parallel layout, from its process groups.

A job that declares its layout names its groups: Megatron-Core's
``parallel_state`` gives each a ``group_desc`` (``TENSOR_MODEL_PARALLEL_GROUP``,
``PIPELINE_MODEL_PARALLEL_GROUP``, ``DATA_PARALLEL_GROUP`` ...), a torch
``DeviceMesh`` names each dimension's ``mesh_<dim>``. ``comm.groups`` carries
torch's name of each group with that description (``22
(TENSOR_MODEL_PARALLEL_GROUP)``) and the group's global ranks; a rank's
coordinate along a dimension is its index in the group of that role that
holds it: "rank 5 (TP 1 of 2, PP stage 2, DP 0)". A process's own
coordinates come the same way from its own groups (its rank in each):
``process.info``'s ``tp``, ``pp``, ``dp``, ``cp``, ``ep`` and ``coords``. Pure:
names and rank lists in, words out.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence

# role -> the descriptions that name it (lower case; a DeviceMesh's without "mesh_")
ROLES: dict[str, tuple[str, ...]] = {
    "tp": ("tensor_model_parallel_group", "tp"),
    "pp": ("pipeline_model_parallel_group", "pp"),
    "dp": ("data_parallel_group", "data_parallel_group_gloo", "dp"),
    "cp": ("context_parallel_group", "cp"),
    "ep": ("expert_model_parallel_group", "ep"),
}
ORDER = tuple(ROLES)  # how coordinates are said: these first, then a mesh's own names
_DESC = re.compile(r"\(([^()]+)\)\s*$")  # "22 (TENSOR_MODEL_PARALLEL_GROUP)" -> the description
# a DeviceMesh's dimension that has no name ("mesh_dim_0") or its whole-world group
_UNNAMED = re.compile(r"dim_\d+|default", re.IGNORECASE)


def role_of(pg: str) -> str | None:
    """The role a group's name says: ``tp``, ``pp``, ``dp``, ``cp``, ``ep``, or
    the name of a DeviceMesh's dimension that is none of them (``mesh_dp_shard``:
    ``dp_shard``); None where its description says none (or it has none)."""
    m = _DESC.search(pg or "")
    if not m:
        return None
    desc = m.group(1).strip()
    dim = desc[len("mesh_") :] if desc.lower().startswith("mesh_") else None
    said = (dim if dim is not None else desc).lower()
    known = next((role for role, names in ROLES.items() if said in names), None)
    if known is not None or dim is None or _UNNAMED.fullmatch(dim):
        return known
    return dim


def _agreed(places: Iterable[tuple[str | None, int, int]]) -> dict[str, tuple[int, int]]:
    """(role, index, size) of each group holding a rank -> role: (index, size),
    in ``ORDER`` then by name; a role whose groups disagree (two layouts) is
    left out."""
    seen: dict[str, set[tuple[int, int]]] = {}
    for role, at, size in places:
        if role is not None:
            seen.setdefault(role, set()).add((at, size))
    agreed = {role: next(iter(at)) for role, at in seen.items() if len(at) == 1}
    rank_of = {role: i for i, role in enumerate(ORDER)}
    return dict(sorted(agreed.items(), key=lambda kv: (rank_of.get(kv[0], len(ORDER)), kv[0])))


def coordinates(rank: int, ranks_of: Mapping[str, Sequence[int]]) -> dict[str, tuple[int, int]]:
    """``rank``'s (index, size) along each role its groups name; a role whose
    groups holding it disagree on its index (two layouts) is left out."""
    held = ((pg, list(ranks)) for pg, ranks in ranks_of.items())
    return _agreed((role_of(pg), m.index(rank), len(m)) for pg, m in held if rank in m)


def own_coordinates(
    groups: Iterable[tuple[str | None, int | None, int | None]],
) -> dict[str, tuple[int, int]]:
    """A process's (index, size) along each role, from its own ``comm.groups``
    rows as (``role``, ``group_rank``, ``nranks``)."""
    return _agreed((r, at, n) for r, at, n in groups if at is not None and n)


def coords_text(at: Mapping[str, tuple[int, int]]) -> str:
    """``tp 1/2, pp 0/2, dp 0/1``: each role's index / size; "" for none."""
    return ", ".join(f"{role} {i}/{n}" for role, (i, n) in at.items())


def place_text(rank: int, ranks_of: Mapping[str, Sequence[int]]) -> str:
    """``TP 1 of 2, PP stage 0, DP 0``: where ``rank`` sits, in the order
    tensor, pipeline, data, context, expert parallel; "" where no group says."""
    at = coordinates(rank, ranks_of)
    words = {"tp": "TP {i} of {n}", "pp": "PP stage {i}", "dp": "DP {i}", "cp": "CP {i}",
             "ep": "EP {i}"}  # fmt: skip
    return ", ".join(
        say.format(i=at[role][0], n=at[role][1]) for role, say in words.items() if role in at
    )
