"""Run by the tests under torchrun with training flags (--method kto): one KTO step's micro-batches, then rank 0
reports the step's loss and sums, every parameter's whole gradient and each rank's micro-batches (the (row, answer)
of their items, in order), so that TRL's loss can be computed on the same micro-batches.

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
    micro = every_rank(env, [[[int(s.blocks.index[i]), int(s.blocks.parts[i])] for i in m] for m in step.micro_batches])
    record = s.loss.record(dict(zip(s.loss.names, sums.tolist())), step, 0.0)
    loss = float(sums[0]) / s.loss.denominator(step)
    report(env, out_path, loss=loss, record=record, grads=grads, micro=micro)
    teardown()


if __name__ == "__main__":
    end_process(main)
