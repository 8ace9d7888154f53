"""Where a model comes from: a hub id, a local folder, or the built-in `tiny-opt` (or a `random:` shape); its config
and tokenizer. Building the model itself is model/loader.py's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from fsdp_opt.base import ModelError, looks_like_path, quiet_hub_logs
from fsdp_opt.model.catalog import SHAPES, catalog_config, catalog_id
from fsdp_opt.model.families import resolve_attention

BUILTIN_MODEL = "tiny-opt"

RANDOM_PREFIX = "random:"  # random:facebook/opt-1.3b: that shape (built in, offline) with random weights

ASSETS = Path(__file__).resolve().parents[1] / "assets"


@dataclass(frozen=True)
class ModelSource:
    name: str  # what the user passed to --model
    location: str  # folder path or hub id handed to from_pretrained
    kind: str  # "builtin" | "local" | "hub"

    @property
    def pretrained_weights(self) -> bool:
        """The built-in model and `random:` shapes are initialised from the seed; the others load their weights."""
        return self.kind not in ("builtin", "random")


def resolve_model(name: str) -> ModelSource:
    if name == BUILTIN_MODEL:
        return ModelSource(name, str(ASSETS / BUILTIN_MODEL), "builtin")
    if name.startswith(RANDOM_PREFIX):
        shape = name[len(RANDOM_PREFIX) :]
        if shape not in OPT_FAMILY and catalog_id(shape) is None:
            raise ModelError(f"--model {name}: random weights are built for {', '.join([*OPT_FAMILY, *SHAPES])}")
        return ModelSource(name, shape, "random")
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"--model {name}: folder has no config.json (expected a Hugging Face model folder)")
        return ModelSource(name, str(path), "local")
    if looks_like_path(name):
        raise ModelError(f"--model {name}: no such folder (use a model folder, a hub id, or '{BUILTIN_MODEL}')")
    if not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", name):
        raise ModelError(f"--model {name!r}: not a hub id, a folder, or '{BUILTIN_MODEL}'")
    return ModelSource(name, name, "hub")


def model_tag(name: str) -> str:
    """Short clean name used in checkpoint names: facebook/opt-1.3b -> opt_1.3B."""
    random = name.startswith(RANDOM_PREFIX)
    name = name[len(RANDOM_PREFIX) :] if random else name
    if random:
        return "random_" + model_tag(name)
    base = Path(name.rstrip("/\\")).name or name
    m = re.fullmatch(r"opt-(\d+(?:\.\d+)?)([mb])", base.lower())
    if m:
        return f"opt_{m.group(1)}{m.group(2).upper()}"
    return re.sub(r"[^A-Za-z0-9.]+", "_", base).strip("_") or "model"


def fetch_error(source: ModelSource, exc: Exception) -> ModelError:
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if source.kind == "hub":
        return ModelError(
            f"--model {source.name}: cannot fetch it from the Hugging Face Hub ({reason[:200]}). "
            f"Check the id and the network, or use --model {BUILTIN_MODEL} or a local model folder."
        )
    return ModelError(f"--model {source.name}: cannot load it ({reason[:200]})")


def load_model_config(source: ModelSource, attn_implementation: str = "auto") -> PretrainedConfig:
    """The model's config, set up for training: no KV cache, and the attention kernel (--attn_implementation, auto:
    SDPA where the architecture has it, else eager) in `_attn_implementation`."""
    try:
        with quiet_hub_logs():
            if source.kind == "random":
                config = (
                    opt_config(source.location) if source.location in OPT_FAMILY else catalog_config(source.location)
                )
            else:
                config = AutoConfig.from_pretrained(source.location)
    except Exception as exc:  # noqa: BLE001 - any failure to fetch is reported as one line
        raise fetch_error(source, exc) from None
    config._attn_implementation = resolve_attention(config, attn_implementation)[0]
    config.use_cache = False  # training never reads a KV cache
    return config


def without_dropout(config: PretrainedConfig) -> list[str]:
    """Every dropout rate the config sets (dropout, attention_dropout, resid_pdrop, ...) to 0; the names changed.
    --method dpo trains so (as TRL's DPO does by default): the policy's log-probabilities are compared with the
    reference's, which are taken without dropout."""
    changed = []
    for name, value in list(vars(config).items()):
        if ("dropout" in name or name.endswith("pdrop")) and isinstance(value, float) and value > 0:
            setattr(config, name, 0.0)
            changed.append(name)
    return changed


def load_tokenizer(source: ModelSource) -> PreTrainedTokenizerBase:
    try:
        with quiet_hub_logs():
            # a random: shape reads text with the built-in tokenizer (its ids fit any OPT vocabulary)
            tokenizer = AutoTokenizer.from_pretrained(
                str(ASSETS / BUILTIN_MODEL) if source.kind == "random" else source.location
            )
    except Exception as exc:  # noqa: BLE001
        raise fetch_error(source, exc) from None
    if tokenizer.eos_token_id is None:
        raise ModelError(f"--model {source.name}: its tokenizer has no EOS token")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def max_positions(config: PretrainedConfig) -> int | None:
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


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
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        ffn_dim=ffn,
        word_embed_proj_dim=proj,
        vocab_size=50272,
        max_position_embeddings=2048,
        do_layer_norm_before=name != "facebook/opt-350m",
    )


# Llama-3.1-8B's shape (its config.json on the Hub), for planning a Llama-style 8B offline.
LLAMA_8B = "meta-llama/Llama-3.1-8B"


def llama_8b_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=128256,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
    )
