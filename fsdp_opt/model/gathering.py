"""The FSDP2 units of a sharded model, as generation on the model gathered once reads them (engine/generation.py):
their parameter groups and parameters, the gathered copies of their weights, and their forward hooks taken off for the
time the model stays gathered."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard

from fsdp_opt.model.parallelize import storages


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """Every FSDP2 unit of the model (its blocks and the root)."""
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def fsdp_groups(unit: nn.Module) -> list[Any]:
    """An FSDP2 unit's parameter groups (one, or several in torch versions that split them)."""
    state = unit._get_fsdp_state()
    return getattr(state, "_fsdp_param_groups", None) or [g for g in [getattr(state, "_fsdp_param_group", None)] if g]


def fsdp_params(unit: nn.Module) -> list[Any]:
    """An FSDP2 unit's own parameters as FSDP holds them (each with its sharded DTensor)."""
    return [fp for g in fsdp_groups(unit) for fp in g.fsdp_params]


def gathered_copies(model: nn.Module) -> set[int]:
    """Where the gathered copies of the FSDP units' parameters live while the units are unsharded (FSDP2's all-gather
    buffers, dropped at reshard), less anything a sharded parameter also lives in: weights that may be changed for
    the time the model stays gathered without changing the weights FSDP keeps."""
    params = [fp for m in model.modules() if isinstance(m, FSDPModule) for fp in fsdp_params(m)]
    sharded = {a for fp in params for a in storages(fp.sharded_param)}
    copies = {
        a for fp in params if getattr(fp, "_unsharded_param", None) is not None for a in storages(fp._unsharded_param)
    }
    return copies - sharded


# The attributes of nn.Module that hold its forward hooks (a hook's id in each that has it).
HOOK_TABLES = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)


@contextmanager
def forward_hooks_off(model: nn.Module, units: list[nn.Module]) -> Iterator[None]:
    """FSDP2's forward hooks of these units taken off for the block inside, and put back after in their places. Meant
    for units that are all unsharded and stay so (generation on the model gathered once): there the hooks do nothing
    a forward needs, yet each one costs the host its Python in every decoding step, and the root's makes FSDP's
    communication streams wait on the current one, which a CUDA graph's capture refuses. A unit whose hooks this
    torch keeps elsewhere is left as it is."""
    kept: list[tuple[nn.Module, dict[str, dict]]] = []
    if isinstance(model, FSDPModule) and units:
        # what the root's first forward sets up (which unit is the root, FSDP's streams), set up now: the forwards
        # inside run without it, and a later forward's hook finds it done
        fully_shard.state(model)._lazy_init()
    try:
        for unit in units:
            state = fully_shard.state(unit)
            ids = {
                getattr(h, "id", None)
                for h in (
                    getattr(state, "_pre_forward_hook_handle", None),
                    getattr(state, "_post_forward_hook_handle", None),
                )
            } - {None}
            tables = {name: getattr(unit, name) for name in HOOK_TABLES if hasattr(unit, name)}
            if not ids or not any(i in t for t in tables.values() for i in ids):
                continue
            kept.append((unit, {name: dict(t) for name, t in tables.items()}))
            for t in tables.values():
                for i in ids:
                    t.pop(i, None)
        yield
    finally:
        for unit, saved in kept:
            for name, before in saved.items():
                table = getattr(unit, name)
                table.clear()
                table.update(before)
