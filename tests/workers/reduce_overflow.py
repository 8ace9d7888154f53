"""Run by torchrun from the tests (2 CPU ranks): a gradient that each rank holds finitely in fp16 but whose sum over
the ranks is past fp16's largest value (65504). Reduce-scattered in fp16 it arrives as inf, so the engine's overflow
check (a non-finite global gradient norm) sees it and skips the step; reduced in fp32 it arrives exact."""

from __future__ import annotations

import json
import sys

import torch
from torch import nn

from fsdp_opt.engine.optim import global_grad_norm
from fsdp_opt.model.parallelize import apply_fsdp, build_mesh, mixed_precision_policy
from fsdp_opt.runtime.distributed import init_distributed, teardown
from fsdp_opt.runtime.exits import end_process


class Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Linear(4, 4, bias=False)
        self.head = nn.Linear(4, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x))


def main() -> None:
    out = {}
    env = init_distributed("cpu")
    try:
        for reduce_dtype in ("fp32", "fp16"):
            torch.manual_seed(0)
            model = Two()
            with torch.no_grad():
                model.block.weight.fill_(1.0)
                model.head.weight.fill_(1.0)
            apply_fsdp(
                model,
                [model.block],
                build_mesh("FULL_SHARD", env),
                strategy="FULL_SHARD",
                mp_policy=mixed_precision_policy("fp16", reduce_dtype),
                offload=False,
            )
            # d(sum of the output)/d(block.weight[i, 0]) = x[0] and d/d(head.weight[0, i]) = 40000: finite in fp16 on
            # every rank, 80000 summed over the two.
            x = torch.tensor([[40000.0, 0.0, 0.0, 0.0]])
            model(x).sum().backward()
            norm = global_grad_norm([p for p in model.parameters()])
            local = model.block.weight.grad.to_local()
            out[reduce_dtype] = {
                "norm": float(norm),
                "block_grad_max": float(local.float().abs().max()),
                "grad_dtype": str(local.dtype),
            }
        if env.is_main:
            with open(sys.argv[1], "w") as f:
                json.dump(out, f)
    finally:
        teardown()


if __name__ == "__main__":
    end_process(main)
