"""What llama.cpp expects of each family it runs, for a GGUF written from a Hugging Face folder: its architecture name,
its hyperparameters, its tensor names (gguf's own map) and each family's conventions for the weights.

Facts from llama.cpp's converter and its model loaders, written here from what they do (no code of theirs):
- Llama and Mistral run as `llama`, whose attention wants the q and k rows of each head in its own rotary order: the
  rows are permuted (pairs split into halves), q by the heads and k by the KV heads. Llama 3.1's rope scaling becomes
  a `rope_freqs` tensor of each frequency's divisor.
- Gemma 2 and 3 store every RMSNorm weight as 1 + w (Hugging Face's Gemma norm multiplies by 1 + w; llama.cpp's by
  w); their sliding-window layers are named one by one.
- Phi-3 keeps its fused qkv and gate_up weights as they are (llama.cpp splits them the same way: q, k, v; gate, up);
  a long-context Phi-3 (longrope) brings its long and short rope factors as tensors.
- Qwen2 (q, k, v biases) and Qwen3 (q and k norms) need nothing else.

transformers' GGUF loader undoes each of these (tests/checkpoint/test_gguf.py reads the weights back through it).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from transformers import PretrainedConfig

from fsdp_opt.base import ConfigError

# transformers' model_type -> llama.cpp's architecture
ARCHITECTURES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "phi3": "phi3",
}
ROPE_TYPES = {"default", "linear", "llama3", "longrope"}  # what this writer carries over; others are refused


@dataclass(frozen=True)
class Tensor:
    """One tensor of the GGUF: its name there, where it comes from (a Hugging Face name, or made from the config),
    its shape, and how its values change on the way."""

    name: str
    source: str | None  # the Hugging Face tensor; None: `make` builds it from the config
    shape: tuple[int, ...]
    change: Callable[[np.ndarray], np.ndarray] | None = None
    make: Callable[[], np.ndarray] | None = None


def refusal(config: PretrainedConfig, folder: str) -> str | None:
    """The one line for a model llama.cpp does not run (None: it runs this one)."""
    if config.model_type not in ARCHITECTURES:
        families = "Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3, Phi-3"
        return (
            f"--gguf: llama.cpp does not run {config.model_type} models (its converter has no such architecture; "
            f"GGUF here is for {families}): use the Hugging Face folder {folder} (transformers, vLLM, TGI)"
        )
    rope = rope_settings(config)
    if rope.get("rope_type", "default") not in ROPE_TYPES:
        return (
            f"--gguf: {config.model_type} with rope scaling {rope.get('rope_type')!r} is not written here (only "
            f"{', '.join(sorted(ROPE_TYPES))}): use the Hugging Face folder {folder}"
        )
    if config.model_type in ("gemma2", "gemma3_text"):
        scalar = getattr(config, "query_pre_attn_scalar", None)
        if scalar not in (None, config.head_dim, config.hidden_size // config.num_attention_heads):
            return (
                f"--gguf: this {config.model_type} scales attention by query_pre_attn_scalar {scalar}, which llama.cpp "
                f"cannot (it uses the head size): use the Hugging Face folder {folder}"
            )
    return None


def architecture(config: PretrainedConfig) -> str:
    return ARCHITECTURES[config.model_type]


def rope_settings(config: PretrainedConfig, layer_type: str = "full_attention") -> dict[str, Any]:
    """The rope parameters of the full-attention layers (transformers 5 keeps them per layer type for Gemma 3)."""
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type in params and isinstance(params[layer_type], dict):
        return params[layer_type]
    if "rope_theta" not in params and getattr(config, "rope_theta", None) is not None:
        params = {**params, "rope_theta": config.rope_theta}
    return params


def head_dim(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def write_hparams(writer: Any, config: PretrainedConfig) -> None:
    """The architecture's keys: sizes, heads, norms, rope, windows and soft-capping."""
    arch = architecture(config)
    rope = rope_settings(config)
    heads = config.num_attention_heads
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(heads)
    writer.add_head_count_kv(getattr(config, "num_key_value_heads", None) or heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_key_length(head_dim(config))
    writer.add_value_length(head_dim(config))
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    rotary = int(
        rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0) * head_dim(config)
    )
    writer.add_rope_dimension_count(rotary)
    kind = rope.get("rope_type", "default")
    if kind == "linear":
        from gguf import RopeScalingType

        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    if arch == "phi3":
        original = rope.get("original_max_position_embeddings") or getattr(
            config, "original_max_position_embeddings", config.max_position_embeddings
        )
        writer.add_rope_scaling_orig_ctx_len(int(original))
        writer.add_sliding_window(int(getattr(config, "sliding_window", None) or 0))
        if kind == "longrope":
            scale = config.max_position_embeddings / original
            writer.add_rope_scaling_attn_factors(
                math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0
            )
    if arch in ("gemma2", "gemma3"):
        layer_types = list(getattr(config, "layer_types", None) or [])
        if getattr(config, "attn_logit_softcapping", None):
            writer.add_attn_logit_softcapping(float(config.attn_logit_softcapping))
        if getattr(config, "final_logit_softcapping", None):
            writer.add_final_logit_softcapping(float(config.final_logit_softcapping))
        if "sliding_attention" in layer_types and getattr(config, "sliding_window", None):
            writer.add_sliding_window(int(config.sliding_window))
            writer.add_sliding_window_pattern([t == "sliding_attention" for t in layer_types])
            local = rope_settings(config, "sliding_attention")
            if arch == "gemma3" and "rope_theta" in local:
                writer.add_rope_freq_base_swa(float(local["rope_theta"]))


