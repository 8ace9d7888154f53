"""The 4-bit base of QLoRA (--base_bits 4): the frozen linear weights of the blocks quantized to NF4 by torchao, each
rank holding the blocks of its shards; the rest of the frozen base stored in the compute dtype."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fsdp_opt.base import ConfigError
from fsdp_opt.model.parallelize import block_linear_names
from fsdp_opt.runtime.torchao_gate import check_for_nf4


def store_base(model: nn.Module, dtype: torch.dtype) -> None:
    """The frozen parameters in `dtype` (on meta: only their declared dtype), the adapters in fp32. The parameter
    objects stay the same, so tied weights stay tied."""
    for p in model.parameters():
        want = torch.float32 if p.requires_grad else dtype
        if p.dtype != want:
            p.data = p.data.to(want)


def _to_nf4() -> Any:
    """torchao's NF4 quantizer (its module moved between releases)."""
    check_for_nf4()
    try:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4
    except ImportError:
        from torchao.dtypes.nf4tensor import to_nf4
    return to_nf4


def base_linears(model: nn.Module) -> list[str]:
    """The frozen linear layers of the blocks (an adapted layer's base_layer; not the adapters themselves)."""
    return [
        n
        for n in block_linear_names(model)
        if ".lora_" not in n and not isinstance(model.get_submodule(n), _peft_layer())
    ]


def _peft_layer() -> type:
    from peft.tuners.lora import LoraLayer

    return LoraLayer


def quantize_base(model: nn.Module, shards: int, flag: str = "--base_bits 4") -> list[str]:
    """Every frozen linear weight of the blocks as a torchao NF4 tensor (4 bits, blocks of 64 with scales), which
    FSDP2 shards and gathers as its packed bytes. On meta only the layout is made. Returns the weights' names."""
    to_nf4 = _to_nf4()
    names = []
    unit = NF4_BLOCK * NF4_SCALER_BLOCK * shards
    for name in base_linears(model):
        layer = model.get_submodule(name)
        rows = layer.weight.shape[0]
        if layer.weight.numel() % unit or rows % shards:
            raise ConfigError(
                f"{flag}: {name} ({rows} x {layer.weight.shape[1]}) does not split into {shards} NF4 shards "
                f"(each needs a multiple of {NF4_BLOCK * NF4_SCALER_BLOCK} weights); use 16 bits or fewer ranks"
            )
        layer.weight = nn.Parameter(to_nf4(layer.weight.detach()), requires_grad=False)
        names.append(f"{name}.weight")
    return names


@torch.no_grad()
def dequantize_base(model: nn.Module) -> list[str]:
    """The frozen linear weights of the blocks replaced by their NF4 round trip (quantized as training quantized them,
    then dequantized): the base a --base_bits 4 run's adapters were trained on, for a merge. Returns the names."""
    to_nf4 = _to_nf4()
    names = []
    for name in base_linears(model):
        layer = model.get_submodule(name)
        weight = layer.weight.detach()
        layer.weight.data = to_nf4(weight).get_original_weight().to(weight.dtype)
        names.append(f"{name}.weight")
    return names


@torch.no_grad()
def load_quantized(model: nn.Module, full_state: dict[str, torch.Tensor] | None, names: list[str], env: Any) -> None:
    """Fill the NF4 shards: rank 0 sends each weight whole, every rank quantizes it whole (the same bytes on every
    rank and for any rank count) and keeps its own rows. The other weights load as usual."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    to_nf4 = _to_nf4()
    params = dict(model.named_parameters())
    for name in names:
        into = params[_sharded_name(params, name)]
        sharded = isinstance(into, DTensor)
        local = into._local_tensor if sharded else into  # the object FSDP2 gathers from
        shape = tuple(into.shape)
        full = (
            full_state.pop(name).to(env.device)
            if env.is_main
            else torch.empty(shape, dtype=local.dtype, device=env.device)
        )
        if env.world_size > 1:
            dist.broadcast(full, src=0)
        quantized = to_nf4(full)
        part = quantized
        if sharded:  # this rank's rows, wherever the mesh puts them (a shard group of HYBRID_SHARD included)
            (rows, _), (offset, _) = compute_local_shape_and_global_offset(shape, into.device_mesh, into.placements)
            part = torch.split(quantized, rows)[offset // rows]
        local.copy_(part)  # the packed bytes and scales
        # The whole tensor's scale mean and the NF4 code table travel with every shard (FSDP2 passes them to the
        # gathered weight as they are): made on meta with the skeleton, set here.
        local.scaler_mean, local.nf4 = part.scaler_mean.clone(), part.nf4.clone()
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    set_model_state_dict(model, full_state if env.is_main else {}, options=opts)


def _sharded_name(params: dict[str, Any], name: str) -> str:
    if name in params:
        return name
    return next(n for n in params if n.replace("_checkpoint_wrapped_module.", "") == name)


NF4_BLOCK, NF4_SCALER_BLOCK = 64, 256  # torchao's defaults: 64 weights share a scale, 256 scales a factor
