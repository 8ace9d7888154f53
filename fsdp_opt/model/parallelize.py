"""Sharding: wrap policy, mesh, mixed precision, activation checkpointing, FSDP2, weight loading.

Setup order (every rank): skeleton on meta -> activation checkpointing -> shard each block, then the root
-> allocate local shards -> receive full weights from rank 0 by broadcast -> check the tie and that
nothing is left on meta.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from fsdp_opt.base import ConfigError, ModelError
from fsdp_opt.config.choices import shard_count
from fsdp_opt.model.families import block_class_names
from fsdp_opt.runtime.distributed import DistEnv, all_ranks_ok

# The torch dtype of each --precision (and --export_dtype): config/choices.py names them without importing torch.
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def resolve_precision(precision: str, device: torch.device) -> str:
    """'auto' -> bf16 on GPUs that have it, fp16 on other GPUs (T4), fp32 on CPU."""
    if device.type == "cuda":
        has_bf16 = torch.cuda.get_device_capability(device)[0] >= 8
        if precision == "auto":
            return "bf16" if has_bf16 else "fp16"
        if precision == "bf16" and not has_bf16:
            name = torch.cuda.get_device_name(device)
            raise ConfigError(f"--precision bf16: {name} has no bf16 support (use fp16 or auto)")
        return precision
    return "fp32" if precision == "auto" else precision


def mixed_precision_policy(precision: str, reduce_dtype: str = "fp32") -> MixedPrecisionPolicy:
    # NOTE: fp32 reduce by default: an fp16 reduce-scatter loses gradient bits and can overflow across ranks. With
    # --reduce_dtype fp16 an overflow shows as a non-finite gradient norm and the step is skipped (engine.step).
    return MixedPrecisionPolicy(param_dtype=DTYPES[precision], reduce_dtype=DTYPES[reduce_dtype])


class _HalfLinear(torch.autograd.Function):
    """y = x W^T + b for half-precision x, W, b: the products in fp32, each result rounded once to the half dtype,
    forward and backward. The same arithmetic as torch's CPU half kernel (it accumulates in fp32 too), and as a GPU's
    tensor cores; saved for backward: x and W in the half dtype, as torch's own linear saves them."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:  # noqa: ANN001
        ctx.save_for_backward(x, weight)
        ctx.bias_dtype = None if bias is None else bias.dtype
        return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        x, weight = ctx.saved_tensors
        g = grad.float()
        gx = (g @ weight.float()).to(x.dtype) if ctx.needs_input_grad[0] else None
        rows = g.reshape(-1, g.shape[-1])
        gw = (rows.t() @ x.reshape(-1, x.shape[-1]).float()).to(weight.dtype) if ctx.needs_input_grad[1] else None
        gb = rows.sum(0).to(ctx.bias_dtype) if ctx.bias_dtype is not None and ctx.needs_input_grad[2] else None
        return gx, gw, gb


HALF = (DTYPES["fp16"], DTYPES["bf16"])


def _linear_forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    w, b = module.weight, module.bias
    plain = (torch.Tensor, nn.Parameter)
    if (
        x.dtype in HALF
        and w.dtype == x.dtype
        and x.device.type == "cpu"
        and type(w) in plain
        and type(x) in plain
        and (b is None or (b.dtype == x.dtype and type(b) in plain))
    ):
        return _HalfLinear.apply(x, w, b)
    return F.linear(x, w, b)


def fp32_products_on_cpu(model: nn.Module, device: torch.device, precision: str) -> int:
    """A CPU run in fp16 or bf16 (nothing otherwise): every nn.Linear (LoRA's adapters included) computes through
    `_HalfLinear`, the same rounding as torch's half kernel at fp32's speed. A CPU without half-precision units (AVX2
    only, as this project's CI machine) runs torch's fp16 matrix product at about 1.3 GFLOP/s against about 75 in fp32:
    a real-width layer's step took 11 s. Other inputs (fp32, GPU tensors, NF4 weights) take nn.Linear's own path.
    Returns the layer count."""
    if device.type != "cpu" or DTYPES.get(precision) not in HALF:
        return 0
    layers = [m for m in model.modules() if type(m) is nn.Linear]
    for m in layers:
        m.forward = _linear_forward.__get__(m)
    return len(layers)


