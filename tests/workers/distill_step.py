"""Run by the tests under torchrun with training flags (--method distill): one step (its completions sampled, its
micro-batches forward and backward), then rank 0 reports the step's loss and sums, every parameter's whole gradient
and each rank's micro-batches (the prompt and completion tokens of each of their completions), so that TRL's loss can
be computed on the same completions.

Arguments: the report path, the flags."""

from __future__ import annotations

import sys

from one_step import every_rank, one_step, report, set_up

from fsdp_opt.runtime.distributed import teardown
from fsdp_opt.runtime.exits import end_process


def main() -> None:
    out_path, flags = sys.argv[1], sys.argv[2:]
    env, s = set_up(flags)
    step = next(iter(s.plan.steps(0)))
    sums, grads = one_step(s, step)
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
    micro = every_rank(env, mine)
    record = s.loss.record(dict(zip(s.loss.names, sums.tolist())), step, 1.0)
    loss = float(sums[0]) / s.loss.denominator(step)
    report(env, out_path, loss=loss, record=record, grads=grads, micro=micro)
    teardown()


if __name__ == "__main__":
    end_process(main)
