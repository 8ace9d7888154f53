"""Settings drift: the flags of a session that resumes a chain (--resume_file, or --start_idx auto) against the flags
its checkpoint was trained with.

Each flag that changed is one line with both values. Changes that break the chain's exactness stop the run before it
builds anything, unless --allow_changes: the model, the dataset, what the rows are and which tokens train, the block
length and packing, the seed (the data order), and the global batch when the session resumes inside a range (its
position is counted in samples of that batch). Other changes are choices (the learning rate and its schedule, the
time limit, the held-out rows, ...): applied from this session on, and recorded with every checkpoint (so on the
model card and in W&B).

How a step is laid out on this machine (batch per GPU, accumulation, sharding, precision, kernels, the output folder)
is not compared: the same global batch gives the same steps on any machine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fsdp_opt.base import ConfigError
from fsdp_opt.config.methods import method_flags
from fsdp_opt.config.parse import Config
from fsdp_opt.model.adapters import KEY
from fsdp_opt.runtime.distributed import print0

CHANGES_KEY = "settings_changes"  # of a checkpoint's payload: every change the chain has taken, oldest first

# flag -> what changing it breaks
BREAKING = {
    "model": "the weights go on as another model",
    "dataset": "the row indices point into other rows",
    "dataset_config": "the row indices point into other rows",
    "dataset_split": "the row indices point into other rows",
    "dataset_files": "the row indices point into other rows",
    "chosen_column": "other tokens train",
    "rejected_column": "other tokens train",
    "method": "another loss trains",
    "text_column": "other tokens train",
    "data_format": "other tokens train",
    "prompt_column": "other tokens train",
    "completion_column": "other tokens train",
    "messages_column": "other tokens train",
    "train_on": "other tokens train",
    "chat_template": "other tokens train",
    "max_length": "the blocks change",
    "packing": "the blocks change",
    "seed": "the data order changes",
    # each method's own flags, as its spec classes them (config/methods/)
    **{flag: kind for flag, kind in method_flags().items() if kind is not None},
}
# Not compared: where this session is in the chain, and how this machine lays a step out.
NOT_COMPARED = {
    # num_epochs: the epochs one session trains, or an auto chain's passes (which only say where the chain ends)
    "start_idx",
    "end_idx",
    "resume_file",
    "initial_epoch",
    "num_epochs",
    "take_over",
    "allow_changes",
    "overwrite",
    "output_dir",
    "device",
    "batch_size",
    "accum_steps",
    "global_batch",
    "sharding_strategy",
    "precision",
    "activation_checkpointing",
    "cpu_offload",
    "reduce_every_microbatch",
    "reduce_dtype",
    "compile",
    "prefetch",
    "max_gpu_memory",
    "tflops",
    "link_gbps",
    "loss_chunk_tokens",
    "attn_implementation",
    "async_save",
    "pad_to_max_length",
    # how its workers start
    "nproc_per_node",
    # each method's flags of how this machine runs it (config/methods/: the same results, up to the last bits)
    *(flag for flag, kind in method_flags().items() if kind is None),
    # the LoRA identity has its own check, with its own message (model/adapters.check_resume)
    "lora_rank",
    "lora_alpha",
    "lora_dropout",
    "lora_targets",
    "base_bits",
}


# Flags that change how a session runs, never what a range trains: a finished range run again with another of these
# is still done (trained_with_other_settings).
SESSION_ONLY = {
    "range_size",
    "session_ranges",
    "eval_rows",
    "eval_split",
    "save_every_steps",
    "time_limit",
    "keep_last",
    "disk_budget",
    "state_dict_type",
    "save_optimizer",
    "export_hf",
    "export_dtype",
    "export_merge",
    "hf_repo",
    "hub_public",
    "hub_retries",
    "hub_wait",
    "hub_keep_full",
    "wandb_project",
    "wandb_mode",
    "wandb_new_run",
}
# What a range trains that the drift leaves to its own check (the LoRA identity: model/adapters.check_resume), asked
# again of a finished range
LORA_FLAGS = ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets", "base_bits")


# A local model folder or data file is often found at another path on the next machine: the same name counts as the
# same one. What it holds is checked anyway: the checkpoint's shapes against the model, the data pin against the rows.
SAME_BY_NAME = ("model", "dataset")


def _name(value: Any) -> str:
    return Path(str(value).rstrip("/\\")).name


def _shown(value: Any) -> str:
    if value is None:
        return "(not set)"
    text = str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def compare(saved: dict[str, Any] | None, now: dict[str, Any]) -> list[dict[str, Any]]:
    """The flags that differ: [{"flag", "from", "to", "breaks"}], breaking ones first. Flags one side lacks (a
    checkpoint from before a flag existed) are not compared."""
    if not saved:
        return []
    changes = []
    for name, value in now.items():
        if name in NOT_COMPARED or name not in saved or saved[name] == value:
            continue
        if str(saved[name]) == str(value):  # 3e-4 read back as 0.0003, a tuple saved as a list
            continue
        breaks = BREAKING.get(name)
        if name in SAME_BY_NAME and _name(saved[name]) == _name(value):
            breaks = None  # the same folder or file found at another path (another machine, a new input mount)
        changes.append({"flag": name, "from": saved[name], "to": value, "breaks": breaks})
    return sorted(changes, key=lambda c: c["breaks"] is None)


def global_batch_change(saved_batch: int | None, batch: int, mid_range: bool) -> dict[str, Any] | None:
    """Inside a range, the position is a count of samples of the saved global batch: another one breaks it."""
    if not mid_range or saved_batch is None or saved_batch == batch:
        return None
    return {
        "flag": "global_batch",
        "from": saved_batch,
        "to": batch,
        "breaks": "the range's position is counted in steps of the saved global batch",
    }


def line(change: dict[str, Any]) -> str:
    if change["breaks"]:
        what = f"breaks exactness: {change['breaks']}"
    elif change["flag"] in SAME_BY_NAME:
        what = "the same name at another path: taken as the same one, and its contents checked"
    else:
        what = "a choice: applied from this session on"
    return f"settings: --{change['flag']} {_shown(change['from'])} -> {_shown(change['to'])} ({what})"


def refuse_if_breaking(changes: list[dict[str, Any]], allow: bool, checkpoint: str) -> None:
    """One line naming every exactness-breaking change, unless --allow_changes."""
    breaking = [c for c in changes if c["breaks"]]
    if breaking and not allow:
        named = "; ".join(f"{listed([c])} ({c['breaks']})" for c in breaking)
        raise ConfigError(
            f"--resume_file {checkpoint}: {named}. Use the checkpoint's value, or --allow_changes "
            "to go on anyway (the chain is then no longer one exact run)"
        )


def compared_flags(config: Config, saved: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the checkpoint's flags, this session's) as compare() takes them: the session's are its method's own only
    (another method's mean nothing to this run; --method itself is compared)."""
    return saved, config.flat()


