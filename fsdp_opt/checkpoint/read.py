"""Reading a checkpoint on CPU, whatever its form (a file, a sharded folder's metadata, a weights file), and the
refusals: not ours, truncated or damaged, or made for another model."""

from __future__ import annotations

import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fsdp_opt.base import CheckpointError, first_line
from fsdp_opt.checkpoint.names import FORMAT, META_FILE, MODEL_KEY
from fsdp_opt.checkpoint.state import model_state
from fsdp_opt.checkpoint.weightsfile import SUFFIX as WEIGHTS_SUFFIX
from fsdp_opt.checkpoint.weightsfile import read_weights


def read_checkpoint(path: Path, flag: str = "--resume_file") -> dict[str, Any]:
    """Load a checkpoint of ours on CPU (a file, a sharded folder's metadata, or a weights file), refusing anything else."""
    if path.is_dir():
        return _read_sharded_meta(path, flag)
    if not path.is_file():
        raise CheckpointError(f"{flag} {path}: no such file")

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
            f"({first_line(exc)[:120]})"
        ) from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError, ValueError) as exc:
        raise CheckpointError(
            f"{flag} {path}: not a readable checkpoint, truncated or damaged ({first_line(exc)[:120]})"
        ) from None


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
        k[len("model.") :]: tuple(v.size)
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
            raise CheckpointError(f"{flag} {path}: sharded metadata unreadable ({first_line(exc)})") from None
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
