"""What a checkpoint holds besides the position: RNG states, the model's state in a checkpoint's terms (tied names
once), the full state gathered on rank 0, and the copy handed to a background writer."""

from __future__ import annotations

import random
from typing import Any, Iterator

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_as_tuple(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _as_tuple(x: Any) -> Any:
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


def model_options(model: nn.Module, **kwargs: Any) -> StateDictOptions:
    """State-dict options for a checkpoint's model part: frozen parameters (a LoRA run's base, which its --model
    provides) are never saved, and a load fills only the trainable ones. Full fine-tuning freezes nothing."""
    frozen = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=frozen, strict=not frozen, **kwargs)


def model_state(model: nn.Module, **kwargs: Any) -> dict[str, Any]:
    """get_model_state_dict with model_options: with a frozen base, only the trainable parameters' entries (a tied
    alias of a frozen weight, such as OPT's lm_head, is left out too)."""
    state = get_model_state_dict(model, options=model_options(model, **kwargs))
    if all(p.requires_grad for p in model.parameters()):
        return state
    trainable = {n.replace("_checkpoint_wrapped_module.", "") for n, p in model.named_parameters(remove_duplicate=False)
                 if p.requires_grad}  # fmt: skip
    return {k: v for k, v in state.items() if k in trainable}


def gather_full_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[dict, dict | None]:
    """Full fp32 model (and optimizer) state on rank 0's CPU; empty elsewhere. Every rank must call it."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd = model_state(model, full_state_dict=True, cpu_offload=True)
    optim_sd = get_optimizer_state_dict(model, optimizer, options=opts) if optimizer is not None else None
    # Tied weights (OPT's lm_head and embed_tokens) arrive as two copies: alias them so a save stores one.
    for names in tied_names(model):
        present = [n for n in names if n in model_sd]
        for n in present[1:]:
            model_sd[n] = model_sd[present[0]]
    return model_sd, optim_sd


def tied_names(model: nn.Module) -> list[list[str]]:
    """Groups of state-dict names that are one parameter."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name.replace("_checkpoint_wrapped_module.", ""))
    return [g for g in groups.values() if len(g) > 1]


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def _storage(t: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    return (t.to_local() if isinstance(t, DTensor) else t).untyped_storage().data_ptr()


def copy_live_tensors(payload: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """Copy every tensor of a gathered payload that is the training state itself, so the steps that run while it is
    written cannot change it. (On CPU the full optimizer state dict hands out AdamW's live 0-dim `step` tensors.)
    Returns how many were copied."""
    live = {_storage(t) for t in model.parameters() if t.numel()}
    for state in optimizer.state.values() if optimizer is not None else ():
        live |= {_storage(v) for v in state.values() if isinstance(v, torch.Tensor) and v.numel()}

    def walk(obj: Any) -> int:
        copied = 0
        items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
        for key, value in items:
            if isinstance(value, torch.Tensor):
                if value.numel() and _storage(value) in live:
                    obj[key] = value.clone()
                    copied += 1
            elif isinstance(value, (dict, list)):
                copied += walk(value)
        return copied

    return walk(payload)