def permute_rows(heads: int) -> Callable[[np.ndarray], np.ndarray]:
    """llama's q/k order: within each head, the rows of the rotary pairs' first halves, then the second halves, as
    interleaved pairs (rows (0, d/2), (1, d/2 + 1), ... become neighbours)."""

    def change(w: np.ndarray) -> np.ndarray:
        return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    return change


def plus_one(w: np.ndarray) -> np.ndarray:
    return w.astype(np.float32) + 1.0


def plan_tensors(config: PretrainedConfig, shapes: dict[str, tuple[int, ...]]) -> list[Tensor]:
    """Every tensor of the GGUF, in the order written, from the Hugging Face folder's names and shapes."""
    import gguf

    arch = architecture(config)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    tied = "lm_head.weight" not in shapes or bool(getattr(config, "tie_word_embeddings", False))
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    out: list[Tensor] = []
    for source, shape in shapes.items():
        if source == "lm_head.weight" and tied:
            continue  # llama.cpp reads the embedding for the output when the file has no output tensor
        if source.endswith("rotary_emb.inv_freq"):
            continue
        name = names.get_name(source, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ConfigError(f"--gguf: {source} of this {config.model_type} has no place in llama.cpp's {arch}")
        change = None
        if arch == "llama" and source.endswith(("q_proj.weight", "q_proj.bias")):
            change = permute_rows(heads)
        elif arch == "llama" and source.endswith(("k_proj.weight", "k_proj.bias")):
            change = permute_rows(kv_heads)
        elif arch in ("gemma2", "gemma3") and source.endswith("norm.weight"):
            change = plus_one
        out.append(Tensor(name, source, tuple(shape), change))
    out += rope_tensors(config, arch)
    return out


def rope_tensors(config: PretrainedConfig, arch: str) -> list[Tensor]:
    """Rope factors llama.cpp reads as tensors: Llama 3.1's per-frequency divisors; a long-context Phi-3's long and
    short factors."""
    import gguf

    rope = rope_settings(config)
    kind = rope.get("rope_type", "default")
    if arch == "llama" and kind == "llama3":
        factors = llama3_rope_factors(config)
        name = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight"
        return [Tensor(name, None, factors.shape, make=lambda: factors)]
    if arch == "phi3" and kind == "longrope":
        long = np.asarray(rope["long_factor"], dtype=np.float32)
        short = np.asarray(rope["short_factor"], dtype=np.float32)
        return [
            Tensor(
                gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FACTORS_LONG] + ".weight", None, long.shape, make=lambda: long
            ),
            Tensor(
                gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FACTORS_SHORT] + ".weight",
                None,
                short.shape,
                make=lambda: short,
            ),
        ]
    return []


def llama3_rope_factors(config: PretrainedConfig) -> np.ndarray:
    """Each rotary frequency's divisor under Llama 3.1's scaling: the plain frequencies base^(-2i/d) over those of
    transformers' own llama3 function (the one the model runs, so the two cannot drift apart)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    base, dim = float(rope_settings(config)["rope_theta"]), head_dim(config)
    plain = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    return (plain / scaled.double().numpy()).astype(np.float32)
