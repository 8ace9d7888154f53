"""Where a resumed run continues: the checkpoint a session resumes from (`Resume`), restored into every rank, and the
position.

Same slice (dataset, range, tokenization, seed): continue at the next batch of the saved epoch, with every
rank's RNG restored when the rank count is unchanged. Another slice: keep model, optimizer, scaler,
schedule and global step, and start at the slice's first batch.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fsdp_opt.checkpoint.chain import CHAIN_KEY
from fsdp_opt.checkpoint.drift import CHANGES_KEY, global_batch_change, refuse_if_breaking, settings_drift
from fsdp_opt.checkpoint.drift import line as drift_line
from fsdp_opt.checkpoint.loading import load_into
from fsdp_opt.checkpoint.save import EPOCHS_KEY, STEP_KEY
from fsdp_opt.checkpoint.state import set_rng_state
from fsdp_opt.config.parse import Config
from fsdp_opt.data.pin import PIN_KEY
from fsdp_opt.engine.optim import LossScaler
from fsdp_opt.engine.step import TrainState
from fsdp_opt.runtime.distributed import DistEnv, all_ranks_ok, broadcast_object, print0

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


@dataclass
class Resume:
    """The checkpoint a session resumes from, as setup reads it: rank 0 holds its payload (None on the other ranks and
    without --resume_file). In the order setup asks: the flags changed since it (drift, `of`), the chain's data pin and
    the range it trained (`pin`, `trained_range`), the chain's record of changes with this session's added
    (`record_changes`, once the global batch is known), the restore into every rank (`restore_into`), and what the
    chain and W&B carry on (`handover`, which drops the payload before the first save gathers another)."""

    resuming: bool
    payload: dict[str, Any] | None  # rank 0's
    read_seconds: float = 0.0
    changes: list[dict[str, Any]] | None = None  # rank 0's: this session's flags that differ from the checkpoint's

    @classmethod
    def of(cls, payload: dict[str, Any] | None, config: Config, env: DistEnv, read_seconds: float) -> Resume:
        changes = all_ranks_ok(lambda: settings_drift(config, payload) if env.is_main else None)
        return cls(bool(config.checkpoint.resume_file), payload, read_seconds, changes)

    @property
    def pin(self) -> dict[str, Any] | None:
        """The chain's data pin (rank 0)."""
        return self.payload.get(PIN_KEY) if self.payload else None

    @property
    def trained_range(self) -> tuple[int, int] | None:
        """The range the checkpoint trained, where it has a pin (rank 0)."""
        if not self.pin or not self.payload.get("slice"):
            return None
        return self.payload["slice"]["start_idx"], self.payload["slice"]["end_idx"]

    def record_changes(
        self, config: Config, global_batch: int, env: DistEnv, more: list[dict[str, Any]] | None = None
    ) -> list[dict[str, Any]]:
        """Every rank: the global batch checked too (known once the layout is), then the chain's record of changes:
        the checkpoint's, and this session's at its first global step (rank 0's; [] elsewhere; `more`: changes found
        beside the flags, a reward function's rule)."""

        def on_main() -> list[dict[str, Any]]:
            payload, changes = self.payload, list(self.changes or []) + list(more or [])
            ts = payload.get("train_state") or {}
            mid_range = bool(ts.get("offset") or ts.get("within"))
            moved = global_batch_change(payload.get("global_batch"), global_batch, mid_range=mid_range)
            if moved is not None:
                print0(drift_line(moved))
                refuse_if_breaking([moved], config.checkpoint.allow_changes, Path(payload["_path"]).name)
                changes = [moved] + changes
            step = int(ts.get("global_step", 0))
            return list(payload.get(CHANGES_KEY) or []) + [{**c, "step": step} for c in changes]

        return all_ranks_ok(lambda: on_main() if env.is_main else None) or []

    def restore_into(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: LossScaler,
        config: Config,
        env: DistEnv,
        end_idx: int,
        num_samples: int,
        rows: dict[str, Any] | None,
        chat_template: str | None,
    ) -> TrainState:
        """Every rank takes part: the checkpoint loaded into the shards, and the position training continues at."""
        started = time.perf_counter()
        state = restore(model, optimizer, scaler, self.payload, config, env, end_idx, num_samples, rows, chat_template)
        print0(
            f"  checkpoint found and read in {self.read_seconds:.1f} s, loaded into the shards in "
            f"{time.perf_counter() - started:.1f} s"
        )
        return state

    def handover(self, env: DistEnv) -> tuple[str | None, dict[str, Any] | None]:
        """The W&B run id (rank 0's) and the chain's saved status (every rank's), then the payload is dropped."""
        run_id = self.payload.get("wandb_run_id") if env.is_main and self.payload else None
        saved_chain = broadcast_object(self.payload.get(CHAIN_KEY) if env.is_main and self.payload else None)
        self.payload = None  # rank 0's copy of the checkpoint: gone before the first save gathers another
        return run_id, saved_chain
