"""Run by the tests on 3 ranks: what a full checkpoint gathers (checkpoint/state.py::gather_to_rank0, from torch's
sharded state dicts) against torch's own full state dicts (full_state_dict + cpu_offload), and the clipping norm
(engine/optim.py::global_grad_norm) against the norm of the whole gradients. Shards are uneven (17 rows over 3
ranks: 6, 6, 5) and one rank holds no row of a 2-row weight. Rank 0 prints one JSON line."""

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from fsdp_opt.checkpoint.state import gather_to_rank0
from fsdp_opt.engine.optim import ShardAdamW, global_grad_norm

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)

calls = {"all_gather_single": 0, "all_gather_into_tensor": 0, "all_reduce": 0}
for name in [n for n in calls if hasattr(dist, n)]:
    real = getattr(dist, name)

    def counted(*args, _real=real, _name=name, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls[_name] += 1
        return _real(*args, **kwargs)

    setattr(dist, name, counted)


def build(mesh) -> tuple[torch.nn.Module, torch.optim.Optimizer]:  # noqa: ANN001
    torch.manual_seed(0)
    m = torch.nn.Sequential(
        torch.nn.Linear(33, 17), torch.nn.LayerNorm(17), torch.nn.Linear(17, 2), torch.nn.Linear(2, 5)
    )
    for layer in m:
        fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    opt = ShardAdamW(m.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1 + rank)
    for _ in range(2):
        m(torch.randn(4, 33, generator=gen)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    m(torch.randn(4, 33, generator=gen)).pow(2).mean().backward()  # gradients left for the norm
    return m, opt


def same(a, b) -> bool:  # noqa: ANN001
    """Same keys in the same order, same values; tensors equal, of the same dtype and shape, on the CPU."""
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, type(a)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return (
            type(b) is torch.Tensor
            and b.device.type == "cpu"
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    return a == b


report: dict = {"world": world}
meshes = {
    "FULL_SHARD": init_device_mesh("cpu", (world,)),
    "NO_SHARD": init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard")),
}
for kind, mesh in meshes.items():
    m, opt = build(mesh)
    # the state a full checkpoint takes
    want = (get_model_state_dict(m, options=FULL), get_optimizer_state_dict(m, opt, options=FULL))
    before = sum(calls[n] for n in ("all_gather_single", "all_gather_into_tensor"))
    got = (gather_to_rank0(get_model_state_dict(m)), gather_to_rank0(get_optimizer_state_dict(m, opt)))
    report[f"{kind}_gathers"] = sum(calls[n] for n in ("all_gather_single", "all_gather_into_tensor")) - before
    small = (
        gather_to_rank0(get_model_state_dict(m), bucket_bytes=64),
        gather_to_rank0(get_optimizer_state_dict(m, opt), bucket_bytes=64),
    )  # a bucket for about every tensor
    report[f"{kind}_equal"] = same(want, got) and same(want, small)
    report[f"{kind}_entries"] = [len(want[0]), len(want[1].get("state", {}))]
    report[f"{kind}_rows_on_this_rank"] = (
        next(p for n, p in m.named_parameters() if n == "2.weight").to_local().shape[0]
    )
    # the optimizer's own state is untouched: still DTensors on every rank
    report[f"{kind}_state_kept"] = all(isinstance(s["exp_avg"], DTensor) for s in opt.state.values())
    # the clipping norm: one all-reduce, against the whole gradients' norm in float64
    grads = [p.grad for p in m.parameters()]
    whole = torch.cat([g.full_tensor().double().reshape(-1) for g in grads]).norm().item()
    before = calls["all_reduce"]
    norm = global_grad_norm(list(m.parameters()))
    report[f"{kind}_norm_reduces"] = calls["all_reduce"] - before
    report[f"{kind}_norm_rel_error"] = abs(norm.item() - whole) / whole
    report[f"{kind}_norm_plain"] = type(norm) is torch.Tensor
    dtensor_norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True).full_tensor().item()
    report[f"{kind}_norm_vs_dtensor"] = abs(norm.item() - dtensor_norm) / dtensor_norm

# Layouts FSDP2 does not make: DTensor's own full_tensor() gathers them.
mesh = meshes["FULL_SHARD"]
torch.manual_seed(0)
whole = {"cols": torch.randn(4, 7), "copy": torch.randn(3, 2)}
tree = {
    "cols": distribute_tensor(whole["cols"], mesh, [Shard(1)]),
    "copy": distribute_tensor(whole["copy"], mesh, [Replicate()]),
}
report["other_layouts_equal"] = same(whole, gather_to_rank0(tree)) if rank == 0 else gather_to_rank0(tree) == {}
gathered = gather_to_rank0(get_model_state_dict(m))  # every rank takes part; only rank 0 keeps the tensors
report["kept_here"] = len(gathered)

reports = [None] * world
dist.all_gather_object(reports, report)
if rank == 0:
    print(json.dumps(reports))
sys.stdout.flush()
dist.destroy_process_group()
