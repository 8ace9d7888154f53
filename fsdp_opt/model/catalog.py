"""The shapes of the models people fine-tune on small GPUs, as their published config.json files give them, built
offline: the planner answers `plan --model Qwen/Qwen3-1.7B` with no download, and `--model random:Qwen/Qwen3-1.7B`
trains that shape with random weights (for tests and rehearsals at real width).

Each entry: the architecture (transformers' model_type) and the fields that decide parameter counts and memory:
hidden / intermediate size, layers, attention heads, key-value heads (grouped-query attention), head dim, vocabulary,
tied embeddings, and the sliding window where the model has one. An id's -Instruct / -it / -pt variant has the same
shape.
"""

from __future__ import annotations

import re

from transformers import AutoConfig, PretrainedConfig


def _shape(
    model_type: str,
    hidden: int,
    intermediate: int,
    layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    vocab: int,
    tied: bool,
    **extra,
) -> tuple[str, dict]:
    return model_type, dict(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=vocab,
        tie_word_embeddings=tied,
        **extra,
    )


def _gemma3_layers(layers: int, every: int = 6) -> list[str]:
    """Gemma 3: five local (sliding-window) layers, then one global, repeated."""
    return ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(layers)]


SHAPES: dict[str, tuple[str, dict]] = {
    "meta-llama/Llama-3.2-1B": _shape("llama", 2048, 8192, 16, 32, 8, 64, 128256, True, max_position_embeddings=131072),
    "meta-llama/Llama-3.2-3B": _shape(
        "llama", 3072, 8192, 28, 24, 8, 128, 128256, True, max_position_embeddings=131072
    ),
    "Qwen/Qwen2.5-0.5B": _shape("qwen2", 896, 4864, 24, 14, 2, 64, 151936, True, max_position_embeddings=32768),
    "Qwen/Qwen2.5-1.5B": _shape("qwen2", 1536, 8960, 28, 12, 2, 128, 151936, True, max_position_embeddings=32768),
    "Qwen/Qwen2.5-3B": _shape("qwen2", 2048, 11008, 36, 16, 2, 128, 151936, True, max_position_embeddings=32768),
    "Qwen/Qwen2.5-7B": _shape("qwen2", 3584, 18944, 28, 28, 4, 128, 152064, False, max_position_embeddings=32768),
    "Qwen/Qwen3-0.6B": _shape("qwen3", 1024, 3072, 28, 16, 8, 128, 151936, True, max_position_embeddings=40960),
    "Qwen/Qwen3-1.7B": _shape("qwen3", 2048, 6144, 28, 16, 8, 128, 151936, True, max_position_embeddings=40960),
    "Qwen/Qwen3-4B": _shape("qwen3", 2560, 9728, 36, 32, 8, 128, 151936, True, max_position_embeddings=40960),
    "Qwen/Qwen3-8B": _shape("qwen3", 4096, 12288, 36, 32, 8, 128, 151936, False, max_position_embeddings=40960),
    "google/gemma-2-2b": _shape(
        "gemma2",
        2304,
        9216,
        26,
        8,
        4,
        256,
        256000,
        True,
        sliding_window=4096,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        max_position_embeddings=8192,
    ),
    "google/gemma-3-1b-pt": _shape(
        "gemma3_text",
        1152,
        6912,
        26,
        4,
        1,
        256,
        262144,
        True,
        sliding_window=512,
        layer_types=_gemma3_layers(26),
        max_position_embeddings=32768,
    ),
    "google/gemma-3-4b-pt": _shape(
        "gemma3_text",
        2560,
        10240,
        34,
        8,
        4,
        256,
        262208,
        True,
        sliding_window=1024,
        layer_types=_gemma3_layers(34),
        max_position_embeddings=131072,
    ),
    "HuggingFaceTB/SmolLM2-1.7B": _shape(
        "llama", 2048, 8192, 24, 32, 32, 64, 49152, True, max_position_embeddings=8192
    ),
    "microsoft/Phi-3.5-mini-instruct": _shape(
        "phi3", 3072, 8192, 32, 32, 32, 96, 32064, False, max_position_embeddings=131072
    ),
    "mistralai/Mistral-7B-v0.3": _shape(
        "mistral", 4096, 14336, 32, 32, 8, 128, 32768, False, sliding_window=None, max_position_embeddings=32768
    ),
}

_VARIANT = re.compile(r"-(instruct|it|pt|chat)$", re.IGNORECASE)


def catalog_id(name: str) -> str | None:
    """The catalogue's id for a model id or one of its variants (case-insensitive); None when it has none."""
    key = _VARIANT.sub("", name.strip().rstrip("/")).lower()
    for known in SHAPES:
        if _VARIANT.sub("", known).lower() == key:
            return known
    return None


def catalog_config(name: str) -> PretrainedConfig:
    """The config of a catalogued shape (raises KeyError for one that is not)."""
    known = catalog_id(name)
    if known is None:
        raise KeyError(name)
    model_type, fields = SHAPES[known]
    return AutoConfig.for_model(model_type, **fields)
