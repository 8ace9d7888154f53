"""Run by torchrun from the tests: hand a save's gathered payload off as the background writer gets it, train two
more steps, and report whether the payload still holds the state of the step it was gathered at."""

from __future__ import annotations

import copy
import json
import sys

import torch

from fsdp_opt.checkpoint import save as checkpoint_save
from fsdp_opt.checkpoint.names import MODEL_KEY
from fsdp_opt.checkpoint.save import save_checkpoint
from fsdp_opt.config.parse import parse_args
from fsdp_opt.engine.step import train_step
from fsdp_opt.runtime.distributed import init_distributed, teardown
from fsdp_opt.runtime.exits import end_process
from fsdp_opt.train.build import setup


def main() -> None:
    out_path = sys.argv[1]
    env = init_distributed("cpu")
    config = parse_args(
        [
            "--model",
            "tiny-opt",
            "--dataset",
            "python-docs",
            "--end_idx",
            "60",
            "--max_length",
            "64",
            "--batch_size",
            "2",
            "--output_dir",
            out_path + ".out",
        ]
    )
    s = setup(config, env)
    steps = s.plan.steps(0)
    train_step(s, next(steps))
    handed: list = []
    copies = {"n": 0}
    original = checkpoint_save.copy_live_tensors

    def counting(payload, model, optimizer):
        copies["n"] = original(payload, model, optimizer)
        return copies["n"]

    checkpoint_save.copy_live_tensors = counting  # save_checkpoint calls it through its module
    save_checkpoint(
        s.out_dir / "x.pt",
        env,
        s.model,
        s.optimizer,
        state=s.state,
        epochs_run=0,
        extra={},
        hand_off=lambda payload: handed.append((payload, copy.deepcopy(payload))),
    )
    for _ in range(2):
        train_step(s, next(steps))
    report = {"rank": env.rank, "handed": len(handed), "copied": copies["n"]}
    if handed:
        payload, snapshot = handed[0]
        flat = lambda d: {f"{k}/{kk}": t for k, v in d["optimizer"]["state"].items() for kk, t in v.items()}  # noqa: E731
        report["optimizer_unchanged"] = all(torch.equal(a, flat(snapshot)[k]) for k, a in flat(payload).items())
        report["model_unchanged"] = all(torch.equal(v, snapshot[MODEL_KEY][k]) for k, v in payload[MODEL_KEY].items())
        report["steps"] = sorted({float(t) for k, t in flat(payload).items() if k.endswith("/step")})
    with open(f"{out_path}.rank{env.rank}", "w") as f:
        json.dump(report, f)
    teardown()


if __name__ == "__main__":
    end_process(main)
