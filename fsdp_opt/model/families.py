"""What the trainer must know of a model's architecture beyond its config: the attention implementations it has,
and the pattern its attention masks hold (sliding windows, per-layer types), which docs packing's mask must hold too.

The architectures named here were checked against transformers' own masks (tests/model/test_families.py): a row's
per-token losses packed with others equal the row alone. Others run the generic path: plain causal attention with
no window, refused for docs packing when their config says they have one.
"""

from __future__ import annotations

from transformers import PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from fsdp_opt.base import ModelError
from fsdp_opt.data.packing import MaskPattern

# Models whose forward takes one mask per layer type, {"full_attention": ..., "sliding_attention": ...}, and gives
# each layer the mask of its type.
MASKS_BY_LAYER_TYPE = ("qwen2", "qwen3", "gemma2", "gemma3_text", "gemma3")
# Models whose layers all take the one mask they are given; their sliding window (when the config sets one) is
# applied to every layer.
ONE_MASK = ("opt", "gpt2", "llama", "mistral", "phi3")
IMPLEMENTATIONS = ("sdpa", "eager")


def attention_implementations(config: PretrainedConfig) -> tuple[str, ...]:
    """The kernels this architecture's attention has, of the ones the trainer uses."""
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    if model_class is None or getattr(model_class, "_supports_sdpa", False):
        return IMPLEMENTATIONS
    return ("eager",)


def resolve_attention(config: PretrainedConfig, requested: str) -> tuple[str, str | None]:
    """--attn_implementation: auto is SDPA where the model has it, else eager. Returns (kernel, a line to print when
    auto had to choose eager). A kernel the model lacks is one line naming the flag and the ones it has."""
    available = attention_implementations(config)
    if requested == "auto":
        choice = available[0]
        note = None if choice == "sdpa" else f"attention: eager ({config.model_type} has no SDPA path)"
        return choice, note
    if requested not in available:
        raise ModelError(f"--attn_implementation {requested}: {config.model_type} does not have it (it has: "
                         f"{', '.join(available)}; auto picks for you)")  # fmt: skip
    return requested, None


def mask_pattern(config: PretrainedConfig) -> MaskPattern | None:
    """The sliding window the model's own masks apply, for docs packing's document mask; None when there is none.

    Raises ModelError (docs packing only) for a model with a window this trainer cannot put into its masks."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or ()
    if config.model_type in MASKS_BY_LAYER_TYPE and layer_types:
        if "sliding_attention" not in layer_types:
            return None
        return MaskPattern(window=int(window), by_layer_type=True)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    if config.model_type in ONE_MASK and not layer_types:
        return MaskPattern(window=int(window), by_layer_type=False)
    raise ModelError(f"--packing docs: {config.model_type} has sliding-window attention that its document mask cannot "
                     "express here; use --packing pad or concat")  # fmt: skip
