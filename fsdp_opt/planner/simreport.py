"""`plan --simulate` against the plan: each memory group of the simulated step beside the plan's, and their table."""

from __future__ import annotations

from typing import Any

from fsdp_opt.base import GIB
from fsdp_opt.planner.memory import peak_bytes
from fsdp_opt.planner.simulate import GROUPS


def compare(simulated: dict[str, Any], planned: dict[str, int]) -> dict[str, Any]:
    """Each group simulated against the plan's components, and the totals (the plan's without its `runtime`)."""
    rows = {}
    for group, (_, comps) in GROUPS.items():
        plan_value = sum(planned.get(c, 0) for c in comps)
        sim_value = simulated["groups"][group]
        rows[group] = {
            "simulated": sim_value,
            "planned": plan_value,
            "ratio": plan_value / sim_value if sim_value else None,
        }

    plan_total = peak_bytes({k: v for k, v in planned.items() if k != "runtime"})
    rows["total"] = {
        "simulated": simulated["peak_total"],
        "planned": plan_total,
        "ratio": plan_total / simulated["peak_total"] if simulated["peak_total"] else None,
    }
    return rows


def render(strategy: str, rows: dict[str, Any], simulated: dict[str, Any]) -> list[str]:
    unit, digits = "GiB", 4 if simulated["peak_total"] < GIB else 2  # one unit; a small model's figures in more digits
    gib = GIB
    lines = [
        f"simulated ({'fake tensors' if simulated['fake'] else 'real tensors'}, rank 0 of {simulated['world_size']}, "
        f"{simulated['micro_batches']} micro-batch(es) of the step), {strategy}:",
        "| per GPU | simulated | planned | plan / simulated |",
        "| --- | --- | --- | --- |",
    ]
    for group, row in rows.items():
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.2f}"
        name = "**peak (plan: its total less runtime)**" if group == "total" else group
        lines.append(
            f"| {name} | {row['simulated'] / gib:,.{digits}f} {unit} | {row['planned'] / gib:,.{digits}f} {unit} | {ratio} |"
        )

    def labels(snap: dict[str, int]) -> str:
        return ", ".join(f"{k} {v / gib:.{digits}f}" for k, v in snap.items() if v >= simulated["peak_total"] / 100)

    lines.append(f"at the simulated peak ({unit}, optimizer state aside): {labels(simulated['at_peak'])}")
    for group, row in rows.items():
        if row["ratio"] is not None and abs(row["ratio"] - 1) > 0.10 and group in simulated["group_moments"]:
            lines.append(f"when {group} peaked ({unit}): {labels(simulated['group_moments'][group])}")
    return lines
