"""Run by the tests under torchrun with training flags (--method grpo): one GRPO step's prepare phase and micro-batches
on completions given here instead of sampled (the engine's sampler stands aside), then rank 0 reports the step's
loss, every parameter's whole gradient, and what the step made of the completions (rewards, advantages).

With --num_iterations above 1, the first step trains (its optimizer step included) and the report is of the second
pass over the same generation; the weights that pass starts from are written beside the report (REPORT.pt).

Arguments: the report path, a JSON file of {"completions": {"row:g": [token ids]}, "ended": {...}}, the flags."""

from __future__ import annotations

import json
import sys

from one_step import every_rank, one_step, report, save_weights, set_up

import fsdp_opt.engine.rollout as rollout
from fsdp_opt.engine.generation import Generated
from fsdp_opt.engine.step import train_step
from fsdp_opt.runtime.distributed import teardown
from fsdp_opt.runtime.exits import end_process


def main() -> None:
    out_path, given_path, flags = sys.argv[1], sys.argv[2], sys.argv[3:]
    given = json.loads(open(given_path).read())
    env, s = set_up(flags)
    steps = iter(s.plan.steps(0))
    step = next(steps)
    prompts = s.blocks

    def injected(model, asked, keys, sampling, **kwargs) -> Generated:  # noqa: ANN001, ANN003
        mine = [int(p) for part in step.generation.prompts for p in part]
        pairs = [(int(prompts.index[p]), g) for p in mine for g in range(s.config.method.settings.num_generations)]
        return Generated(
            [given["completions"][f"{r}:{g}"] for r, g in pairs], [given["ended"][f"{r}:{g}"] for r, g in pairs]
        )

    rollout.generate = injected
    if s.config.method.settings.num_iterations > 1:  # the first pass trains; the report is of the second
        train_step(s, step)
        save_weights(s, env, out_path + ".pt")
        step = next(steps)
    sums, grads = one_step(s, step)
    c = s.loss.current
    records = every_rank(env, c.records)
    micro = every_rank(env, [[[c.records[i]["row"], c.records[i]["place"]] for i in members] for members in c.micro])
    report(
        env,
        out_path,
        loss=float(sums[0]),
        kl=float(sums[1]),
        clips=sums[2:].tolist(),
        grads=grads,
        tokens=c.totals["tokens"],
        iteration=step.generation.iteration + 1,
        records=[r for part in records for r in part],
        micro_batches=len(c.micro),
        micro=micro,
    )
    teardown()


if __name__ == "__main__":
    end_process(main)
