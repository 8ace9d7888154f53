"""Run by torchrun from the tests with the training flags of a LoRA run: gather the frozen base before and after
training and report whether any bit of it changed, the dtypes it holds, what the optimizer holds, and the trained
model's logits on fixed ids (for the exported adapter to be compared against)."""

from __future__ import annotations

import json
import sys

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from fsdp_opt.config.parse import parse_args
from fsdp_opt.runtime.distributed import init_distributed, teardown
from fsdp_opt.runtime.exits import end_process
from fsdp_opt.train.build import setup
from fsdp_opt.train.run import train_session


def frozen_state(model) -> dict[str, torch.Tensor]:
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    trainable = {n.replace("_checkpoint_wrapped_module.", "") for n, p in model.named_parameters() if p.requires_grad}
    return {k: v.clone() for k, v in full.items() if k not in trainable}


def main() -> None:
    config = parse_args(sys.argv[1:])
    env = init_distributed("cpu")
    s = setup(config, env)
    before = frozen_state(s.model)
    adapters_before = {n: p.full_tensor().clone() for n, p in s.model.named_parameters() if p.requires_grad}
    train_session(s)
    after = frozen_state(s.model)
    ids = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(5))
    s.model.eval()
    with torch.no_grad():
        logits = s.model(input_ids=ids).logits.float()
    moved = any(
        not torch.equal(p.full_tensor(), adapters_before[n]) for n, p in s.model.named_parameters() if p.requires_grad
    )
    if env.is_main:
        report = {
            "base_tensors": len(before),
            "base_changed": [k for k in before if not torch.equal(before[k], after[k])],
            "frozen_dtypes": sorted({str(p.dtype).split(".")[1] for p in s.model.parameters() if not p.requires_grad}),
            "trainable_dtypes": sorted({str(p.dtype).split(".")[1] for p in s.model.parameters() if p.requires_grad}),
            "trainable_params": sum(1 for p in s.model.parameters() if p.requires_grad),
            "optimizer_params": sum(len(g["params"]) for g in s.optimizer.param_groups),
            "adapters_moved": moved,
            "ids": ids.tolist(),
            "logits": logits.tolist(),
        }
        (s.out_dir / "lora_check.json").write_text(json.dumps(report))
    teardown()


if __name__ == "__main__":
    end_process(main)