def find_block_classes(model: nn.Module) -> set[type[nn.Module]]:
    """The decoder block classes that occur in the model: its family's (OPTDecoderLayer for OPT), or for another
    architecture the ones its `_no_split_modules` names."""
    names = block_class_names(model)
    found = {type(m) for m in model.modules() if type(m).__name__ in names}
    if not found:
        listed = ", ".join(sorted(names)) or "nothing"
        raise ModelError(
            f"--model: no transformer block to shard: its blocks would be {listed}, "
            f"and no module of {type(model).__name__} matches"
        )
    return found


def find_blocks(model: nn.Module, classes: set[type[nn.Module]]) -> list[nn.Module]:
    """Outermost modules of the block classes, in model order."""
    blocks: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside:
            continue
        if type(module) in classes:
            blocks.append(module)
            inside.update(id(m) for m in module.modules())
    return blocks


def check_no_shared_params(model: nn.Module, blocks: list[nn.Module]) -> None:
    """A weight used both inside a block and outside it cannot be sharded in two units (torch refuses)."""
    for i, block in enumerate(blocks):
        inside = {id(m) for m in block.modules()}
        mine = {id(p) for p in block.parameters()}
        for name, module in model.named_modules():
            if id(module) not in inside and any(id(p) in mine for p in module.parameters(recurse=False)):
                raise ModelError(
                    f"--model: block {i} ({type(block).__name__}) shares a weight with {name}; "
                    "tied weights must stay in one FSDP unit"
                )


