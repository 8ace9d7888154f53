"""Run by torchrun from the tests: one optimizer step per configuration, counting the bytes of every collective FSDP2
issues (all-gather outputs, reduce-scatter inputs, all-reduce tensors) by wrapping torch.distributed's functions."""

from __future__ import annotations

import json
import os
import sys

import torch.distributed as dist

from fsdp_opt.config.parse import parse_args
from fsdp_opt.engine.step import train_step
from fsdp_opt.runtime.distributed import init_distributed, teardown
from fsdp_opt.runtime.exits import end_process
from fsdp_opt.train.build import setup

counted: dict[str, int] = {}


def _counting(kind: str, fn, which: int, name: str):  # noqa: ANN001
    def wrapper(*args, **kwargs):  # noqa: ANN002, ANN003
        t = args[which] if len(args) > which else kwargs[name]
        if kind != "all_reduce" or t.numel() > 1:  # the trainer's own all-reduces are of one loss and one norm
            counted[kind] = counted.get(kind, 0) + t.numel() * t.element_size()
        return fn(*args, **kwargs)

    return wrapper


def main() -> None:
    out_path, configs = sys.argv[1], sys.argv[2:]
    env = init_distributed("cpu")
    report = {}
    for item in configs:
        strategy, every, checkpointing, precision = item.split(":")
        config = parse_args(
            [
                "--model",
                "tiny-opt",
                "--dataset",
                "python-docs",
                "--end_idx",
                "40",
                "--max_length",
                "64",
                "--batch_size",
                "2",
                "--accum_steps",
                "3",
                "--sharding_strategy",
                strategy,
                "--reduce_every_microbatch",
                every,
                "--activation_checkpointing",
                checkpointing,
                "--precision",
                precision,
                "--output_dir",
                os.path.dirname(out_path),
            ]
        )
        session = setup(config, env)
        counted.clear()
        saved = dist.all_gather_single, dist.reduce_scatter_single, dist.all_reduce
        dist.all_gather_single = _counting("all_gather", saved[0], 0, "output_tensor")  # output first
        dist.reduce_scatter_single = _counting("reduce_scatter", saved[1], 1, "input")  # input second
        dist.all_reduce = _counting("all_reduce", saved[2], 0, "tensor")
        try:
            train_step(session, next(session.plan.steps(0)))
        finally:
            dist.all_gather_single, dist.reduce_scatter_single, dist.all_reduce = saved
        report[item] = dict(counted)
    with open(f"{out_path}.rank{env.rank}", "w") as f:
        json.dump(report, f)
    teardown()


if __name__ == "__main__":
    end_process(main)
