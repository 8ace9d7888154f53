"""All-gather and reduce-scatter bandwidth between this launch's ranks, as FSDP uses them (fp16 buffers on CUDA over
NCCL, fp32 on CPU over gloo). Launched by gpu_check under torchrun, once with NCCL's peer-to-peer path and once with
NCCL_P2P_DISABLE=1, the known cure for NCCL hangs between PCIe GPUs under older drivers.

    torchrun --standalone --nproc_per_node=2 -m fsdp_opt.commbench --mib 64 --iters 10 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from fsdp_opt.runtime.distributed import init_distributed, teardown
from fsdp_opt.runtime.exits import end_process


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fsdp_opt.commbench")
    p.add_argument("--mib", type=float, default=64.0, help="each rank's shard, MiB")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    env = init_distributed(a.device)
    try:
        dtype = torch.float16 if env.device.type == "cuda" else torch.float32
        n = int(a.mib * 2**20) // torch.tensor([], dtype=dtype).element_size()
        shard = torch.ones(n, dtype=dtype, device=env.device)
        full = torch.empty(n * env.world_size, dtype=dtype, device=env.device)
        result = {
            "world_size": env.world_size,
            "device": env.device.type,
            "shard_bytes": shard.numel() * shard.element_size(),
            "nccl_p2p_disable": os.environ.get("NCCL_P2P_DISABLE", ""),
        }
        for name, op in (
            ("all_gather", lambda: dist.all_gather_into_tensor(full, shard)),
            ("reduce_scatter", lambda: dist.reduce_scatter_tensor(shard, full)),
        ):
            op()  # the first call sets the communicator up
            sync(env.device)
            started = time.perf_counter()
            for _ in range(a.iters):
                op()
            sync(env.device)
            seconds = (time.perf_counter() - started) / a.iters
            # Bus bandwidth: each rank sends and receives (world - 1) shards per collective.
            moved = (env.world_size - 1) * result["shard_bytes"]
            result[f"{name}_s"] = seconds
            result[f"{name}_gbps"] = moved / seconds / 1e9 if seconds > 0 else 0.0
        if env.is_main and a.json:
            Path(a.json).write_text(json.dumps(result))
        if env.is_main:
            print(json.dumps(result))
    finally:
        teardown()
    return 0


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


if __name__ == "__main__":
    end_process(main)
