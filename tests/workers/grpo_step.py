"""Run by the tests under torchrun with training flags (--method grpo): one GRPO step's prepare phase and micro-batches
on completions given here instead of sampled (the engine's sampler stands aside), then rank 0 reports the step's
loss, every parameter's whole gradient, and what the step made of the completions (rewards, advantages).

With --num_iterations above 1, the first step trains (its optimizer step included) and the report is of the second
pass over the same generation; the weights that pass starts from are written beside the report (REPORT.pt).

Arguments: the report path, a JSON file of {"completions": {"row:g": [token ids]}, "ended": {...}}, the flags."""

from __future__ import annotations

import json
import sys

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

import fsdp_opt.engine.rollout as rollout
from fsdp_opt.config.parse import parse_args
from fsdp_opt.engine.generation import Generated
from fsdp_opt.engine.step import accumulate, train_step
from fsdp_opt.runtime.distributed import init_distributed, teardown
from fsdp_opt.runtime.exits import end_process
from fsdp_opt.train.build import setup


def main() -> None:
    out_path, given_path, flags = sys.argv[1], sys.argv[2], sys.argv[3:]
    given = json.loads(open(given_path).read())
    env = init_distributed("cpu")
    s = setup(parse_args(flags), env)
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
        weights = get_model_state_dict(s.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if env.rank == 0:
            torch.save(weights, out_path + ".pt")
        step = next(steps)
    s.optimizer.zero_grad(set_to_none=True)
    s.loss.prepare(s, step)
    _, sums = accumulate(s, step, 1.0)
    torch.distributed.all_reduce(sums)
    grads = {n: p.grad.full_tensor().tolist() for n, p in s.model.named_parameters() if p.grad is not None}
    records, micro = [None] * env.world_size, [None] * env.world_size
    torch.distributed.all_gather_object(records, s.loss.current.records)
    c = s.loss.current
    mine = [[[c.records[i]["row"], c.records[i]["place"]] for i in members] for members in c.micro]
    torch.distributed.all_gather_object(micro, mine)
    if env.rank == 0:
        with open(out_path, "w") as f:
            json.dump(
                {
                    "loss": float(sums[0]),
                    "kl": float(sums[1]),
                    "clips": sums[2:].tolist(),
                    "grads": grads,
                    "tokens": s.loss.current.totals["tokens"],
                    "iteration": step.generation.iteration + 1,
                    "records": [r for part in records for r in part],
                    "micro_batches": len(s.loss.current.micro),
                    "micro": micro,
                },
                f,
            )
    teardown()


if __name__ == "__main__":
    end_process(main)
