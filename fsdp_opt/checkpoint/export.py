"""Exports: a Hugging Face model folder (safetensors) from a checkpoint or the live model, the LoRA adapter folder
(optionally merged into its base), a checkpoint's weights file, and a sharded folder turned into a single file."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig, PretrainedConfig

from fsdp_opt.base import CheckpointError, ConfigError
from fsdp_opt.checkpoint.atomic import save_or_explain
from fsdp_opt.checkpoint.loading import load_full_payload, load_model_only
from fsdp_opt.checkpoint.names import MODEL_KEY
from fsdp_opt.checkpoint.weightsfile import write_weights
from fsdp_opt.config.methods import SEQUENCE_SCORE
from fsdp_opt.model.adapters import merged_state, whole_state, write_adapter
from fsdp_opt.model.loader import meta_model, set_head
from fsdp_opt.model.parallelize import DTYPES
from fsdp_opt.model.sources import load_model_config, load_tokenizer, resolve_model


def weights_from_checkpoint(checkpoint: Path, dest: Path) -> Path:
    """Write the weights file of a checkpoint file or sharded folder (reading only its model weights)."""

    payload = load_model_only(checkpoint)
    try:
        return write_weights(payload[MODEL_KEY], payload, dest)
    finally:
        del payload


def export_model_folder(
    state_dict: dict[str, torch.Tensor],
    model_config: PretrainedConfig,
    tokenizer: Any,
    dest: Path,
    dtype: str = "fp16",
    head: str = "causal_lm",
) -> Path:
    """A Hugging Face model folder of these weights: safetensors, config, tokenizer, generation config; a model with
    a score head (a reward model) as a one-label sequence classifier that AutoModelForSequenceClassification loads."""
    dest = Path(dest)
    tmp = dest.with_name(f".{dest.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    config = model_config.__class__.from_dict(model_config.to_dict())
    config.use_cache = True  # the exported model is for inference
    set_head(config, head, tokenizer.pad_token_id)
    model = meta_model(config, head)
    # Copy: save_pretrained may consume the dict it is given, and the caller may need it again.
    weights = {k: v.detach().to(DTYPES[dtype]).clone() for k, v in state_dict.items()}
    missing, unexpected = model.load_state_dict(weights, strict=False, assign=True)
    if unexpected or [k for k in missing if not _is_tied(model, k)]:
        raise CheckpointError(
            f"export: weights do not fit {config.model_type} (missing {missing[:2]}, unexpected {unexpected[:2]})"
        )
    model.tie_weights()
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    GenerationConfig.from_model_config(config).save_pretrained(tmp)
    if dest.exists():
        shutil.rmtree(dest)
    tmp.rename(dest)
    return dest


def _is_tied(model: torch.nn.Module, key: str) -> bool:
    head = model.get_output_embeddings()
    return head is not None and key.endswith("weight") and head.weight is model.get_input_embeddings().weight


def tokenizer_with(source, chat_template: str | None) -> Any:
    """The model's tokenizer, carrying the chat template the run rendered its conversations with."""
    tokenizer = load_tokenizer(source)
    if chat_template:
        tokenizer.chat_template = chat_template
    return tokenizer


def export_lora(
    adapters: dict[str, torch.Tensor],
    info: dict[str, Any],
    dest: Path,
    dtype: str = "fp16",
    *,
    merge: bool = False,
    seed: int = 0,
    chat_template: str | None = None,
) -> Path:
    """A LoRA run's adapters as a peft adapter folder; with `merge`, as a full model folder (the base with the
    update merged in, by peft), which needs the base: `info` names it and holds its fingerprint. With a chat template,
    the adapter folder holds the base's tokenizer carrying it."""

    whole = whole_state(adapters, info)
    if not merge:
        if whole:
            raise ConfigError(
                f"--adapter: this LoRA checkpoint's {', '.join(info['whole'])} layer trained whole beside the "
                "adapters (a reward model's score layer): export it merged (leave --adapter out)"
            )
        folder = write_adapter(adapters, info, dest, DTYPES[dtype])
        if chat_template:
            tokenizer_with(resolve_model(info["base"]), chat_template).save_pretrained(folder)
        return folder
    import tempfile

    source = resolve_model(info["base"])
    with tempfile.TemporaryDirectory(dir=Path(dest).parent) as tmp:
        folder = write_adapter(adapters, info, Path(tmp) / "adapter", torch.float32)
        state = merged_state(folder, info, seed, whole)
    head = SEQUENCE_SCORE if whole else "causal_lm"
    tokenizer = tokenizer_with(source, chat_template)
    return export_model_folder(state, load_model_config(source), tokenizer, dest, dtype, head)


def to_single_file(folder: Path, out: Path) -> Path:
    """A sharded checkpoint folder as one .pt file of the full format (loads with weights_only=True)."""
    payload = load_full_payload(Path(folder), "checkpoint")
    save_or_explain(payload, Path(out))
    return Path(out)
