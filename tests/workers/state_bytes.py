"""Run by torchrun from the tests: one optimizer step and one more backward per strategy, then report this
rank's state bytes (parameters, gradients, optimizer)."""

from __future__ import annotations

import json
import os
import sys

from fsdp_opt.config.parse import parse_args
from fsdp_opt.engine.step import train_step
from fsdp_opt.model.parallelize import local_state_bytes
from fsdp_opt.runtime.distributed import init_distributed, teardown
from fsdp_opt.runtime.exits import end_process
from fsdp_opt.train.build import setup


def main() -> None:
    out_path, strategies = sys.argv[1], sys.argv[2:]
    env = init_distributed("cpu")
    report = {}
    for strategy in strategies:
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
                "--sharding_strategy",
                strategy,
                "--output_dir",
                os.path.dirname(out_path),
            ]
        )
        session = setup(config, env)
        step = next(session.plan.steps(0))
        train_step(session, step)  # creates the optimizer state
        batch = session.blocks.batch(step.micro_batches[0], env.device)
        session.model(**batch).loss.backward()  # and gradients (train_step clears its own after the update)
        report[strategy] = local_state_bytes(session.model, session.optimizer)
    with open(f"{out_path}.rank{env.rank}", "w") as f:
        json.dump(report, f)
    teardown()


if __name__ == "__main__":
    end_process(main)
