"""What a run leaves on disk and in the Hub repo: checkpoint sizes, the disk a save needs at its peak under
--keep_last, and the repo a chain of sessions builds under --hub_keep_full.
"""

from __future__ import annotations

import math
from typing import Any

from fsdp_opt.base import gib
from fsdp_opt.model.shapes import Shape
from fsdp_opt.planner.lora import checkpoints as lora_checkpoints


def checkpoints(shape: Shape, gpus: int) -> dict[str, int]:
    n = shape.params
    return {
        "full_with_optimizer": 12 * n,
        "full_weights_only": 4 * n,
        "sharded_with_optimizer_per_rank": math.ceil(12 * n / gpus),
        "export_fp16": 2 * n,
    }


def hub_repo_bytes(
    shape: Shape,
    *,
    slices: int,
    keep_full: int,
    save_optimizer: bool = True,
    export: bool = False,
    saved: int | None = None,
) -> dict[str, int]:
    """What a chain of `slices` sessions leaves in the Hub repo (--hub_keep_full): the newest full checkpoints, one
    fp16 weights file per range, and the exported model if pushed. keep_full 0 keeps every full checkpoint.
    `saved`: the parameters a checkpoint holds (a LoRA run's adapters; default every parameter)."""
    n = shape.params if saved is None else saved
    full = (12 if save_optimizer else 4) * n
    weights = 2 * n
    fulls = slices if keep_full == 0 else min(keep_full, slices)
    out = {
        "full_checkpoints": fulls * full,
        "weights_files": (slices if keep_full else 0) * weights,
        "export": weights if export else 0,
    }
    out["total"] = sum(out.values())
    return out


def disk_and_hub(
    shape: Shape,
    inputs,
    *,
    disk: int,
    keep_last: int,
    save_optimizer: bool,
    slices: int,
    keep_full: int,
    data_bytes: int = 0,
) -> dict[str, Any]:  # noqa: ANN001
    """The plan's checkpoint sizes, disk and Hub figures, and `saved`: the parameters a checkpoint holds.
    `data_bytes`: what a session keeps of the dataset on the same disk (0 when its rows are read by range)."""
    disk = max(0, disk - data_bytes)
    if inputs.lora_rank:
        sizes = lora_checkpoints(shape, inputs)
    else:
        sizes = checkpoints(shape, inputs.gpus)
    one = sizes["full_with_optimizer"] if save_optimizer else sizes["full_weights_only"]
    saved = sizes["full_weights_only"] // 4
    # A save writes the new file before --keep_last removes the oldest; older ones that would not fit beside the new
    # one are removed before it (saving.make_room). With none fitting beside it, the newest goes once the Hub has it.
    fit_beside = max(0, disk // one - 1)
    kept = min(max(1, keep_last), fit_beside) if keep_last else fit_beside
    on_disk = one * (kept + 1)
    repo = lambda export: hub_repo_bytes(
        shape,
        slices=slices,
        keep_full=keep_full,
        save_optimizer=save_optimizer,  # noqa: E731
        export=export,
        saved=saved,
    )
    return {
        "checkpoints": sizes,
        "disk": {
            "checkpoint_bytes": one,
            "data_bytes": data_bytes,
            "peak_bytes": on_disk + data_bytes,
            "fits": one + sizes["export_fp16"] <= disk,
            "checkpoints_that_fit": fit_beside,
            "kept_while_saving": kept,
            "needs_hub_for_room": fit_beside == 0 and one <= disk,
        },
        "hub": {"slices": slices, "keep_full": keep_full, **repo(False), "with_export": repo(True)["total"]},
        "saved": saved,
    }


def disk_line(d: dict[str, Any], keep_last: int, disk: int) -> str:
    """The plan's line on the disk: the peak of a save, and what happens before saves when checkpoints do not fit."""
    verdict = (
        "DOES NOT FIT: one checkpoint is larger than the disk"
        if not d["fits"]
        else "only one checkpoint fits: before each save the previous one is removed once the Hub has it (--hf_repo); "
        "without the Hub the second save stops"
        if d["needs_hub_for_room"]
        else "fits; older checkpoints that would not fit beside a new one are removed before it"
        if not keep_last or d["checkpoints_that_fit"] < keep_last
        else "fits"
    )
    data = (
        f", with {gib(d['data_bytes'])} of data downloaded whole"
        if d.get("data_bytes")
        else ", no dataset files on it: rows read by range (--data_on_disk)"
    )
    return (
        f"disk: {gib(d['peak_bytes'])} at the peak of a save ({d['kept_while_saving']} older checkpoint(s) "
        f"kept while one is written, --keep_last {keep_last}{data}), of {gib(disk)}: {verdict}"
    )
