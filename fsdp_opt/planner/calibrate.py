"""This machine's rates, measured in the processes that train: matmul TFLOPS per dtype, all-gather and reduce-scatter
bus bandwidth between the ranks, and AdamW's update rate. Every rank measures at the same time, so cores and memory
bandwidth are shared as they are in a step.

`measure(env)` needs an initialized process group (it is what the trainer calls with `--batch_size auto` on CPU);
`python -m fsdp_opt.calibrate` under torchrun is the command `plan --calibrate` launches.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fsdp_opt.base import ConfigError
from fsdp_opt.model.parallelize import DTYPES
from fsdp_opt.runtime.distributed import DistEnv

# The update of one fp32 parameter under AdamW reads and writes about this many bytes: parameter, gradient and two
# moments read, parameter and moments written. The step-time model charges it at the measured rate.
ADAMW_BYTES_PER_PARAM = 28


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], Any], device: torch.device, seconds: float = 0.3, least: int = 2) -> float:
    """Seconds per call of `fn`, after one untimed call; calls repeat until `seconds` have passed. Every rank runs the
    same number of calls (the count is agreed), so collectives stay matched."""
    fn()
    _sync(device)
    started = time.perf_counter()
    fn()
    _sync(device)
    once = max(time.perf_counter() - started, 1e-6)
    calls = torch.tensor([max(least, int(seconds / once))], dtype=torch.int64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(calls, op=dist.ReduceOp.MIN)
    n = int(calls.item())
    started = time.perf_counter()
    for _ in range(n):
        fn()
    _sync(device)
    return (time.perf_counter() - started) / n


def matmul_size(device: torch.device, dtype: torch.dtype, largest: int, enough: float = 0.1) -> int:
    """The square size to time `dtype`'s matmul at: doubled from 128 while one product takes under `enough` seconds,
    up to `largest`; the smallest any rank reached, so every rank times the same product. fp32 and GPUs reach
    `largest`. A CPU without fp16 or bf16 units takes seconds for one 1024 x 1024 product in those dtypes (2.6 and 2.3 s
    on one core of this project's CI machine) and stops at 512 (0.2 s), where its rate per flop is higher (1.29
    against 0.84 GFLOP/s in fp16), nearer the small products of a model that trains on CPU."""
    n = 128
    while n < largest:
        a = torch.randn(n, n, device=device).to(dtype)
        torch.mm(a, a)  # the first call of a size can carry a one-time cost
        _sync(device)
        started = time.perf_counter()
        torch.mm(a, a)
        _sync(device)
        if time.perf_counter() - started >= enough:
            break
        n *= 2
    agreed = torch.tensor([n], dtype=torch.int64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    return int(agreed.item())


def matmul_tflops(device: torch.device, dtype: torch.dtype, largest: int) -> float:
    n = matmul_size(device, dtype, largest)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    return 2 * n**3 / _timed(lambda: torch.mm(a, b), device) / 1e12


def collective_gbps(env: DistEnv, dtype: torch.dtype, shard_bytes: int) -> dict[str, float]:
    """Bus bandwidth of all-gather and reduce-scatter (GB/s): each rank sends and receives world-1 shards."""
    if env.world_size < 2:
        return {"all_gather": 0.0, "reduce_scatter": 0.0}
    n = shard_bytes // torch.tensor([], dtype=dtype).element_size()
    shard = torch.ones(n, dtype=dtype, device=env.device)
    full = torch.ones(n * env.world_size, dtype=dtype, device=env.device)
    moved = (env.world_size - 1) * n * shard.element_size()
    out = {}
    # NOTE: the *_tensor names are the ones FSDP2 calls; torch has begun to warn that they are renamed.
    warnings.filterwarnings("ignore", message=r".*(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated")
    for name, op in (
        ("all_gather", lambda: dist.all_gather_into_tensor(full, shard)),
        ("reduce_scatter", lambda: dist.reduce_scatter_tensor(shard, full)),
    ):
        out[name] = moved / _timed(op, env.device) / 1e9
    return out


def optimizer_gbps(device: torch.device, params: int) -> float:
    """AdamW's rate as the step-time model counts it: ADAMW_BYTES_PER_PARAM per parameter per second (GB/s), with
    the kernels the engine uses (fused on CUDA, foreach on CPU), over a few tensors as a model's shard has."""
    sizes = [params // 4] * 4
    ps = [torch.nn.Parameter(torch.randn(n, device=device)) for n in sizes]
    for p in ps:
        p.grad = torch.randn_like(p)
    kind = {"fused": True} if device.type == "cuda" else {"foreach": True}
    opt = torch.optim.AdamW(ps, lr=1e-6, **kind)
    return ADAMW_BYTES_PER_PARAM * sum(sizes) / _timed(opt.step, device) / 1e9


def memory_gbps(device: torch.device, elements: int) -> tuple[float, float]:
    """Bytes read and written per second by a large copy into memory already in use: the rate of the step's
    memory-bound work (casts, gathers' copies, gradient accumulation, activations). And, on CPU, the rate at which
    fresh memory is first touched (a large tensor allocated anew: the kernel maps and zeroes its pages), measured as
    the extra time of the same copy into a new tensor; 0 on CUDA, whose caching allocator reuses its blocks."""
    src = torch.randn(elements, device=device)
    dst = torch.empty_like(src)
    warm = _timed(lambda: dst.copy_(src), device)
    if device.type == "cuda":
        return 2 * 4 * elements / warm / 1e9, 0.0
    fresh = _timed(lambda: torch.empty_like(src).copy_(src), device)
    return 2 * 4 * elements / warm / 1e9, 4 * elements / max(fresh - warm, 1e-9) / 1e9


def measure(env: DistEnv, precisions: tuple[str, ...] = ("fp32", "fp16", "bf16")) -> dict[str, Any]:
    """Every rank takes part; the slowest rank's figure is kept (a step waits for it)."""
    cuda = env.device.type == "cuda"
    n = 4096 if cuda else 1024
    tflops = {p: matmul_tflops(env.device, DTYPES[p], n) for p in precisions}
    links = {p: collective_gbps(env, DTYPES[p], (64 if cuda else 16) * 2**20) for p in ("fp32", "fp16")}
    opt = optimizer_gbps(env.device, (64 if cuda else 8) * 2**20)
    copy, first_touch = memory_gbps(env.device, (256 if cuda else 32) * 2**20)
    values = [*tflops.values(), *(v for d in links.values() for v in d.values()), opt, copy, first_touch]
    t = torch.tensor(values, dtype=torch.float64)
    if env.world_size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
    it = iter(t.tolist())
    tflops = {p: next(it) for p in tflops}
    links = {p: {k: next(it) for k in d} for p, d in links.items()}
    return {
        "device": torch.cuda.get_device_name(env.device) if cuda else "cpu",
        "world_size": env.world_size,
        "threads_per_rank": torch.get_num_threads(),
        "matmul_tflops": tflops,
        "all_gather_gbps": {p: d["all_gather"] for p, d in links.items()},
        "reduce_scatter_gbps": {p: d["reduce_scatter"] for p, d in links.items()},
        "optimizer_gbps": next(it),
        "memory_gbps": next(it),
        "first_touch_gbps": next(it),
    }


def calibrate(cpu: bool, gpus: int) -> dict[str, Any]:
    """Launch `python -m fsdp_opt.calibrate` under torchrun on `gpus` ranks (CPU processes with `cpu`, else this
    machine's GPUs) and return what it measured."""
    if not cpu:
        if not torch.cuda.is_available():
            raise ConfigError("--calibrate: no GPU is visible here; add --cpu to measure and plan CPU processes")
        gpus = min(gpus, torch.cuda.device_count())
    with tempfile.TemporaryDirectory(prefix="fsdp-opt-calibrate-") as tmp:
        out = Path(tmp) / "rates.json"
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={gpus}",
            "-m",
            "fsdp_opt.calibrate",
            "--device",
            "cpu" if cpu else "cuda",
            "--json",
            str(out),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if not out.exists():
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise ConfigError(f"--calibrate: the measurement failed (exit {proc.returncode}): {last}")
        return json.loads(out.read_text())


def read_rates(path: str) -> dict[str, Any]:
    """A calibration written by `python -m fsdp_opt.calibrate --json` (or the `calibration` of a `plan --json`)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--rates {path}: cannot read a calibration from it ({type(exc).__name__})") from None
    data = data.get("calibration", data) if isinstance(data, dict) else data
    wanted = (
        "device",
        "world_size",
        "matmul_tflops",
        "all_gather_gbps",
        "reduce_scatter_gbps",
        "optimizer_gbps",
        "memory_gbps",
    )
    if not isinstance(data, dict) or any(k not in data for k in wanted):
        raise ConfigError(f"--rates {path}: not a calibration (python -m fsdp_opt.calibrate --json writes one)")
    return data
