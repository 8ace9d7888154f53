"""The weights-only file of a checkpoint: fp16 safetensors, named by its range, what the Hub keeps of older ranges.

    weights/opt_1.3B_0-5000-epoch-1.safetensors     (2 bytes per parameter: 2.63 GB for opt-1.3b)

It holds the model's weights under their Hugging Face names (tied weights once) and, in the safetensors header,
the run's position: global step, epochs, slice, flags. It loads with `safetensors.torch.load_file`, evaluates
and exports like a checkpoint (`python -m fsdp_opt.evaluate`, `python -m fsdp_opt.export`), and `--resume_file`
accepts it: the weights and the global step continue; AdamW's moments, the loss scale and the RNG start afresh.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from fsdp_opt.base import CheckpointError
from fsdp_opt.checkpoint.atomic import atomic_path
from fsdp_opt.checkpoint.names import MODEL_KEY

WEIGHTS_DIR = "weights"

SUFFIX = ".safetensors"

FORMAT = "fsdp-opt-weights/1"

# What a checkpoint's metadata carries over into its weights file (small values only).
CARRIED = (
    "GLOBAL_STEP",
    "EPOCHS_RUN",
    "train_state",
    "slice",
    "config",
    "model_name",
    "world_size",
    "global_batch",
    "last_loss",
    "wandb_run_id",
    "lora",
)


def weights_name(checkpoint: str) -> str:
    """opt_1.3B_0-5000-epoch-1.pt (or the sharded folder's name) -> opt_1.3B_0-5000-epoch-1.safetensors."""
    name = Path(checkpoint).name
    return (name[: -len(".pt")] if name.endswith(".pt") else name) + SUFFIX


def checkpoint_of(weights: str) -> str:
    """The checkpoint name a weights file was made from (the .pt form)."""
    name = Path(weights).name
    return name[: -len(SUFFIX)] + ".pt"


def write_weights(
    model_state: dict[str, torch.Tensor], meta: dict[str, Any], path: Path, dtype: torch.dtype = torch.float16
) -> Path:
    """Write the weights in `dtype` (tied ones once) with `meta` in the header; atomically (temporary name, rename)."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    tied: dict[str, str] = {}
    alike: dict[tuple, list[str]] = {}  # (shape, dtype) -> names written: a tied pair may arrive as two equal copies
    for name, t in model_state.items():
        group = alike.setdefault((tuple(t.shape), t.dtype), [])
        same = next((n for n in group if model_state[n] is t or torch.equal(model_state[n], t)), None)
        if same is not None:
            tied[name] = same
            continue
        group.append(name)
        tensors[name] = t.detach().to(dtype).contiguous()
    carried = {k: meta[k] for k in CARRIED if k in meta}
    header = {
        "format": FORMAT,
        "dtype": str(dtype).removeprefix("torch."),
        "tied": json.dumps(tied),
        "fsdp_opt": json.dumps(carried, default=float),
    }
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata=header)
    return path


def is_weights_file(path: Path) -> bool:
    return path.suffix == SUFFIX and path.is_file()


def read_weights(path: Path, flag: str = "--resume_file") -> dict[str, Any]:
    """A weights file as a checkpoint payload: MODEL_STATE in fp32 (tied names restored) and the run's metadata;
    `weights_only` marks what it lacks (optimizer, loss scale, RNG)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
            if header.get("format") != FORMAT:
                raise CheckpointError(f"{flag} {path}: a safetensors file, but not an fsdp-opt weights file")
            state = {k: f.get_tensor(k).float() for k in f.keys()}
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(
            f"{flag} {path}: not a readable weights file ({str(exc).splitlines()[0][:120]})"
        ) from None
    for alias, source in json.loads(header.get("tied", "{}")).items():
        state[alias] = state[source]
    payload: dict[str, Any] = json.loads(header.get("fsdp_opt", "{}"))
    payload.update(
        {
            MODEL_KEY: state,
            "optimizer": None,
            "has_optimizer": False,
            "weights_only": True,
            "weights_dtype": header.get("dtype", "float16"),
        }
    )
    return payload
