"""Run by the tests under torchrun with training flags (--method distill): one step (its completions sampled, its
micro-batches forward and backward), then rank 0 reports the step's loss and sums, every parameter's whole gradient
and each rank's micro-batches (the prompt and completion tokens of each of their completions), so that TRL's loss can
be computed on the same completions.

Arguments: the report path, the flags."""

from __future__ import annotations

import json
import sys

import torch

from fsdp_opt.config.parse import parse_args
from fsdp_opt.engine.step import accumulate
from fsdp_opt.runtime.distributed import init_distributed, teardown
from fsdp_opt.runtime.exits import end_process
from fsdp_opt.train.build import setup


def main() -> None:
    out_path, flags = sys.argv[1], sys.argv[2:]
    env = init_distributed("cpu")
    s = setup(parse_args(flags), env)
    step = next(iter(s.plan.steps(0)))
    s.optimizer.zero_grad(set_to_none=True)
    s.loss.prepare(s, step)
    _, sums = accumulate(s, step, 1.0)
    torch.distributed.all_reduce(sums)
    grads = {n: p.grad.full_tensor().tolist() for n, p in s.model.named_parameters() if p.grad is not None}
    c = s.loss.current
    mine = [
        [
            {
                "prompt": [t for t, on in zip(c.sequences[i], c.targets[i]) if not on],
                "completion": [t for t, on in zip(c.sequences[i], c.targets[i]) if on],
            }
            for i in members
        ]
        for members in c.micro
    ]
    micro = [None] * env.world_size
    torch.distributed.all_gather_object(micro, mine)
    record = s.loss.record(dict(zip(s.loss.names, sums.tolist())), step, 1.0)
    if env.rank == 0:
        with open(out_path, "w") as f:
            json.dump(
                {"loss": float(sums[0]) / s.loss.denominator(step), "record": record, "grads": grads, "micro": micro}, f
            )
    teardown()


if __name__ == "__main__":
    end_process(main)
