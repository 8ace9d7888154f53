"""Where a resumed run continues: read the checkpoint, restore every rank, decide the position.

Same slice (dataset, range, tokenization, seed): continue at the next batch of the saved epoch, with every
rank's RNG restored when the rank count is unchanged. Another slice: keep model, optimizer, scaler,
schedule and global step, and start at the slice's first batch.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fsdp_opt.checkpoint.loading import load_into
from fsdp_opt.checkpoint.save import EPOCHS_KEY, STEP_KEY
from fsdp_opt.checkpoint.state import set_rng_state
from fsdp_opt.config.parse import Config
from fsdp_opt.engine.optim import LossScaler
from fsdp_opt.engine.step import TrainState
from fsdp_opt.runtime.distributed import DistEnv, broadcast_object, print0

# A checkpoint from before row formats trained text rows on every token, with no chat template.
ROWS_BEFORE_FORMATS = {"data_format": "text", "train_on": "all", "chat_template": None}


def slice_key(
    config: Config, end_idx: int, num_samples: int, rows: dict[str, Any] | None = None, chat_template: str | None = None
) -> dict[str, Any]:
    """What must match for a resume to continue inside the same slice. `rows` is the resolved format
    (RowSpec.key); the chat template counts by its hash, and only for rows it renders."""
    dc = config.data
    rows = rows or {"data_format": "text", "columns": [dc.text_column], "train_on": "all"}
    rendered = rows["data_format"] != "text"
    key = {
        "dataset": dc.dataset,
        "start_idx": dc.start_idx,
        "end_idx": end_idx,
        "text_column": dc.text_column,
        "max_length": dc.max_length,
        "packing": dc.packing,
        "seed": config.train.seed,
        "num_samples": num_samples,
        **rows,
        "chat_template": hashlib.sha256(chat_template.encode()).hexdigest()[:16]
        if rendered and chat_template
        else None,
    }
    return key


def position(
    config: Config, header: dict[str, Any], here: dict[str, Any], num_samples: int
) -> tuple[TrainState, dict[str, Any]]:
    """Where a checkpoint (its header: train_state, slice, the step) continues on the slice `here` (slice_key): the
    next batch of the saved epoch on the same slice, else the slice's first batch; and the saved slice's key."""
    ts = header["train_state"] or {"global_step": int(header[STEP_KEY]), "epoch": 0, "offset": 0}
    saved = {**ROWS_BEFORE_FORMATS, "columns": [(header["slice"] or {}).get("text_column")], **(header["slice"] or {})}
    if isinstance(saved.get("packing"), bool):  # checkpoints from before --packing: True was concat, False pad
        saved["packing"] = "concat" if saved["packing"] else "pad"
    if saved != here:
        return TrainState(ts["global_step"], config.train.initial_epoch, 0), saved
    state = TrainState(ts["global_step"], ts["epoch"], ts["offset"], int(ts.get("within", 0)))
    if state.offset >= num_samples:
        state.epoch, state.offset, state.within = state.epoch + 1, 0, 0
    return state, saved


def restore(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: LossScaler,
    payload: dict[str, Any] | None,
    config: Config,
    env: DistEnv,
    end_idx: int,
    num_samples: int,
    rows: dict[str, Any] | None = None,
    chat_template: str | None = None,
) -> TrainState:
    """Load a checkpoint held by rank 0 into every rank and work out where training continues."""
    has_optim = (
        env.is_main
        and payload is not None
        and (payload.get("optimizer") is not None or bool(payload.get("_sharded") and payload.get("has_optimizer")))
    )
    header = None
    if env.is_main:
        header = {
            k: payload.get(k)
            for k in (
                "train_state",
                "slice",
                "scaler",
                "rng",
                "_path",
                "_sharded",
                "weights_only",
                STEP_KEY,
                EPOCHS_KEY,
            )
        }
        header["has_optimizer"] = has_optim
    header = broadcast_object(header)
    sharded_path = Path(header["_path"]) if header["_sharded"] else None
    file_path = None if header["_sharded"] or header["weights_only"] else Path(header["_path"])
    load_into(
        model,
        optimizer,
        payload,
        env,
        load_optimizer=header["has_optimizer"],
        sharded_path=sharded_path,
        file_path=file_path,
    )
    if header["scaler"]:
        scaler.load_state_dict(header["scaler"])
    here = slice_key(config, end_idx, num_samples, rows, chat_template)
    state, saved = position(config, header, here, num_samples)
    same_slice = saved == here
    rest = lambda key: {k: v for k, v in key.items() if k not in ("packing", "num_samples")}  # noqa: E731
    if not same_slice and saved.get("packing") != here["packing"] and rest(saved) == rest(here):
        print0(
            f"note: the checkpoint packed this slice with --packing {saved['packing']}; this run packs it with "
            f"--packing {here['packing']}, so its blocks differ and the slice starts again from its first batch"
        )
    rngs = header["rng"] or []
    if same_slice and len(rngs) == env.world_size:
        set_rng_state(rngs[env.rank])
    if same_slice:
        where = f"epoch {state.epoch}, sample {state.offset} of {num_samples}"
        if state.within:
            where += f", step {state.within + 1} of the generation there"
    else:
        where = f"the first batch of slice [{config.data.start_idx}, {end_idx})"
    print0(f"resumed {header['_path']} at global step {state.global_step}; continuing at {where}")
    if header["weights_only"]:
        print0(
            "  (a weights file: its fp16 weights and the global step continue; AdamW moments start from zero, the "
            "loss scale from --init_loss_scale, and the RNG is not restored, so the run is not exactly the one "
            "its full checkpoint would have continued)"
        )
    elif not header["has_optimizer"]:
        print0("  (the checkpoint has no optimizer state: AdamW moments start from zero)")
    return state
