"""What the step workers share (distill_step.py, grpo_step.py, kto_step.py, reward_step.py): the run set up from the
training flags, one step's micro-batches forward and backward, each rank's part gathered, and rank 0's report."""

from __future__ import annotations

import json
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from fsdp_opt.config.parse import parse_args
from fsdp_opt.engine.step import accumulate
from fsdp_opt.runtime.distributed import DistEnv, init_distributed
from fsdp_opt.train.build import setup


def set_up(flags: list[str]) -> tuple[DistEnv, Any]:
    """The process group (gloo, CPU) and the trainer's session of these flags."""
    env = init_distributed("cpu")
    return env, setup(parse_args(flags), env)


def save_weights(session: Any, env: DistEnv, path: str) -> None:  # noqa: ANN401
    """The model's whole state as it is now, at `path` (rank 0): the weights a reference library starts from."""
    weights = get_model_state_dict(session.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if env.rank == 0:
        torch.save(weights, path)


def one_step(session: Any, step: Any) -> tuple[torch.Tensor, dict[str, list]]:  # noqa: ANN401
    """The step's micro-batches forward and backward (no optimizer step): the method's sums over every rank, and each
    trained parameter's whole gradient."""
    session.optimizer.zero_grad(set_to_none=True)
    session.loss.prepare(session, step)
    _, sums = accumulate(session, step, 1.0)
    torch.distributed.all_reduce(sums)
    grads = {n: p.grad.full_tensor().tolist() for n, p in session.model.named_parameters() if p.grad is not None}
    return sums, grads


def every_rank(env: DistEnv, mine: Any) -> list:  # noqa: ANN401
    """This rank's `mine` and every other rank's, in rank order."""
    out = [None] * env.world_size
    torch.distributed.all_gather_object(out, mine)
    return out


def report(env: DistEnv, path: str, **fields: Any) -> None:  # noqa: ANN401
    """Rank 0 writes the report as JSON."""
    if env.rank == 0:
        with open(path, "w") as f:
            json.dump(fields, f)
