"""Loading a checkpoint into the live shards: every rank copying its own slices of a file it can see, rank 0's
payload broadcast to the others, a sharded folder read by every rank; and a checkpoint read whole on CPU (export,
weights files), with no process group.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from fsdp_opt.base import CheckpointError, first_line
from fsdp_opt.checkpoint.names import MODEL_KEY, SUFFIX
from fsdp_opt.checkpoint.read import _load_weights_only, read_checkpoint
from fsdp_opt.checkpoint.state import _tensors, model_options, model_state
from fsdp_opt.engine.optim import create_state
from fsdp_opt.model.parallelize import storages
from fsdp_opt.runtime.distributed import DistEnv, broadcast_object, min_over_ranks
from fsdp_opt.runtime.hostmem import drop_pages, file_ranges


def load_into(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    payload: dict[str, Any] | None,
    env: DistEnv,
    *,
    load_optimizer: bool,
    sharded_path: Path | None = None,
    file_path: Path | None = None,
) -> None:
    """Every rank ends with the same model and optimizer state. A full .pt file (`file_path`) that every rank can see
    is read by every rank, each copying only its own slices (no broadcast; on one machine the ranks share the page
    cache); otherwise rank 0's payload is broadcast. A sharded folder is read by every rank, each taking its own
    part (any rank count)."""
    if load_optimizer and optimizer is not None:
        create_state(optimizer)
    if sharded_path is not None:
        _load_sharded(model, optimizer, sharded_path, load_optimizer)
        return
    if file_path is not None and _every_rank_sees(file_path, env):
        _load_own_slices(model, optimizer, file_path, load_optimizer)
        return
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    # NOTE: the set_* calls write the live shards back into the dicts they are given: note the file's
    # storages first.
    loaded = payload_storages(payload) if env.is_main else set()
    model_opts = model_options(model, full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, payload[MODEL_KEY] if env.is_main else {}, options=model_opts)
    if load_optimizer:
        set_optimizer_state_dict(model, optimizer, payload["optimizer"] if env.is_main else {}, options=opts)
    if env.is_main:
        detach_from_payload(model, optimizer, loaded)


def payload_storages(payload: dict[str, Any]) -> set[int]:
    """Where the loaded checkpoint's tensors live (their storages in the memory-mapped file)."""
    return {a for t in _tensors(payload) if t.numel() for a in storages(t)}


def detach_from_payload(model: nn.Module, optimizer: torch.optim.Optimizer | None, loaded: set[int]) -> int:
    """Copy every tensor of the live state that still shares storage with rank 0's loaded checkpoint.

    The broadcast hands rank 0's own 0-dim values (AdamW's `step`) and replicated shards to the optimizer as
    they are. The checkpoint is memory-mapped, so one such tensor keeps the whole file mapped and its pages
    resident until the process ends: on top of the full state the next save gathers. Returns how many were copied.
    """
    copied = 0
    for state in optimizer.state.values() if optimizer is not None else ():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.numel() and not loaded.isdisjoint(storages(value)):
                state[key] = value.clone()
                copied += 1
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.numel() and not loaded.isdisjoint(storages(t)):  # load_state_dict copies into the shards; never expected
            raise RuntimeError(f"{name} still shares memory with the loaded checkpoint")
    return copied


def _every_rank_sees(path: Path, env: DistEnv) -> bool:
    """Can every rank read this checkpoint file (one machine, or a filesystem all nodes share)? Agreed by all."""
    if path.suffix != SUFFIX:
        return False  # weights files (safetensors) and anything else: rank 0 reads, the others receive
    size = broadcast_object(path.stat().st_size if env.is_main else None)
    here = path.is_file() and path.stat().st_size == size
    return min_over_ranks(int(here)) == 1


