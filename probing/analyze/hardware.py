"""A straggler's hardware against the others': its GPUs (throttled, slower,
a slower link) and its CPUs (slower, stolen by a hypervisor), from the NVML
and CPU samples, as causes (``Why``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from probing.analyze.cause import Why, median
from probing.analyze.stragglers import Straggler

THROTTLE = {  # nvmlClocksEventReason* bits: why a GPU runs below its clock
    0x4: "power cap", 0x8: "hardware slowdown", 0x20: "thermal slowdown",
    0x40: "hardware thermal slowdown", 0x80: "power brake", 0x2: "application clocks",
}  # fmt: skip
GPU_EMPTY: dict[str, Any] = {"reasons": 0, "xids": 0, "ecc": 0, "xid": None}
GPU_SLOWER = 0.9  # its SM clock below this share of the others': the GPU is slower
LINK_SLOWER = 0.5  # its PCIe or NVLink rate below this share of the others'
CPU_SLOWER = 0.85  # its CPU's clock below this share of the others': a slower CPU
STEAL_MORE = 10.0  # points of steal above the others' that make a hypervisor the cause


def cpu(s: Straggler, rows: list[dict[str, Any]]) -> list[Why]:
    """The CPU the straggler runs on against the others': a lower clock, or
    more of its node's time taken by a hypervisor (steal)."""
    per = {row["rank"]: row for row in rows}
    r = s.rank
    others = [per[q] for q in per if q != r]
    if r not in per or not others:
        return []
    me, said = per[r], []

    def theirs(key: str) -> float | None:
        got = [float(o[key]) for o in others if o.get(key) is not None]
        return median(got) if got else None

    mhz = theirs("mhz")
    slower = None
    if me.get("mhz") and mhz and me["mhz"] < CPU_SLOWER * mhz:
        slower = round(mhz / me["mhz"], 2)
        said.append(
            f"its CPU runs at {me['mhz'] / 1000:.2f} GHz vs {mhz / 1000:.2f} GHz on the others"
        )
    # steal is the node's: ranks of one node differ only by the instant each
    # read it (0.1 s of a noisy figure), so it is told against other nodes only
    elsewhere = [
        float(o["steal_pct"])
        for o in others
        if o.get("node") != me.get("node") and o.get("steal_pct") is not None
    ]
    steal = median(elsewhere) if elsewhere else None
    if (
        steal is not None
        and me.get("steal_pct") is not None
        and me["steal_pct"] >= steal + STEAL_MORE
    ):
        said.append(
            f"a hypervisor takes {me['steal_pct']:.0f} % of its node's CPU time "
            f"({steal:.0f} % on the other nodes')"
        )
    if not said:
        return []
    return [Why(r, "cpu", said[0].split(" vs ")[0].split(" (")[0], None, None, 0.0, 0.0,
                slower=slower, text=f"rank {r}: " + "; ".join(said))]  # fmt: skip


def gpu(s: Straggler, rows: list[dict[str, Any]]) -> list[Why]:
    """The straggler's GPU against the others' (NVML over the window): a
    lower SM clock (and the throttle reasons only it has), XID or
    uncorrected ECC errors only it has, a slower PCIe or NVLink."""
    per: dict[int, dict[str, Any]] = {}
    for row in rows:  # several GPUs per rank: their mean clock, every reason and error
        p = per.setdefault(row["rank"], dict(GPU_EMPTY, mhz=[], pcie=[], nvlink=[], temp=[]))
        if row.get("sm_mhz") is not None:
            p["mhz"].append(float(row["sm_mhz"]))
        p["reasons"] |= int(row.get("reasons") or 0)
        p["xids"] += int(row.get("xids") or 0)
        p["xid"] = row.get("xid") or p["xid"]
        p["ecc"] = max(p["ecc"], int(row.get("ecc") or 0))
        if row.get("pcie_kbs") is not None:
            p["pcie"].append(float(row["pcie_kbs"]))
        if row.get("nvlink_kib") is not None and row.get("span_ns"):
            p["nvlink"].append(float(row["nvlink_kib"]) / (row["span_ns"] / 1e9))
        if row.get("temp_c") is not None:
            p["temp"].append(float(row["temp_c"]))
    r = s.rank
    others = [q for q in per if q != r]
    if r not in per or not others:
        return []
    me = per[r]

    def theirs(key: str) -> float:
        return median([float(np.mean(per[q][key])) for q in others if per[q][key]])

    out = []
    said: list[str] = []
    if me["mhz"] and theirs("mhz") > 0 and np.mean(me["mhz"]) < GPU_SLOWER * theirs("mhz"):
        common = -1
        for q in others:
            common &= per[q]["reasons"]
        only = [name for bit, name in THROTTLE.items() if me["reasons"] & bit & ~common]
        if me["temp"] and any("thermal" in name for name in only):
            only.append(f"{np.mean(me['temp']):.0f} C")
        why = f" ({', '.join(only)})" if only else ""
        said.append(
            f"its GPU runs at {np.mean(me['mhz']) / 1000:.2f} GHz vs "
            f"{theirs('mhz') / 1000:.2f} GHz on the others{why}"
        )
    if me["xids"] and not any(per[q]["xids"] for q in others):
        said.append(f"its GPU reported {me['xids']} XID error(s) (last: XID {me['xid']})")
    if me["ecc"] > max(per[q]["ecc"] for q in others):
        said.append(f"its GPU has {me['ecc']} uncorrected ECC error(s)")
    for key, name in (("pcie", "PCIe"), ("nvlink", "NVLink")):
        if me[key] and theirs(key) > 0 and np.mean(me[key]) < LINK_SLOWER * theirs(key):
            said.append(
                f"its {name} moves {np.mean(me[key]) / 1024:.0f} MB/s vs "
                f"{theirs(key) / 1024:.0f} MB/s on the others"
            )
    if said:
        out.append(
            Why(
                r, "gpu", said[0].split(" vs ")[0], None, None, 0.0, 0.0,
                text=f"rank {r}: " + "; ".join(said),
            )
        )  # fmt: skip
    return out