def apply_activation_checkpointing(model: nn.Module, blocks: list[nn.Module]) -> list[nn.Module]:
    """Recompute each block's activations in backward. Returns the blocks to shard.

    Transformers' own per-layer checkpointing is used where the model has it: it keeps parameter names
    unchanged and is written to sit inside FSDP2's layer subclasses. Other models get torch's wrapper.
    """
    if getattr(model, "supports_gradient_checkpointing", False):
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        return blocks
    targets = {id(b) for b in blocks}
    wrapped: list[nn.Module] = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if id(child) in targets:
                w = checkpoint_wrapper(child, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
                setattr(parent, name, w)
                wrapped.append(w)
    order = {id(b): i for i, b in enumerate(blocks)}
    wrapped.sort(key=lambda w: order[id(w._checkpoint_wrapped_module)])
    return wrapped


def build_mesh(strategy: str, env: DistEnv) -> DeviceMesh:
    device_type = env.device.type
    shards = shard_count(strategy, env.world_size, env.local_world_size)
    if strategy == "HYBRID_SHARD" and env.world_size % shards:
        raise ConfigError(
            f"--sharding_strategy HYBRID_SHARD: {env.world_size} ranks do not split into nodes of {shards}"
        )
    if strategy in ("NO_SHARD", "HYBRID_SHARD"):
        # Replicate across the first dimension, shard within the second. NO_SHARD: a shard dimension of size 1 makes
        # FSDP an all-reduce, as in DDP.
        return init_device_mesh(device_type, (env.world_size // shards, shards), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device_type, (shards,), mesh_dim_names=("shard",))


def apply_fsdp(
    model: nn.Module,
    blocks: list[nn.Module],
    mesh: DeviceMesh,
    *,
    strategy: str,
    mp_policy: MixedPrecisionPolicy,
    offload: bool,
    prefetch: int = 0,
    ignored: set[nn.Parameter] | None = None,
) -> nn.Module:
    """Shard each block as its own unit, then the root (embeddings, tied lm_head, final norm). `ignored` parameters
    stay whole on every rank, outside FSDP."""
    offload_policy: OffloadPolicy = (
        CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else OffloadPolicy()
    )
    # FULL_SHARD frees gathered weights after forward; SHARD_GRAD_OP keeps them until backward.
    reshard = strategy in ("FULL_SHARD", "HYBRID_SHARD")
    common = dict(mesh=mesh, mp_policy=mp_policy, offload_policy=offload_policy)
    if ignored:
        common["ignored_params"] = set(ignored)
    for block in blocks:
        fully_shard(block, reshard_after_forward=reshard, **common)
    fully_shard(model, reshard_after_forward=False, **common)
    if prefetch > 0:
        # Blocks run in list order in forward and in reverse in backward; each one starts the gathers of
        # the next `prefetch` blocks of its direction when it starts.
        for i, block in enumerate(blocks):
            block.set_modules_to_forward_prefetch(blocks[i + 1 : i + 1 + prefetch])
            block.set_modules_to_backward_prefetch(blocks[max(0, i - prefetch) : i][::-1])
    # NOTE: transformers' decoder layers return views; nothing here modifies a block output in place,
    # which is the only case FSDP2's warning is about.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # Gradients are summed, not averaged, across ranks: the loss is already divided by the
            # global token count of the step. Sum-only collectives also keep gloo (no PREMUL_SUM) working.
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model


def shard_model(
    model: nn.Module,
    env: DistEnv,
    *,
    strategy: str,
    precision: str,
    activation_checkpointing: bool,
    offload: bool = False,
    compile_blocks: bool = False,
    prefetch: int = 0,
    ignored: set[nn.Parameter] | None = None,
    reduce_dtype: str = "fp32",
) -> tuple[set[type[nn.Module]], int]:
    """Wrap policy -> (activation checkpointing) -> mesh -> FSDP2, on a meta model. Returns the block classes
    and the number of blocks (each its own FSDP unit, plus the root)."""
    classes = all_ranks_ok(lambda: find_block_classes(model))
    blocks = find_blocks(model, classes)
    all_ranks_ok(lambda: check_no_shared_params(model, blocks))
    if activation_checkpointing:
        blocks = apply_activation_checkpointing(model, blocks)
    if compile_blocks:
        for block in blocks:
            inner = getattr(block, "_checkpoint_wrapped_module", block)
            # Only the block's own forward: FSDP2's hooks around it (gathers, reduce-scatters) stay eager.
            inner.forward = torch.compile(inner.forward)
    mesh = build_mesh(strategy, env)
    apply_fsdp(
        model,
        blocks,
        mesh,
        strategy=strategy,
        mp_policy=mixed_precision_policy(precision, reduce_dtype),
        offload=offload,
        prefetch=prefetch,
        ignored=ignored,
    )
    return classes, len(blocks)


def tie_and_check(model: nn.Module) -> None:
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "tie_word_embeddings", False):
        inp, out = model.get_input_embeddings(), model.get_output_embeddings()
        if inp is not None and out is not None and out.weight is not inp.weight:
            out.weight = inp.weight
    left = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.is_meta]
    if left:
        raise RuntimeError(f"still on the meta device after loading: {left[:5]}")


def local_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes this rank holds for parameters, gradients and optimizer state (local shards only)."""

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    params = sum(local(p).numel() * local(p).element_size() for p in model.parameters())
    grads = sum(local(p.grad).numel() * local(p.grad).element_size() for p in model.parameters() if p.grad is not None)
    optim = 0
    if optimizer is not None:
        for state in optimizer.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    optim += local(v).numel() * local(v).element_size()
    return {"params": params, "grads": grads, "optimizer": optim, "total": params + grads + optim}


def block_linear_names(model: nn.Module) -> list[str]:
    """Full names of the linear layers inside the decoder blocks (the blocks the wrap policy shards)."""
    from transformers.pytorch_utils import Conv1D

    blocks = {id(b) for b in find_blocks(model, find_block_classes(model))}
    names: list[str] = []
    prefix_of_block: list[str] = [n for n, m in model.named_modules() if id(m) in blocks]
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, Conv1D)) and any(name.startswith(p + ".") for p in prefix_of_block):
            names.append(name)
    return names


# What shard_group answers for a DTensor that FSDP2 keeps whole on every rank (NO_SHARD's Replicate).
REPLICATED = "replicated"


def shard_group(t: Any) -> Any:
    """For a DTensor in one of FSDP2's layouts: the process group it is sharded over on dim 0 (Shard(0) on one mesh
    dimension, Replicate on any other), or REPLICATED when no mesh dimension shards it. None for any other layout
    (strided, partial, sharded on another dim) or a 0-dim tensor: callers then take DTensor's own ops."""
    if not all(type(p) is Replicate or (type(p) is Shard and p.dim == 0) for p in t.placements) or len(t.shape) == 0:
        return None
    shard_dims = [i for i, p in enumerate(t.placements) if type(p) is Shard]
    if not shard_dims:
        return REPLICATED
    return t.device_mesh.get_group(shard_dims[0]) if len(shard_dims) == 1 else None


def storages(t: torch.Tensor) -> list[int]:
    """The addresses of the storages that hold a tensor's data: a DTensor's local shard's, and a wrapper subclass's
    inner tensors' (torchao's NF4 base keeps its bytes and scales in plain tensors and has no storage of its own)."""
    t = t.to_local() if isinstance(t, DTensor) else t
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        return [a for name in names for a in storages(getattr(t, name))]
    return [t.untyped_storage().data_ptr()]