@torch.no_grad()
def _copy_own_slice(full: torch.Tensor, into: torch.Tensor, mapped: list[tuple[int, int]]) -> None:
    """Copy this rank's part of a full tensor into `into` (a DTensor shard, or a plain tensor such as AdamW's step).
    The pages read leave this process's RSS afterwards when `full` lies in the mapped file (`mapped`)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(into, DTensor):
        into.copy_(full)
        return
    shape, offset = compute_local_shape_and_global_offset(full.shape, into.device_mesh, into.placements)
    into.to_local().copy_(full[tuple(slice(o, o + n) for n, o in zip(shape, offset))])
    drop_pages(full, mapped)


def _load_own_slices(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, path: Path, load_optimizer: bool
) -> None:
    """Every rank maps the file and copies its own slices into its shards: each rank reads 1/N of the bytes and
    nothing is broadcast. The copies go into the tensors the state dicts hand out (the live shards, as torch's own
    broadcast load does), which are then loaded with set_*_state_dict: no second copy of the state is made."""
    payload = _load_weights_only(path, "--resume_file")
    mapped = file_ranges(path)
    try:
        shards = model_state(model)
        for name, into in shards.items():
            _copy_own_slice(payload[MODEL_KEY][name], into, mapped)
        set_model_state_dict(model, shards, options=model_options(model))
        if load_optimizer:
            state = get_optimizer_state_dict(model, optimizer)  # this rank's shards (made by create_state)
            saved = payload["optimizer"]
            for fqn, values in state["state"].items():
                for key, into in values.items():
                    _copy_own_slice(saved["state"][fqn][key], into, mapped)
            set_optimizer_state_dict(model, optimizer, {"state": state["state"], "param_groups": saved["param_groups"]})
    finally:
        del payload


def _load_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, path: Path, load_optimizer: bool) -> None:
    import torch.distributed.checkpoint as dcp

    tensors: dict[str, Any] = {"model": model_state(model)}
    if load_optimizer:
        tensors["optim"] = get_optimizer_state_dict(model, optimizer)
    try:
        dcp.load(tensors, checkpoint_id=str(path))
    except Exception as exc:  # noqa: BLE001 - DCP raises on every rank
        raise CheckpointError(
            f"--resume_file {path}: sharded checkpoint does not match this model ({first_line(exc)})"
        ) from None
    set_model_state_dict(model, tensors["model"], options=model_options(model))
    if load_optimizer:
        set_optimizer_state_dict(model, optimizer, tensors["optim"])


def load_full_payload(path: Path, flag: str = "checkpoint") -> dict[str, Any]:
    """A checkpoint as one in-memory payload on CPU (MODEL_KEY, optimizer, metadata), file or folder.

    For a sharded folder this needs no process group: DCP reads every shard into full tensors.
    """
    payload = read_checkpoint(path, flag)
    if not payload.get("_sharded"):
        return payload
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        flat_path = Path(tmp) / "full.pt"
        dcp_to_torch_save(str(path), str(flat_path))
        tensors = torch.load(flat_path, map_location="cpu", weights_only=True)
    payload = {k: v for k, v in payload.items() if k != "_sharded"}
    payload[MODEL_KEY] = tensors["model"]
    payload["optimizer"] = tensors.get("optim")
    return payload


def load_model_only(path: Path, flag: str = "checkpoint") -> dict[str, Any]:
    """A checkpoint's metadata and full model weights on CPU, without its optimizer state (a file is memory-mapped,
    so only the weights' pages are read; a sharded folder loads only its model tensors). No process group needed."""
    payload = read_checkpoint(path, flag)
    if not payload.get("_sharded"):
        return payload
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(path)).read_metadata()
    model = {
        k[len("model.") :]: torch.empty(tuple(v.size), dtype=v.properties.dtype)
        for k, v in metadata.state_dict_metadata.items()
        if k.startswith("model.") and isinstance(v, TensorStorageMetadata)
    }
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"model": model}, checkpoint_id=str(path), no_dist=True)
    payload[MODEL_KEY] = model
    return payload
