"""Run by the tests: the optimizer a CUDA run builds (fused AdamW) stepping FSDP2's DTensor parameters, here on CPU,
against the foreach AdamW of CPU runs. Prints whether each was fused and the largest weight difference."""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
from fsdp_opt.engine.optim import build_optimizer

torch.manual_seed(0)


def run(dev):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    mesh = init_device_mesh("cpu", (1,))
    for l in m:
        fully_shard(l, mesh=mesh)
    fully_shard(m, mesh=mesh)
    opt = build_optimizer(m, 1e-2, 0.1, torch.device(dev))
    for _ in range(3):
        m(torch.ones(2, 16)).sum().backward()
        opt.step()
        opt.zero_grad()
    return [p.full_tensor().clone() for p in m.parameters()], opt.param_groups[0].get("fused")


a, fa = run("cpu")
b, fb = run("cuda")
print(fa, fb, max((x - y).abs().max().item() for x, y in zip(a, b)))
