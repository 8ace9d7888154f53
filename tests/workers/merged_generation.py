"""Run by the tests on 1 and 2 ranks: LoRA adapters merged into the gathered weights while the model generates.

A small OPT with adapters whose B is not zero (so merging changes the weights), sharded by FSDP2 (each block and
the root), in fp32 or with fp16 compute. Rank 0 prints one JSON line:
- how many LoRA layers were merged inside `gathered`, and whether every layer's flag was cleared after;
- the largest difference between the logits inside (merged) and the logits before it (adapters beside the base);
- whether the logits after it, and every sharded parameter, are bit for bit what they were before;
- whether greedy completions inside equal those of the same model unmerged (generation on the shards);
- the FSDP units' forward hooks before, inside (FSDP's taken off: the model stays gathered) and after."""

import json
import sys

import torch
import torch.distributed as dist
from peft.tuners.lora import LoraLayer
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from transformers import OPTConfig, OPTForCausalLM

from fsdp_opt.config.layout import LoraConfig
from fsdp_opt.engine.generation import Sampling, gathered, generate
from fsdp_opt.model.adapters import inject
from fsdp_opt.model.gathering import fsdp_params

dist.init_process_group("gloo")
rank = dist.get_rank()
half = len(sys.argv) > 1 and sys.argv[1] == "fp16"

torch.manual_seed(0)
config = OPTConfig(
    vocab_size=512,
    hidden_size=64,
    ffn_dim=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    word_embed_proj_dim=64,
    max_position_embeddings=128,
    dropout=0.0,
    attention_dropout=0.0,
    activation_dropout=0.0,
    layerdrop=0.0,
)
model = OPTForCausalLM(config)
inject(model, LoraConfig(lora_rank=4, lora_dropout=0.0), meta=False, seed=0)
with torch.no_grad():
    for name, p in model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero: give the adapters something to merge
            p.normal_(0.0, 0.05)
policy = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32) if half else MixedPrecisionPolicy()
for layer in model.model.decoder.layers:
    fully_shard(layer, mp_policy=policy)
fully_shard(model, mp_policy=policy)
model.eval()

ids = torch.randint(3, 512, (3, 12), generator=torch.Generator().manual_seed(7))


def logits() -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def sharded() -> list[torch.Tensor]:
    """Every parameter as FSDP keeps it (its local shard), whether the module holds it or a gathered copy now."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    return [fp.sharded_param.to_local().clone() for u in units for fp in fsdp_params(u)]


def lora_layers() -> list[torch.nn.Module]:
    return [m for m in model.modules() if isinstance(m, LoraLayer)]


def complete() -> list[list[int]]:
    made = generate(
        model,
        ids.tolist(),
        torch.zeros(3, dtype=torch.int64),
        Sampling(6, top_k=1),
        eos_ids=[],
        pad_id=1,
        device=torch.device("cpu"),
    )
    return made.ids


def hooks() -> int:
    """The forward hooks the FSDP units hold (FSDP2's pre- and post-forward hooks among them)."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    return sum(len(u._forward_pre_hooks) + len(u._forward_hooks) for u in units)


before, weights, hooks_before = logits(), sharded(), hooks()
with gathered(model, gather=False):  # on the shards: nothing is merged
    unmerged_completions = complete()
with gathered(model):
    merged = sum(m.merged for m in lora_layers())
    hooks_inside = hooks()
    inside = logits()
    merged_completions = complete()
after = logits()
result = {
    "layers": len(lora_layers()),
    "merged": merged,
    "cleared": not any(m.merged for m in lora_layers()),
    "inside_max_diff": (inside - before).abs().max().item(),
    "after_equal": torch.equal(after, before),
    "weights_equal": all(torch.equal(a, b) for a, b in zip(weights, sharded())),
    "same_completions": merged_completions == unmerged_completions,
    "hooks": [hooks_before, hooks_inside, hooks()],
}
if rank == 0:
    print(json.dumps(result))
dist.destroy_process_group()
