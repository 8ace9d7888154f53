"""What a checkpoint holds besides the position: RNG states, the model's state in a checkpoint's terms (tied names
once), the full state gathered on rank 0, and the copy handed to a background writer."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.tensor import DTensor

from fsdp_opt.model.parallelize import REPLICATED, shard_group, storages


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
    trainable = {
        n.replace("_checkpoint_wrapped_module.", "")
        for n, p in model.named_parameters(remove_duplicate=False)
        if p.requires_grad
    }
    return {k: v for k, v in state.items() if k in trainable}


def gather_full_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[dict, dict | None]:
    """Full fp32 model (and optimizer) state on rank 0's CPU; empty elsewhere. Every rank must call it.

    torch's state dicts give the names and the layout (the sharded ones: DTensors, no communication); the shards are
    then gathered in buckets (`gather_to_rank0`), a few collectives for the whole state instead of one per tensor."""
    model_sd = gather_to_rank0(model_state(model))
    optim_sd = None
    if optimizer is not None:
        optim_sd = gather_to_rank0(get_optimizer_state_dict(model, optimizer))
    # Tied weights (OPT's lm_head and embed_tokens) arrive as two copies: alias them so a save stores one.
    for names in tied_names(model):
        present = [n for n in names if n in model_sd]
        for n in present[1:]:
            model_sd[n] = model_sd[present[0]]
    return model_sd, optim_sd


# Shards gathered per collective: at most this many bytes from each rank, or one tensor's shard when that is larger.
# The gathered bucket is world_size times it, and gloo (CPU) stages it once more: at a 50k vocabulary on 2 CPU ranks
# a save peaks where a per-tensor gather did. For opt-1.3b a GPU save makes about 2/5 of the per-tensor collectives.
BUCKET_BYTES = 16 * 2**20


def gather_to_rank0(tree: dict, bucket_bytes: int = BUCKET_BYTES) -> dict:
    """A state dict with DTensor leaves -> the same dict with whole tensors on rank 0's CPU; {} on the other ranks.
    Every rank must call it with the same structure (the state dicts of one model are). FSDP2's layouts (Shard(0) on
    one mesh dimension, Replicate on any other) are gathered in buckets, one all-gather each; any other layout takes
    DTensor's own full_tensor(). Plain tensors (AdamW's steps) are moved to the CPU as they are."""
    main = not dist.is_initialized() or dist.get_rank() == 0
    buckets: dict[tuple, list[list[tuple[Any, Any, Any]]]] = {}  # (group, dtype, device) -> runs of leaves
    filled: dict[tuple, int] = {}

    def walk(obj: Any) -> None:
        items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
        for key, value in list(items):
            if isinstance(value, (dict, list)):
                walk(value)
            elif isinstance(value, DTensor):
                group = shard_group(value)
                if group is None or group == REPLICATED:  # REPLICATED: whole on every rank, nothing to gather
                    full = value.full_tensor()
                    obj[key] = full.cpu() if main else None
                    continue
                local = value.to_local()
                where = (group, local.dtype, local.device)
                size = _piece_numel(value.shape, dist.get_world_size(group)) * local.element_size()
                runs = buckets.setdefault(where, [[]])
                if runs[-1] and filled[where] + size > bucket_bytes:
                    runs.append([])
                    filled[where] = 0
                runs[-1].append((obj, key, value))
                filled[where] = filled.get(where, 0) + size
            elif isinstance(value, torch.Tensor) and main:
                obj[key] = value.cpu()

    tree = _copy_containers(tree)  # torch's state dicts can hold the optimizer's own dicts: never write into those
    walk(tree)
    for (group, _, _), runs in buckets.items():
        world = dist.get_world_size(group)
        for run in runs:
            _gather_run(run, group, world, main)
    return tree if main else {}


def _copy_containers(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _copy_containers(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_copy_containers(v) for v in obj]
    return obj


def _gather_run(run: list[tuple[Any, Any, Any]], group: Any, world: int, main: bool) -> None:
    """One all-gather of the leaves' shards, each padded to ceil(rows / world) rows; rank 0 puts the whole tensors
    (the valid rows of every rank's piece, in rank order) in their places."""
    pieces = []
    for _, _, t in run:
        local = t.to_local().reshape(-1)
        pad = _piece_numel(t.shape, world) - local.numel()
        pieces.append(torch.cat([local, local.new_zeros(pad)]) if pad else local)
    send = torch.cat(pieces) if len(pieces) > 1 else pieces[0].contiguous()
    out = send.new_empty(world * send.numel())
    # torch 2.13 names all_gather_into_tensor all_gather_single (the old name warns); older releases have the old one
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, send, group=group)
    if not main:
        return
    out = out.view(world, -1).cpu()
    offset = 0
    for container, key, t in run:
        rows, row = t.shape[0], math.prod(t.shape[1:])
        chunk = -(-rows // world)
        parts = [out[r, offset : offset + max(0, min(rows, (r + 1) * chunk) - r * chunk) * row] for r in range(world)]
        container[key] = torch.cat(parts).view(t.shape)
        offset += _piece_numel(t.shape, world)


def _piece_numel(shape: torch.Size, world: int) -> int:
    """Elements of each rank's padded piece of a tensor sharded on dim 0: ceil(rows / world) rows."""
    return -(-shape[0] // world) * math.prod(shape[1:])


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


def copy_live_tensors(payload: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """Copy every tensor of a gathered payload that is the training state itself, so the steps that run while it is
    written cannot change it. (On CPU the full optimizer state dict hands out AdamW's live 0-dim `step` tensors.)
    Returns how many were copied."""
    live = {a for t in model.parameters() if t.numel() for a in storages(t)}
    for state in optimizer.state.values() if optimizer is not None else ():
        live |= {a for v in state.values() if isinstance(v, torch.Tensor) and v.numel() for a in storages(v)}

    def walk(obj: Any) -> int:
        copied = 0
        items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
        for key, value in items:
            if isinstance(value, torch.Tensor):
                if value.numel() and not live.isdisjoint(storages(value)):
                    obj[key] = value.clone()
                    copied += 1
            elif isinstance(value, (dict, list)):
                copied += walk(value)
        return copied

    return walk(payload)
