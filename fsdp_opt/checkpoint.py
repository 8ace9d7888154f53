"""Checkpoints: names, the single-file format, atomic writes, save, reading and the refusals, pruning.

A checkpoint is one `.pt` file that loads with `torch.load(path, weights_only=True)`: tensors and plain
values only. Rank 0 gathers the full state (every rank takes part in the gather) and writes it. Loading it into
the shards of a run is `loading.load_into`.
"""

from __future__ import annotations

import pickle
import random
import re
import shutil
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

from .atomic import _fsync_dir, save_or_explain
from .distributed import DistEnv, all_ranks_ok, barrier
from .errors import CheckpointError
from .hostmem import release_host_memory
from .room import bytes_on_disk

FORMAT = "fsdp-opt/1"
SUFFIX = ".pt"
# {tag}_{start}-{end}-epoch-{epoch}.pt, or ...-epoch-{epoch}-step-{global_step}.pt mid-epoch.
NAME_RE = re.compile(r"^(?P<tag>.+)_(?P<start>\d+)-(?P<end>\d+)-epoch-(?P<epoch>\d+)(?:-step-(?P<step>\d+))?(?:\.pt)?$")
META_FILE = "fsdp_opt_meta.pt"  # inside a sharded checkpoint folder: everything but the tensors of model and optimizer
# Keys of the original script's checkpoints, kept so old readers still work.
MODEL_KEY, STEP_KEY, EPOCHS_KEY = "MODEL_STATE", "GLOBAL_STEP", "EPOCHS_RUN"


def checkpoint_name(tag: str, start: int, end: int, epoch: int, step: int | None = None, sharded: bool = False) -> str:
    """`epoch` is 1-based: the epoch finished (or, with `step`, in progress). Sharded checkpoints are folders."""
    base = f"{tag}_{start}-{end}-epoch-{epoch}" + (f"-step-{step}" if step is not None else "")
    return base if sharded else base + SUFFIX


def parse_name(name: str) -> dict[str, Any] | None:
    m = NAME_RE.match(Path(name).name)
    if not m:
        return None
    out: dict[str, Any] = {k: (int(v) if v is not None and k != "tag" else v) for k, v in m.groupdict().items()}
    return out


@dataclass
class TrainState:
    """Where the run is: what a resume restores besides model and optimizer."""

    global_step: int = 0
    epoch: int = 0  # 0-based epoch of the slice that `offset` points into
    offset: int = 0  # samples of that epoch already consumed

    def state_dict(self) -> dict[str, int]:
        return {"global_step": self.global_step, "epoch": self.epoch, "offset": self.offset}


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


def save_checkpoint(
    path: Path,
    env: DistEnv,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    state: TrainState,
    epochs_run: int,
    extra: dict[str, Any],
    save_optimizer: bool = True,
    sharded: bool = False,
    hand_off: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, float] | None:
    """Every rank calls this. Full: gather, rank 0 writes one file. Sharded: each rank writes its shard.

    Returns {'bytes', 'seconds'} on rank 0. A failed write raises CheckpointError on every rank. With `hand_off`
    (full saves), rank 0 passes the gathered payload to it instead of writing it, and None is returned: the caller
    writes it (in the background) with write_payload().
    """
    start = time.perf_counter()
    rngs: list[Any] = [None] * env.world_size
    if env.world_size > 1:
        dist.all_gather_object(rngs, rng_state())
    else:
        rngs = [rng_state()]
    meta = {
        "format": FORMAT,
        STEP_KEY: state.global_step,
        EPOCHS_KEY: epochs_run,
        "train_state": state.state_dict(),
        "rng": rngs,
        "has_optimizer": save_optimizer,
        **extra,
    }
    if sharded:
        _save_sharded(path, env, model, optimizer if save_optimizer else None, meta)
    else:
        model_sd, optim_sd = gather_full_state(model, optimizer if save_optimizer else None)
        payload = {**meta, MODEL_KEY: model_sd, "optimizer": optim_sd}
        del model_sd, optim_sd
        if hand_off is not None:
            if env.is_main:
                copy_live_tensors(payload, model, optimizer)
                hand_off(payload)
            return None
        all_ranks_ok(lambda: save_or_explain(payload, path) if env.is_main else None)
        del payload
    release_host_memory()  # the gathered state: back to the system, not kept in the heap for later steps
    if not env.is_main:
        return None
    return {"bytes": float(bytes_on_disk(path)), "seconds": time.perf_counter() - start}


def _save_sharded(path: Path, env: DistEnv, model: nn.Module, optimizer: torch.optim.Optimizer | None, meta: dict) -> None:
    import torch.distributed.checkpoint as dcp

    tmp = path.with_name(f".{path.name}.tmp")
    if env.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    tensors: dict[str, Any] = {"model": model_state(model)}
    if optimizer is not None:
        tensors["optim"] = get_optimizer_state_dict(model, optimizer)
    try:
        dcp.save(tensors, checkpoint_id=str(tmp))
    except Exception as exc:  # noqa: BLE001 - DCP raises the same error on every rank
        if env.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"cannot save {path}: {_first_line(exc)}; earlier checkpoints are kept") from None

    def finish() -> None:
        if not env.is_main:
            return
        save_or_explain(meta, tmp / META_FILE)
        old = path.with_name(f".{path.name}.old")
        if path.exists():
            path.rename(old)
        tmp.rename(path)
        _fsync_dir(path.parent)
        shutil.rmtree(old, ignore_errors=True)

    all_ranks_ok(finish)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:200]