def trained_with_other_settings(
    config: Config, saved: dict[str, Any], saved_batch: int | None, batch: int | None
) -> list[dict[str, Any]]:
    """A finished range's flags (`saved`, and its global batch) against a session that would train it again: every
    change to what the range trains (the drift's, the LoRA identity's, the global batch's), none of how a session
    runs (SESSION_ONLY) or of the same file found at another path."""
    saved, now = compared_flags(config, saved)
    lora = [
        {"flag": name, "from": saved[name], "to": now[name], "breaks": "other adapters train"}
        for name in LORA_FLAGS
        if name in saved and name in now and str(saved[name]) != str(now[name])
    ]
    batch_changed = batch is not None and saved_batch is not None and batch != saved_batch
    moved = {"flag": "global_batch", "from": saved_batch, "to": batch, "breaks": "other steps train"}
    changes = [
        c
        for c in compare(saved, now)
        if c["flag"] not in SESSION_ONLY and not (c["flag"] in SAME_BY_NAME and _name(c["from"]) == _name(c["to"]))
    ]
    return changes + lora + ([moved] if batch_changed else [])


def listed(changes: list[dict[str, Any]]) -> str:
    """`--lr 0.003 -> 0.001, --seed 1 -> 2`: the changes as one line names them."""
    return ", ".join(f"--{c['flag']} {_shown(c['from'])} -> {_shown(c['to'])}" for c in changes)


def settings_drift(config: Config, payload: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Rank 0, resuming: each flag changed since the checkpoint, one line each; an exactness-breaking change stops
    the run here, before anything is built, unless --allow_changes."""
    if payload is None:
        return []
    # A LoRA checkpoint's base is checked by its fingerprint (model.adapters.check_resume), a stronger test than a name
    saved = {k: v for k, v in (payload.get("config") or {}).items() if not (k == "model" and payload.get(KEY))}
    changes = compare(*compared_flags(config, saved))
    for change in changes:
        print0(line(change))
    refuse_if_breaking(changes, config.checkpoint.allow_changes, Path(payload["_path"]).name)
    return changes
