"""Process group, device and rank helpers.

One code path for every launch: torchrun (any node and process count), Slurm through torchrun, and a
plain `python fsdp_finetune.py`, which becomes a world of one. NCCL carries CUDA tensors, gloo carries
CPU tensors (and all object collectives), chosen automatically.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from fsdp_opt import base
from fsdp_opt.base import ConfigError, parse_size
from fsdp_opt.runtime.exits import env_rank
from fsdp_opt.runtime.gpus import PEAK_FLOPS
from fsdp_opt.runtime.hostmem import peak_rss_bytes

T = TypeVar("T")


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def num_nodes(self) -> int:
        return max(1, self.world_size // max(1, self.local_world_size))


def choose_device(preference: str = "auto") -> torch.device:
    if preference == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is visible (use --device cpu or auto)")
    use_cuda = preference == "cuda" or (preference == "auto" and torch.cuda.is_available())
    if use_cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        return torch.device("cuda", cuda_index(local, per_node, torch.cuda.device_count()))
    return torch.device("cpu")


def cuda_index(local_rank: int, local_world_size: int, device_count: int) -> int:
    """This process's GPU: one GPU per process. Two processes on one GPU would make NCCL fail (a duplicate GPU in the
    communicator) with a traceback, so more processes than GPUs is refused in one line."""
    if local_world_size > device_count:
        raise ConfigError(
            f"--nproc_per_node {local_world_size}: this node has {device_count} GPU(s), one per process "
            f"(use --nproc_per_node=gpu, or {device_count})"
        )
    return local_rank


def backend_for(device: torch.device) -> tuple[str, dict[str, Any]]:
    """The process group's backend and init_process_group's extra arguments for this device.

    CUDA: NCCL for CUDA tensors, gloo for CPU tensors and object collectives. No `device_id`: a default group bound to
    a device makes init_device_mesh build a 2-D mesh (NO_SHARD, HYBRID_SHARD) by `split_group`, which fails on torch
    2.8 for a "cpu:gloo,cuda:nccl" group ("Unknown c10d backend type CPU:GLOO,CUDA:NCCL"); unbound, it builds each
    dimension's group with `new_group`. torch.cuda.set_device comes first, so NCCL still uses this process's GPU."""
    if device.type == "cuda":
        return "cpu:gloo,cuda:nccl", {}
    return "gloo", {}


def init_distributed(device_preference: str = "auto", timeout_minutes: float = 30.0) -> DistEnv:
    device = choose_device(device_preference)
    rank = env_rank()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    backend, kwargs = backend_for(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        # NOTE: torchrun sets OMP_NUM_THREADS=1 for several workers; share the cores instead.
        if "OMP_NUM_THREADS" not in os.environ or local_world_size > 1:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size))
    if not dist.is_initialized():
        timeout = timedelta(minutes=timeout_minutes)
        if "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend=backend, timeout=timeout, **kwargs)
        else:
            # A plain `python` launch: a world of one, no port needed.
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return DistEnv(rank, world_size, local_rank, local_world_size, device)


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def print0(*args: Any, sep: str = " ", end: str = "\n", file: Any = None) -> None:
    """Print on rank 0 only, each line in one write: the upload thread's lines never split the main thread's."""
    if env_rank() == 0:
        out = file or sys.stdout
        out.write(sep.join(str(a) for a in args) + end)
        out.flush()


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _reduce_int(value: int, op: Any) -> int:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.int32)
    dist.all_reduce(t, op=op)
    return int(t.item())


def max_over_ranks(value: int) -> int:
    """The largest `value` of any rank, on every rank: how stop decisions are agreed."""
    return _reduce_int(value, dist.ReduceOp.MAX)


def min_over_ranks(value: int) -> int:
    """The smallest `value` of any rank, on every rank: whether something holds on all of them."""
    return _reduce_int(value, dist.ReduceOp.MIN)


def broadcast_object(obj: T, src: int = 0) -> T:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def scatter_object(items: list[Any] | None, src: int = 0) -> Any:
    """items[r] from rank `src` to each rank r (None on every rank when `src` gives None)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return items[0] if items else None
    if not broadcast_object(items is not None, src):
        return None
    box: list[Any] = [None]
    dist.scatter_object_list(box, items if dist.get_rank() == src else None, src=src)
    return box[0]


def all_ranks_ok(fn: Callable[[], T]) -> T:
    """Run `fn` on every rank; if it raises ConfigError on any rank, raise that error on all of them.

    A user error found by one rank alone would otherwise leave the others waiting in the next collective.
    """
    error: str | None = None
    result: T | None = None
    try:
        result = fn()
    except ConfigError as exc:
        error = f"{type(exc).__name__}:{exc}"
    errors: list[str | None] = [error]
    if dist.is_initialized() and dist.get_world_size() > 1:
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
    first = next((e for e in errors if e), None)
    if first:
        kind, _, message = first.partition(":")
        raise _error_class(kind)(message)
    return result  # type: ignore[return-value]


def rank0_first(fn: Callable[[], T]) -> T:
    """Run `fn` on rank 0, then on the others (e.g. a download, then cache hits), agreeing on user errors."""
    first = all_ranks_ok(lambda: fn() if env_rank() == 0 else None)
    later = all_ranks_ok(lambda: fn() if env_rank() != 0 else None)
    return first if env_rank() == 0 else later  # type: ignore[return-value]


def _error_class(name: str) -> type[ConfigError]:
    cls = getattr(base, name, ConfigError)
    return cls if isinstance(cls, type) and issubclass(cls, ConfigError) else ConfigError


def cap_gpu_memory(config: Any, env: DistEnv) -> tuple[int, str] | None:
    """On CUDA: (usable bytes, name) of this GPU, capped by --max_gpu_memory (the allocator is held to it)."""
    if env.device.type != "cuda":
        return None

    total = torch.cuda.get_device_properties(env.device).total_memory
    cap = config.parallel.max_gpu_memory
    if cap is not None:
        cap_bytes = min(total, parse_size(cap, "--max_gpu_memory"))
        torch.cuda.set_per_process_memory_fraction(cap_bytes / total, env.device)
        total = cap_bytes
    return total, torch.cuda.get_device_name(env.device)


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_FLOPS.items():
        if key in name:
            return value
    return None


def peak_memory_bytes(device: torch.device) -> int | None:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return peak_rss_bytes() or None
