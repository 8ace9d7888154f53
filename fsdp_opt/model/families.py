"""The one place that knows each model family the trainer is tested on: its decoder block (the FSDP unit, and where
LoRA's adapters go), the attention kernels it has, the pattern its attention masks hold (sliding windows, per-layer
types), its embeddings, its BOS, and its LoRA targets.

Each family here was checked against transformers' own models (tests/model/test_families.py): the block is found,
the LoRA targets are the block's linear layers, and a row's per-token losses packed with others equal the row alone
under every kernel it has. A model of another family runs the generic path, with one line saying it is untested:
its `_no_split_modules` blocks, every linear layer of them for LoRA, and plain causal masks (docs packing is refused
when its config has a sliding window this trainer cannot put into its masks).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from transformers import PretrainedConfig, PreTrainedTokenizerBase
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from fsdp_opt.base import ModelError
from fsdp_opt.data.packing import MaskPattern

IMPLEMENTATIONS = ("sdpa", "eager")
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
GATED_MLP = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Family:
    name: str  # as the run's lines print it
    model_types: tuple[str, ...]  # transformers' config.model_type values
    block: str  # the decoder block's class: one FSDP unit each, and the only place LoRA adapts
    attention: tuple[str, ...]  # the kernels its attention has, of the ones the trainer uses
    masks: str  # "one": every layer takes the one mask it is given; "by_layer_type": a mask per config.layer_types
    bos: bool  # its tokenizer, as released, puts a BOS first (and pretraining saw one there)
    lora_targets: tuple[str, ...]  # the linear layers of its block (leaf names): the default LoRA targets
    embeddings: str  # what ties: the setup re-ties the output head to the input embedding when the config says so


FAMILIES: tuple[Family, ...] = (
    Family(
        "OPT",
        ("opt",),
        "OPTDecoderLayer",
        IMPLEMENTATIONS,
        "one",
        True,
        ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"),
        "tied (every size)",
    ),
    Family(
        "GPT-2",
        ("gpt2",),
        "GPT2Block",
        IMPLEMENTATIONS,
        "one",
        False,
        ("c_attn", "c_proj", "c_fc"),
        "tied (every size)",
    ),
    Family(
        "Llama 3.x / SmolLM2",
        ("llama",),
        "LlamaDecoderLayer",
        IMPLEMENTATIONS,
        "one",
        True,
        ATTENTION + GATED_MLP,
        "tied at 1B and 3B and in SmolLM2; untied at 8B",
    ),
    Family(
        "Qwen2 / Qwen2.5",
        ("qwen2",),
        "Qwen2DecoderLayer",
        IMPLEMENTATIONS,
        "by_layer_type",
        False,
        ATTENTION + GATED_MLP,
        "tied up to 3B; untied at 7B",
    ),
    Family(
        "Qwen3",
        ("qwen3",),
        "Qwen3DecoderLayer",
        IMPLEMENTATIONS,
        "by_layer_type",
        False,
        ATTENTION + GATED_MLP,
        "tied up to 4B; untied at 8B",
    ),
    Family(
        "Gemma 2",
        ("gemma2",),
        "Gemma2DecoderLayer",
        ("eager",),
        "by_layer_type",
        True,
        ATTENTION + GATED_MLP,
        "tied; the embedding is scaled by sqrt(hidden)",
    ),
    Family(
        "Gemma 3 (text)",
        ("gemma3_text",),
        "Gemma3DecoderLayer",
        IMPLEMENTATIONS,
        "by_layer_type",
        True,
        ATTENTION + GATED_MLP,
        "tied; the embedding is scaled by sqrt(hidden)",
    ),
    Family(
        "Mistral", ("mistral",), "MistralDecoderLayer", IMPLEMENTATIONS, "one", True, ATTENTION + GATED_MLP, "untied"
    ),
    Family(
        "Phi-3 / Phi-3.5",
        ("phi3",),
        "Phi3DecoderLayer",
        IMPLEMENTATIONS,
        "one",
        False,
        ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
        "untied",
    ),
)


def family_of(config: PretrainedConfig) -> Family | None:
    """The tested family of this config; None for any other architecture (the generic path)."""
    return next((f for f in FAMILIES if config.model_type in f.model_types), None)


def untested_note(config: PretrainedConfig) -> str | None:
    """The one line a run prints for an architecture outside the tested families."""
    if family_of(config) is not None:
        return None
    return (
        f"note: {config.model_type} is not one of the tested families ({', '.join(f.name for f in FAMILIES)}): it "
        "runs the generic path (its _no_split_modules blocks, every linear layer of them for LoRA, plain causal "
        "masks)"
    )


def bos_note(config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase) -> str | None:
    """A line when the family's pretraining put a BOS first and this tokenizer adds none to a text."""
    family = family_of(config)
    if family is None or not family.bos or tokenizer.bos_token_id is None:
        return None
    ids = tokenizer("a")["input_ids"]
    if ids and ids[0] == tokenizer.bos_token_id:
        return None
    return (
        f"note: {family.name} models saw a BOS ({tokenizer.bos_token}) first in pretraining, and this tokenizer "
        "adds none to text rows: check the tokenizer's add_bos_token"
    )


