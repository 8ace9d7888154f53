"""Run by the tests on 2 ranks: the engine's AdamW (ShardAdamW, stepping local shards) against torch's AdamW stepping
the same FSDP2 model's DTensors, foreach and fused, with uneven shards, two weight-decay groups, a frozen weight and
a weight without a gradient; and the state dicts a checkpoint takes of both. Rank 0 prints one JSON line: whether
weights, moments and state dicts were bit-identical, and whether every update ran on plain tensors."""

import json

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from fsdp_opt.engine.optim import ShardAdamW

dist.init_process_group("gloo")
rank = dist.get_rank()


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(
        torch.nn.Linear(33, 17), torch.nn.LayerNorm(17), torch.nn.Linear(17, 5), torch.nn.Linear(5, 3)
    )
    m[1].weight.requires_grad_(False)  # frozen: no state
    for layer in m:
        fully_shard(layer)
    fully_shard(m)
    return m


def groups(m: torch.nn.Module) -> list[dict]:
    params = [p for p in m.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def train(m: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed + rank)
    for _ in range(steps):
        out = m[2](m[1](m[0](torch.randn(6, 33, generator=gen))))  # m[3] unused: its weights get no gradient
        out.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def full(m: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [p.full_tensor() for p in m.parameters()]
    for p in m.parameters():  # in the model's order (the state's own order is the order it was made or loaded in)
        if p in opt.state:
            state = opt.state[p]
            out += [state["exp_avg"].full_tensor(), state["exp_avg_sq"].full_tensor(), state["step"].float()]
    return out


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# Whether the update really ran on plain tensors (a fallback to the DTensors would give the same numbers).
stepped_dtensors = []
_init_group = ShardAdamW._init_group


def _watched(self, group, *lists):  # noqa: ANN001, ANN202
    out = _init_group(self, group, *lists)
    stepped_dtensors.append(any(isinstance(t, DTensor) for f in lists if isinstance(f, list) for t in f))
    return out


ShardAdamW._init_group = _watched

report = {}
for kind in ("foreach", "fused"):
    ref_m, mine_m = model(), model()
    ref = torch.optim.AdamW(groups(ref_m), lr=1e-2, **{kind: True})
    mine = ShardAdamW(groups(mine_m), lr=1e-2, **{kind: True})
    train(ref_m, ref, 5, 1)
    train(mine_m, mine, 5, 1)
    report[kind] = same(full(ref_m, ref), full(mine_m, mine))
    report[f"{kind}_state_dtensor"] = all(isinstance(s["exp_avg"], DTensor) for s in mine.state.values())
    report[f"{kind}_states"] = len(mine.state)
    report[f"{kind}_local"] = bool(stepped_dtensors) and not any(stepped_dtensors)
    stepped_dtensors.clear()
    # what a checkpoint holds of each: the same names, values and types
    a, b = get_optimizer_state_dict(ref_m, ref), get_optimizer_state_dict(mine_m, mine)
    flat = lambda sd: {(k, s): v for k, st in sd["state"].items() for s, v in st.items()}  # noqa: E731
    fa, fb = flat(a), flat(b)
    report[f"{kind}_state_dict"] = (
        fa.keys() == fb.keys()
        and a["param_groups"] == b["param_groups"]
        and all(type(fa[k]) is type(fb[k]) and torch.equal(fa[k], fb[k]) for k in fa)
    )

if rank == 0:
    print(json.dumps(report))
dist.destroy_process_group()
