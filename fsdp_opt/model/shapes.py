"""Model shapes for the planner: the OPT family, Llama-3.1-8B and the catalogue of popular models (model/catalog.py)
built in (offline), any other from its config; and
what the memory math needs of a shape (exact parameter counts per FSDP unit, activation dimensions, the linear
layers LoRA adapts), read from a skeleton on the meta device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fsdp_opt.model.catalog import catalog_config, catalog_id
from fsdp_opt.model.families import head_refusal
from fsdp_opt.model.loader import meta_model
from fsdp_opt.model.parallelize import find_block_classes, find_blocks
from fsdp_opt.model.sources import (
    LLAMA_8B,
    OPT_FAMILY,
    llama_8b_config,
    load_model_config,
    opt_config,
    resolve_model,
)


def model_config(name: str):
    if name in OPT_FAMILY:
        return opt_config(name)
    if name == LLAMA_8B:
        return llama_8b_config()
    if catalog_id(name) is not None:
        return catalog_config(name)

    return load_model_config(resolve_model(name))


@dataclass
class Shape:
    """What the memory math needs of a model: exact parameter counts and the activation dimensions."""

    params: int  # unique parameters (tied weights once)
    block_params: int  # one decoder block, the largest FSDP unit but the root
    root_params: int  # everything outside the blocks: embeddings, tied head, final norm
    layers: int
    hidden: int
    heads: int
    vocab: int
    largest_param: int = 0  # elements of the largest single tensor (the token embedding for OPT)
    flop_params: int = 0  # the N of 6N FLOPs per token: parameters less embeddings, plus the output projection
    # (dim 0, elements) of each parameter, per FSDP unit, the root first: FSDP2 pads dim 0 to the shard count
    units: tuple = ()
    linears: tuple = ()  # (leaf name, in, out) of each linear layer of one block: where LoRA adapters go
    relu_mlp: bool = False  # the MLP's activation is ReLU, which keeps only its output for backward (OPT)
    kv_dim: int = 0  # keys (or values) per token per layer: kv heads x head dim (what a KV cache holds)
    gated_mlp: bool = False  # the MLP multiplies a gate by its up projection (Llama, Qwen, Gemma, Mistral, Phi-3)
    intermediate: int = 0  # the MLP's width
    plain_head: bool = False  # logits are `hidden @ W.T`: the loss runs the output layer at the targets (HeadLoss)

    @classmethod
    def of(cls, config) -> Shape:
        import torch

        model = meta_model(config)
        unique = {id(p): p for p in model.parameters()}
        blocks = find_blocks(model, find_block_classes(model))
        in_blocks = {id(p) for b in blocks for p in b.parameters()}
        block = max(sum(p.numel() for p in b.parameters()) for b in blocks)
        root = sum(p.numel() for i, p in unique.items() if i not in in_blocks)

        def dims(params) -> tuple:  # noqa: ANN001
            return tuple((p.shape[0] if p.dim() else 1, p.numel()) for p in params)

        units = (dims(p for i, p in unique.items() if i not in in_blocks),) + tuple(
            dims(b.parameters()) for b in blocks
        )
        first = blocks[0]
        linears = tuple(
            (n.rsplit(".", 1)[-1], m.weight.shape[1], m.weight.shape[0])
            for n, m in first.named_modules()
            if isinstance(m, torch.nn.Linear)
        )
        return cls(
            params=sum(p.numel() for p in unique.values()),
            block_params=block,
            root_params=root,
            layers=len(blocks),
            hidden=config.hidden_size,
            heads=config.num_attention_heads,
            vocab=config.vocab_size,
            largest_param=max(p.numel() for p in unique.values()),
            flop_params=int(flops_per_token(model, 0) / 6),
            units=units,
            linears=linears,
            relu_mlp=str(getattr(config, "activation_function", getattr(config, "hidden_act", ""))) == "relu",
            kv_dim=(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
            * (getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads),
            gated_mlp=any("gate" in name for name, _, _ in linears),
            # the MLP's width: the input of its last linear layer
            intermediate=next(
                (i for name, i, _ in linears if name in ("down_proj", "fc2", "w2", "dense_4h_to_h")),
                max((o for _, _, o in linears), default=0),
            ),
            plain_head=head_refusal(model) is None,
        )

    def summary(self) -> dict[str, int]:
        return {
            k: v
            for k, v in self.__dict__.items()
            if k not in ("units", "linears", "relu_mlp", "gated_mlp", "plain_head")
        }


def _unique_params(model: nn.Module) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for p in model.parameters():
        seen.setdefault(id(p), p)
    return list(seen.values())


def count_params(model: nn.Module) -> int:
    """Parameters of the full model (works on a meta or a sharded model: counts global shapes)."""
    return sum(p.numel() for p in _unique_params(model))


def flops_per_token(model: nn.Module, seq_len: int, frozen_base: bool = False) -> float:
    """Training FLOPs per token: 6N + 12*L*H*Q*T (PaLM appendix B), N = non-embedding params + lm_head.

    With a frozen base (LoRA) no weight gradient is computed: 4N + 8*L*H*Q*T (the adapters' own FLOPs are left out)."""
    config = model.config
    embedding = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Embedding))
    head = model.get_output_embeddings()
    n = count_params(model) - embedding + (head.weight.numel() if head is not None else 0)
    layers = config.num_hidden_layers
    heads = config.num_attention_heads
    head_dim = config.hidden_size // heads
    per_matmul = 2.0 if frozen_base else 3.0  # forward, input gradient (, weight gradient)
    return 2.0 * per_matmul * n + 4.0 * per_matmul * layers * heads * head_dim * seq_len