def block_class_names(model) -> set[str]:  # noqa: ANN001
    """The class names of the model's decoder blocks: the family's, or for the generic path its `_no_split_modules`."""
    family = family_of(model.config) if getattr(model, "config", None) is not None else None
    if family is not None:
        return {family.block}
    return set(getattr(model, "_no_split_modules", None) or [])


def attention_implementations(config: PretrainedConfig) -> tuple[str, ...]:
    """The kernels this architecture's attention has, of the ones the trainer uses."""
    family = family_of(config)
    if family is not None:
        return family.attention
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
        raise ModelError(
            f"--attn_implementation {requested}: {config.model_type} does not have it (it has: "
            f"{', '.join(available)}; auto picks for you)"
        )
    return requested, None


def mask_pattern(config: PretrainedConfig) -> MaskPattern | None:
    """The sliding window the model's own masks apply, for docs packing's document mask; None when there is none.

    Raises ModelError (docs packing only) for a model with a window this trainer cannot put into its masks: any
    windowed model outside the tested families."""
    text = config.get_text_config()
    window = getattr(text, "sliding_window", None)
    layer_types = getattr(text, "layer_types", None) or ()
    family = family_of(config)
    if family is not None and family.masks == "by_layer_type" and layer_types:
        if "sliding_attention" not in layer_types:
            return None
        return MaskPattern(window=int(window), by_layer_type=True)
    windowed = "sliding_attention" in layer_types if layer_types else bool(window)
    if not windowed or getattr(text, "use_sliding_window", True) is False:
        return None
    if family is not None and family.masks == "one" and not layer_types:
        return MaskPattern(window=int(window), by_layer_type=False)
    raise ModelError(
        f"--packing docs: {config.model_type} has sliding-window attention that its document mask cannot "
        "express here; use --packing pad or concat"
    )


# Config fields of models whose logits are more than `hidden @ W.T`
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def head_refusal(model: nn.Module) -> str | None:
    """Why the loss cannot run this model's output layer itself, after the forward (None: it can): the layer is not a
    Linear without bias, or the model changes its logits after it (engine/loss.py HeadLoss)."""
    head = model.get_output_embeddings()
    config = getattr(model, "config", None)
    transforms = [k for k in LOGIT_TRANSFORMS if getattr(config, k, None) not in (None, 1, 1.0)]
    if transforms:
        return f"its logits use {transforms[0]}"
    if not isinstance(head, nn.Linear) or head.bias is not None:
        return "its output layer is not a Linear without bias"
    return None


def families_markdown() -> str:
    """The table of the tested families in docs/models.md, from FAMILIES (a test keeps the page's copy equal to this)."""
    masks = {
        "one": "one mask for every layer (its window, when the config sets one)",
        "by_layer_type": "a mask per layer type (full, sliding)",
    }
    lines = [
        "| family | model_type | block (one FSDP unit) | attention | masks under docs packing | BOS | LoRA targets "
        "(default: all) | embeddings |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for f in FAMILIES:
        lines.append(
            f"| {f.name} | {', '.join(f.model_types)} | `{f.block}` | {', '.join(f.attention)} | "
            f"{masks[f.masks]} | {'yes' if f.bos else 'no'} | {', '.join(f.lora_targets)} | {f.embeddings} |"
        )
    return "\n".join(lines)
