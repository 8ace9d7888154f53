"""Run by the tests under torchrun with training flags (--method reward): the model's whole state before the step
(its new score layer included, beside the report as REPORT.pt), then one step's micro-batches forward and backward;
rank 0 reports the step's loss and sums, every parameter's whole gradient and each rank's micro-batches (the dataset
rows of their pairs, in order), so that TRL's RewardTrainer loss can be computed on the same pairs and weights.

Arguments: the report path, the flags."""

from __future__ import annotations

import sys

from one_step import every_rank, one_step, report, save_weights, set_up

from fsdp_opt.runtime.distributed import teardown
from fsdp_opt.runtime.exits import end_process


def main() -> None:
    out_path, flags = sys.argv[1], sys.argv[2:]
    env, s = set_up(flags)
    save_weights(s, env, out_path + ".pt")
    step = next(iter(s.plan.steps(0)))
    sums, grads = one_step(s, step)
    micro = every_rank(env, [[int(s.blocks.index[i]) for i in m] for m in step.micro_batches])
    record = s.loss.record(dict(zip(s.loss.names, sums.tolist())), step, 1.0)
    sequences = [s.blocks.ids[k] for k in range(len(s.blocks.ids))]
    loss = float(sums[0]) / s.loss.denominator(step)
    report(
        env,
        out_path,
        loss=loss,
        record=record,
        grads=grads,
        micro=micro,
        index=s.blocks.index.tolist(),
        sequences=sequences,
    )
    teardown()


if __name__ == "__main__":
    end_process(main)
