"""Model shapes for the planner: the OPT family and Llama-3.1-8B built in (offline), any other from its config; and
what the memory math needs of a shape (exact parameter counts per FSDP unit, activation dimensions, the linear
layers LoRA adapts), read from a skeleton on the meta device.
"""

from __future__ import annotations

from dataclasses import dataclass

# facebook/opt-* shapes (config.json of each model on the Hub): hidden, layers, heads, ffn, projection dim.
OPT_FAMILY = {
    "facebook/opt-125m": (768, 12, 12, 3072, 768),
    "facebook/opt-350m": (1024, 24, 16, 4096, 512),
    "facebook/opt-1.3b": (2048, 24, 32, 8192, 2048),
    "facebook/opt-2.7b": (2560, 32, 32, 10240, 2560),
    "facebook/opt-6.7b": (4096, 32, 32, 16384, 4096),
}


def opt_config(name: str):
    from transformers import OPTConfig

    hidden, layers, heads, ffn, proj = OPT_FAMILY[name]
    return OPTConfig(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, ffn_dim=ffn,
        word_embed_proj_dim=proj, vocab_size=50272, max_position_embeddings=2048,
        do_layer_norm_before=name != "facebook/opt-350m",
    )  # fmt: skip


# Llama-3.1-8B's shape (its config.json on the Hub), for planning a Llama-style 8B offline.
LLAMA_8B = "meta-llama/Llama-3.1-8B"


def llama_8b_config():
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       intermediate_size=14336, vocab_size=128256, max_position_embeddings=131072,
                       tie_word_embeddings=False)  # fmt: skip


def model_config(name: str):
    if name in OPT_FAMILY:
        return opt_config(name)
    if name == LLAMA_8B:
        return llama_8b_config()
    from .models import load_model_config, resolve_model

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

    @classmethod
    def of(cls, config) -> "Shape":
        import torch

        from .models import build_meta_model
        from .parallelize import find_block_classes, find_blocks

        model = build_meta_model(config)
        unique = {id(p): p for p in model.parameters()}
        blocks = find_blocks(model, find_block_classes(model))
        in_blocks = {id(p) for b in blocks for p in b.parameters()}
        block = max(sum(p.numel() for p in b.parameters()) for b in blocks)
        root = sum(p.numel() for i, p in unique.items() if i not in in_blocks)
        from .tracking import flops_per_token

        def dims(params) -> tuple:  # noqa: ANN001
            return tuple((p.shape[0] if p.dim() else 1, p.numel()) for p in params)

        units = (dims(p for i, p in unique.items() if i not in in_blocks),) + tuple(dims(b.parameters()) for b in blocks)
        first = blocks[0]
        linears = tuple((n.rsplit(".", 1)[-1], m.weight.shape[1], m.weight.shape[0]) for n, m in first.named_modules()
                        if isinstance(m, torch.nn.Linear))  # fmt: skip
        return cls(
            params=sum(p.numel() for p in unique.values()), block_params=block, root_params=root,
            layers=len(blocks), hidden=config.hidden_size, heads=config.num_attention_heads, vocab=config.vocab_size,
            largest_param=max(p.numel() for p in unique.values()), flop_params=int(flops_per_token(model, 0) / 6),
            units=units, linears=linears,
        )  # fmt: skip

    def summary(self) -> dict[str, int]:
        return {k: v for k, v in self.__dict__.items() if k not in ("units", "linears")}