def read_checkpoint(path: Path, flag: str = "--resume_file") -> dict[str, Any]:
    """Load a checkpoint of ours on CPU (a file, a sharded folder's metadata, or a weights file), refusing anything else."""
    if path.is_dir():
        return _read_sharded_meta(path, flag)
    if not path.is_file():
        raise CheckpointError(f"{flag} {path}: no such file")
    from .weightsfile import SUFFIX as WEIGHTS_SUFFIX, read_weights

    if path.suffix == WEIGHTS_SUFFIX:
        return read_weights(path, flag)
    payload = _load_weights_only(path, flag)
    if not isinstance(payload, dict) or MODEL_KEY not in payload:
        raise CheckpointError(f"{flag} {path}: not an fsdp-opt checkpoint (no {MODEL_KEY})")
    return payload


def _load_weights_only(path: Path, flag: str) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"{flag} {path}: refused: it holds objects that need code to load, which is never run "
            f"({_first_line(exc)[:120]})"
        ) from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError, ValueError) as exc:
        raise CheckpointError(f"{flag} {path}: not a readable checkpoint, truncated or damaged ({_first_line(exc)[:120]})") from None


def _read_sharded_meta(path: Path, flag: str) -> dict[str, Any]:
    meta_path = path / META_FILE
    if not meta_path.is_file() or not (path / ".metadata").is_file():
        raise CheckpointError(f"{flag} {path}: not a sharded fsdp-opt checkpoint (no {META_FILE} or .metadata)")
    meta = _load_weights_only(meta_path, flag)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{flag} {path}: {META_FILE} is not fsdp-opt checkpoint metadata")
    meta["_sharded"] = True
    return meta


def _sharded_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(path)).read_metadata()
    return {
        k[len("model."):]: tuple(v.size)
        for k, v in metadata.state_dict_metadata.items()
        if k.startswith("model.") and isinstance(v, TensorStorageMetadata)
    }


def check_compatible(payload: dict[str, Any], model: nn.Module, path: Path, flag: str = "--resume_file") -> None:
    """The checkpoint's weights must have the names and shapes of `model` (a meta or sharded skeleton)."""
    expected = {k: tuple(v.shape) for k, v in model_state(model).items()}
    if payload.get("_sharded"):
        try:
            got = _sharded_shapes(path)
        except Exception as exc:  # noqa: BLE001
            raise CheckpointError(f"{flag} {path}: sharded metadata unreadable ({_first_line(exc)})") from None
    else:
        got = {k: tuple(v.shape) for k, v in payload[MODEL_KEY].items()}
    missing = sorted(set(expected) - set(got))
    unexpected = sorted(set(got) - set(expected))
    if missing or unexpected:
        what = f"missing {missing[:2]}" if missing else f"unexpected {unexpected[:2]}"
        raise CheckpointError(f"{flag} {path}: weights of another architecture ({what})")
    for k, shape in expected.items():
        if got[k] != shape:
            raise CheckpointError(
                f"{flag} {path}: {k} has shape {list(got[k])}, the model has {list(shape)} "
                "(another model size or vocabulary)"
            )


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


def _is_checkpoint(p: Path) -> bool:
    if not NAME_RE.match(p.name) or p.name.startswith("."):
        return False
    return p.is_file() and p.suffix == SUFFIX or p.is_dir() and (p / META_FILE).is_file()


def list_checkpoints(output_dir: Path) -> list[Path]:
    return sorted(p for p in output_dir.iterdir() if _is_checkpoint(p)) if output_dir.is_dir() else []


def find_checkpoint(output_dir: Path, name: str, flag: str = "--resume_file") -> Path:
    """A path, a name inside output_dir, or `latest` (highest global step in output_dir)."""
    if name == "latest":
        found = latest_checkpoint(output_dir)
        if found is None:
            raise CheckpointError(f"{flag} latest: no checkpoint in {output_dir}")
        return found
    as_path = Path(name).expanduser()
    if as_path.exists():
        return as_path
    inside = output_dir / name
    if inside.exists():
        return inside
    present = [p.name for p in list_checkpoints(output_dir)]
    listing = ", ".join(present[:10]) if present else "none"
    raise CheckpointError(f"{flag} {name}: not found as a path or in {output_dir} (checkpoints there: {listing})")


def checkpoint_step(path: Path) -> int:
    parsed = parse_name(path.name)
    if parsed and parsed["step"] is not None:
        return parsed["step"]
    try:
        payload = read_checkpoint(path)
        return int(payload[STEP_KEY])
    except Exception:  # noqa: BLE001 - an unreadable file is never "latest"
        return -1


def latest_checkpoint(output_dir: Path) -> Path | None:
    scored = [(checkpoint_step(p), p.stat().st_mtime, p) for p in list_checkpoints(output_dir)]
    scored = [s for s in scored if s[0] >= 0]
    return max(scored)[2] if scored else None


def prune(output_dir: Path, keep_last: int, keep: Path, may_delete: Callable[[Path], bool] | None = None) -> list[Path]:
    """Delete all but the newest `keep_last` checkpoints (by global step). Never `keep`, the one just written,
    and never one that `may_delete` refuses (with --hf_repo: one that is not on the Hub yet)."""
    if keep_last <= 0:
        return []
    ranked = []
    for p in list_checkpoints(output_dir):
        try:
            ranked.append((checkpoint_step(p), p.stat().st_mtime, p))
        except FileNotFoundError:  # removed meanwhile
            continue
    ranked.sort(reverse=True)
    removed = []
    for _, _, p in ranked[keep_last:]:
        if p.resolve() == keep.resolve() or (may_delete is not None and not may_delete(p)):
            continue
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        removed.append(p)
    return removed
