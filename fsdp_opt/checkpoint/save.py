"""Saving: the full single file (rank 0 writes what every rank helped gather) or a sharded folder (every rank writes its
shards through torch.distributed.checkpoint), and the background writer of --async_save.

A full checkpoint loads with `torch.load(path, weights_only=True)`: tensors and plain values only."""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from fsdp_opt.base import CheckpointError, first_line
from fsdp_opt.checkpoint.atomic import _fsync_dir, save_or_explain
from fsdp_opt.checkpoint.names import EPOCHS_KEY, FORMAT, META_FILE, MODEL_KEY, STEP_KEY
from fsdp_opt.checkpoint.room import bytes_on_disk
from fsdp_opt.checkpoint.state import copy_live_tensors, gather_full_state, model_state, rng_state
from fsdp_opt.engine.step import TrainState
from fsdp_opt.runtime.distributed import DistEnv, all_ranks_ok, barrier
from fsdp_opt.runtime.hostmem import release_host_memory


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
    # What the steps freed, back to the system before the gathered state is built: on a CPU device a step's blocks
    # stay in the heap for the next step (runtime.hostmem.configure_allocator), and the save would peak above them.
    release_host_memory()
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


def _save_sharded(
    path: Path, env: DistEnv, model: nn.Module, optimizer: torch.optim.Optimizer | None, meta: dict
) -> None:
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
        raise CheckpointError(f"cannot save {path}: {first_line(exc)}; earlier checkpoints are kept") from None

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


class BackgroundWriter:
    """Rank 0 writes a gathered checkpoint in a thread of its own while training goes on (--async_save).

    One write at a time: start() waits for the one before, so host RAM never holds two gathered states. A failed
    write is kept in `error`; the training loop reads it at the next step and every rank stops with it.
    """

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self.error: str | None = None

    def start(self, work: Callable[[], None]) -> None:
        self.wait()
        self._thread = threading.Thread(target=self._run, args=(work,), name="checkpoint-writer")
        self._thread.start()

    def _run(self, work: Callable[[], None]) -> None:
        try:
            work()
        except CheckpointError as exc:
            self.error = str(exc)
        except Exception as exc:  # noqa: BLE001 - reported on every rank at the next step, like a disk error
            self.error = (
                f"writing a checkpoint failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            )

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()
