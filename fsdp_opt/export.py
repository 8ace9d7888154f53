"""Turn a checkpoint into a Hugging Face model folder, or a sharded checkpoint into the single-file form.

    python -m fsdp_opt.export CHECKPOINT DIR [--dtype fp16|bf16|fp32] [--model NAME] [--merge]
    python -m fsdp_opt.export --single_file SHARDED_FOLDER OUT.pt

The folder holds config.json, model.safetensors, the tokenizer and generation_config.json, and loads with
`AutoModelForCausalLM.from_pretrained(DIR)`. A LoRA checkpoint gives a peft adapter folder (adapter_config.json,
adapter_model.safetensors) that `PeftModel.from_pretrained(base, DIR)` loads, or with --merge the base with the
adapters merged in, as a model folder. Writes go to a temporary folder renamed at the end.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, PretrainedConfig

from .atomic import save_or_explain
from .checkpoint import MODEL_KEY
from .loading import load_full_payload
from .errors import CheckpointError, ConfigError
from .models import load_model_config, load_tokenizer, resolve_model
from .parallelize import DTYPES


def export_model_folder(
    state_dict: dict[str, torch.Tensor], model_config: PretrainedConfig, tokenizer: Any, dest: Path, dtype: str = "fp16"
) -> Path:
    dest = Path(dest)
    tmp = dest.with_name(f".{dest.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    config = model_config.__class__.from_dict(model_config.to_dict())
    config.use_cache = True  # the exported model is for inference
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Copy: save_pretrained may consume the dict it is given, and the caller may need it again.
    weights = {k: v.detach().to(DTYPES[dtype]).clone() for k, v in state_dict.items()}
    missing, unexpected = model.load_state_dict(weights, strict=False, assign=True)
    if unexpected or [k for k in missing if not _is_tied(model, k)]:
        raise CheckpointError(f"export: weights do not fit {config.model_type} (missing {missing[:2]}, unexpected {unexpected[:2]})")
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


def export_lora(adapters: dict[str, torch.Tensor], info: dict[str, Any], dest: Path, dtype: str = "fp16", *,
                merge: bool = False, seed: int = 0) -> Path:  # fmt: skip
    """A LoRA run's adapters as a peft adapter folder; with `merge`, as a full model folder (the base with the
    update merged in, by peft), which needs the base: `info` names it and holds its fingerprint."""
    from .lora import merged_state, write_adapter

    if not merge:
        return write_adapter(adapters, info, dest, DTYPES[dtype])
    import tempfile

    source = resolve_model(info["base"])
    with tempfile.TemporaryDirectory(dir=Path(dest).parent) as tmp:
        folder = write_adapter(adapters, info, Path(tmp) / "adapter", torch.float32)
        state = merged_state(folder, info, seed)
    return export_model_folder(state, load_model_config(source), load_tokenizer(source), dest, dtype)


def export_checkpoint(path: Path, dest: Path, dtype: str = "fp16", model_name: str | None = None, merge: bool = False) -> Path:
    payload = load_full_payload(Path(path), "checkpoint")
    info = payload.get("lora")
    if info is not None:
        seed = int((payload.get("config") or {}).get("seed", 0))
        return export_lora(payload[MODEL_KEY], info, dest, dtype, merge=merge, seed=seed)
    if merge:
        raise ConfigError(f"--merge: {path} is a full fine-tuning checkpoint (nothing to merge); leave --merge out")
    name = model_name or (payload.get("config") or {}).get("model")
    if not name:
        raise ConfigError(f"checkpoint {path}: it does not record its model; pass --model NAME")
    source = resolve_model(name)
    return export_model_folder(payload[MODEL_KEY], load_model_config(source), load_tokenizer(source), dest, dtype)


def to_single_file(folder: Path, out: Path) -> Path:
    """A sharded checkpoint folder as one .pt file of the full format (loads with weights_only=True)."""
    payload = load_full_payload(Path(folder), "checkpoint")
    save_or_explain(payload, Path(out))
    return Path(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fsdp_opt.export", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a .pt checkpoint or a sharded checkpoint folder")
    parser.add_argument("dest", help="model folder to write (or .pt file with --single_file)")
    parser.add_argument("--dtype", default="fp16", choices=sorted(DTYPES), help="weight dtype of the folder")
    parser.add_argument("--model", default=None, help="model the checkpoint belongs to, if it does not say")
    parser.add_argument("--single_file", action="store_true", help="convert a sharded folder into one .pt file")
    parser.add_argument("--merge", action="store_true",
                        help="a LoRA checkpoint: write the base with the adapters merged in (default: the adapter folder)")
    args = parser.parse_args(argv)
    try:
        if args.single_file:
            print(f"wrote {to_single_file(Path(args.checkpoint), Path(args.dest))}")
        else:
            print(f"wrote {export_checkpoint(Path(args.checkpoint), Path(args.dest), args.dtype, args.model, args.merge)}")
    except (ConfigError, CheckpointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
