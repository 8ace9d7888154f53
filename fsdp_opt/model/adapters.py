"""LoRA through peft: which layers get adapters, the frozen base's storage, what identifies the base, the adapter folder.

The adapters are injected into the model in place (`peft.inject_adapter_in_model`), so the model stays the Hugging
Face model the rest of the engine knows; only the adapted layers change shape (`q_proj.base_layer.weight` is the
frozen weight, `q_proj.lora_A.default.weight` and `...lora_B...` the trainable pair). The frozen base is stored in
the compute dtype (fp16 on a T4: 2 bytes per parameter, sharded like any weight); the adapters keep fp32 master
weights, are cast to the compute dtype for the gathers like every parameter, and their gradients are reduced in fp32.
FSDP2 takes frozen fp16 and trainable fp32 parameters in one unit: only trainable ones must share a dtype.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from fsdp_opt.base import CheckpointError, ConfigError
from fsdp_opt.config.layout import LoraConfig
from fsdp_opt.config.methods import SEQUENCE_SCORE
from fsdp_opt.model.loader import SCORE_LAYER, cpu_model, full_state, set_head
from fsdp_opt.model.nf4 import dequantize_base, load_quantized, quantize_base, store_base
from fsdp_opt.model.parallelize import block_linear_names, storages
from fsdp_opt.model.sources import load_model_config, load_tokenizer, resolve_model
from fsdp_opt.runtime.distributed import broadcast_object

ADAPTER = "default"  # peft's adapter name inside the model; not part of the exported keys

KEY = "lora"  # the checkpoint key holding the run's LoRA identity


def find_targets(model: nn.Module, targets: str | None) -> list[str]:
    """The layers to adapt: every linear layer of the blocks, or those whose name ends with one of `targets`."""
    linear = block_linear_names(model)
    if targets is None:
        if not linear:
            raise ConfigError("--lora_rank: the model's decoder blocks have no linear layer to adapt")
        return linear
    wanted = [t.strip() for t in targets.split(",") if t.strip()]
    chosen = [n for n in linear if any(n == t or n.endswith("." + t) for t in wanted)]
    unmatched = [t for t in wanted if not any(n == t or n.endswith("." + t) for n in linear)]
    if unmatched:
        leaves = sorted({n.rsplit(".", 1)[-1] for n in linear})
        raise ConfigError(
            f"--lora_targets {unmatched[0]}: matches no linear layer of the decoder blocks (they have: {', '.join(leaves)})"
        )
    return chosen


def peft_config(settings: LoraConfig, targets: list[str], base: str | None = None) -> Any:
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(
        r=settings.lora_rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=list(targets),
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base,
    )


def inject(
    model: nn.Module, settings: LoraConfig, *, meta: bool, seed: int | None = None, whole: tuple[str, ...] = ()
) -> list[str]:
    """Add the adapters to `model` in place (every base weight frozen, but those of the layers `whole` names, which
    train as they are: a reward model's new score layer). On a real model, `seed` fixes their initial values (lora_A
    random, lora_B zero, so the model's output is unchanged). Returns the adapted layers' names."""
    from peft import inject_adapter_in_model

    targets = find_targets(model, settings.lora_targets)
    if seed is not None:
        torch.manual_seed(seed)
    inject_adapter_in_model(peft_config(settings, targets), model, adapter_name=ADAPTER, low_cpu_mem_usage=meta)
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_" in name or name.split(".", 1)[0] in whole)
    return targets


class Adapters:
    """One run's adapters: added to the meta model every rank shards, and to rank 0's CPU model that fills it."""

    def __init__(self, settings: LoraConfig, base: str, dtype: torch.dtype, seed: int, whole: tuple[str, ...] = ()):
        self.settings, self.base, self.dtype, self.seed, self.whole = settings, base, dtype, seed, whole
        self.targets: list[str] = []
        self.quantized: list[str] = []  # the NF4 weights with --base_bits 4
        self.shards = 1
        self.base_fingerprint: str | None = None  # known once rank 0 has read the base (and shared it)

    def add_to(self, model: nn.Module, shards: int = 1) -> None:
        """Every rank, on the meta skeleton, before sharding into `shards`."""
        self.targets = inject(model, self.settings, meta=True, whole=self.whole)
        store_base(model, self.dtype)
        self.quantized = quantize_base(model, shards) if self.settings.base_bits == 4 else []
        self.shards = shards

    def unsharded(self, model: nn.Module) -> set[nn.Parameter]:
        """The NF4 weights when they are not split across ranks (one rank, NO_SHARD): they stay out of FSDP, whole on
        every rank. (They are frozen, so nothing is reduced; FSDP2 would hand a one-rank NF4 weight to torchao without
        its gathered parts.)"""
        return {model.get_parameter(n) for n in self.quantized} if self.shards == 1 else set()

    def load_weights(self, model: nn.Module, full_state: dict[str, torch.Tensor] | None, env: Any) -> bool:
        """Load the weights into the shards when the base is quantized (returns False: the usual load does it)."""
        if not self.quantized:
            return False
        load_quantized(model, full_state, self.quantized, env)
        return True

    def load_options(self) -> dict[str, Any]:
        """What rank 0's load of the base needs: its dtype, and the same adapters added (seeded) before its state is
        taken, with the base's fingerprint taken first."""

        def prepare(model: nn.Module) -> None:
            self.base_fingerprint = fingerprint(model.state_dict())
            inject(model, self.settings, meta=False, seed=self.seed, whole=self.whole)
            store_base(model, self.dtype)

        return {"dtype": self.dtype, "prepare": prepare}

    def share_fingerprint(self, env: Any) -> None:
        """Every rank: rank 0's fingerprint of the base to all."""
        if env.world_size > 1:
            self.base_fingerprint = broadcast_object(self.base_fingerprint)

    def identity(self) -> dict[str, Any]:
        return {**identity(self.settings, self.targets, self.base, self.base_fingerprint), "whole": list(self.whole)}


def base_name(state_key: str) -> str:
    """An adapted model's state-dict name as the plain model names it: `q_proj.base_layer.weight` -> `q_proj.weight`."""
    return state_key.replace(".base_layer.", ".")


def fingerprint(base_state: dict[str, torch.Tensor]) -> str:
    """A short hash of the base weights: names, shapes, and up to 4096 evenly spaced values of each tensor in fp16,
    so the same weights stored in fp32 or fp16 give the same value and another checkpoint of the model does not."""
    h = hashlib.sha256()
    for name in sorted(base_state):
        t = base_state[name].detach()
        flat = t.reshape(-1)
        step = max(1, flat.numel() // 4096)
        sample = flat[::step][:4096].to(torch.float16).cpu()
        h.update(f"{base_name(name)}:{tuple(t.shape)}:".encode())
        h.update(sample.numpy().tobytes())
    return h.hexdigest()[:16]


def identity(settings: LoraConfig, targets: list[str], base: str, base_fingerprint: str) -> dict[str, Any]:
    """What a LoRA checkpoint records about its adapters and the base they belong to (plain values)."""
    return {
        "rank": settings.lora_rank,
        "alpha": settings.alpha,
        "dropout": settings.dropout,
        "targets": list(targets),
        "base": base,
        "base_fingerprint": base_fingerprint,
        "base_bits": settings.base_bits,
    }


def check_resume(
    saved: dict[str, Any] | None, here: dict[str, Any] | None, path: Path, flag: str = "--resume_file"
) -> bool:
    """Refuse, in one line, a resume whose adapters or base differ from this run's. Before the base is read (no
    fingerprint yet) a base of another name is left to the later check, which compares the weights themselves.
    Returns whether the adapters were compared (same base, same layers)."""
    if saved is None and here is None:
        return False
    if saved is None:
        raise CheckpointError(f"{flag} {path}: a full fine-tuning checkpoint; resume it without --lora_rank")
    if here is None:
        raise CheckpointError(
            f"{flag} {path}: a LoRA checkpoint (rank {saved['rank']}); resume it with --lora_rank {saved['rank']}"
        )
    if saved["rank"] != here["rank"]:
        raise CheckpointError(f"{flag} {path}: LoRA rank {saved['rank']}, this run has --lora_rank {here['rank']}")
    if here["base_fingerprint"] is None:
        if saved["base"] != here["base"]:
            return False
    elif saved["base_fingerprint"] != here["base_fingerprint"]:
        raise CheckpointError(
            f"{flag} {path}: trained on another base model ({saved['base']}, weights {saved['base_fingerprint']}); "
            f"this run's --model {here['base']} has weights {here['base_fingerprint']}"
        )
    if saved["targets"] != here["targets"]:
        raise CheckpointError(
            f"{flag} {path}: adapters on other layers ({len(saved['targets'])}) than this run's --lora_targets "
            f"({len(here['targets'])})"
        )
    return True


def adapter_state(model_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A LoRA checkpoint's weights under the names a peft adapter folder uses (`base_model.model.` prefix, no adapter
    name), as `PeftModel.save_pretrained` writes them."""
    out = {}
    for key, value in model_state.items():
        if ".lora_" not in key:
            continue
        out["base_model.model." + key.replace(f".{ADAPTER}.", ".")] = value
    return out


def write_adapter(model_state: dict[str, torch.Tensor], info: dict[str, Any], dest: Path, dtype: torch.dtype) -> Path:
    """A peft adapter folder (adapter_config.json, adapter_model.safetensors) that `PeftModel.from_pretrained(base,
    dest)` loads. Written to a temporary folder renamed at the end."""
    from safetensors.torch import save_file

    dest = Path(dest)
    tmp = dest.with_name(f".{dest.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    settings = LoraConfig(lora_rank=info["rank"], lora_alpha=info["alpha"], lora_dropout=info["dropout"])
    peft_config(settings, info["targets"], base=info["base"]).save_pretrained(str(tmp))
    tensors = {k: v.detach().to(dtype).contiguous() for k, v in adapter_state(model_state).items()}
    save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
    (tmp / "fsdp_opt_base.json").write_text(
        json.dumps({"base": info["base"], "base_fingerprint": info["base_fingerprint"]}) + "\n"
    )
    if dest.exists():
        shutil.rmtree(dest)
    tmp.rename(dest)
    return dest


def load_base(info: dict[str, Any], seed: int, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The base model a LoRA checkpoint belongs to, on CPU (with its head: a score layer where one trained whole),
    checked against the fingerprint the checkpoint recorded."""

    source = resolve_model(info["base"])
    config = load_model_config(source)
    config.use_cache = True
    head = SEQUENCE_SCORE if SCORE_LAYER in info.get("whole", ()) else "causal_lm"
    set_head(config, head, load_tokenizer(source).pad_token_id)
    base = cpu_model(source, config, seed, head=head, dtype=dtype)
    found = fingerprint(full_state(base)[0])
    if found != info["base_fingerprint"]:
        raise CheckpointError(
            f"--model {info['base']}: its weights ({found}) are not the base the adapters were trained on "
            f"({info['base_fingerprint']})"
        )
    return base.eval()


def merged_state(
    adapter_dir: Path, info: dict[str, Any], seed: int, whole: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """The base with the adapter folder's update merged into its weights (peft's merge_and_unload), in fp32, and the
    layers that trained whole (`whole`: their weights) in place. A 4-bit base (--base_bits 4) is the NF4 weights the
    adapters were trained on, dequantized."""
    from peft import PeftModel

    base = load_base(info, seed)
    if info.get("base_bits") == 4:
        dequantize_base(base)
    model = PeftModel.from_pretrained(base, str(adapter_dir))
    return {**model.merge_and_unload().state_dict(), **{k: v.float() for k, v in (whole or {}).items()}}


def whole_state(model_state: dict[str, torch.Tensor], info: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The weights of a LoRA checkpoint's layers that trained whole (a reward model's score layer)."""
    return {k: v for k, v in model_state.items() if k.split(".", 1)[0] in info.get("whole", ())}


@torch.no_grad()
def merge_adapters(model: nn.Module, copies: set[int]) -> list[nn.Module]:
    """Each LoRA layer's adapters added into its base weight (peft's merge), so that its forward is one matmul, not
    three: a decoding step is bound by the host's kernel launches, and opt-1.3b's 144 adapted layers took it from
    12.7 to 40.4 ms on an H200 (benchmarks/decode_step.py). Only where the base weight is a plain floating tensor
    that lives in `copies` (the gathered copies FSDP drops at reshard: the weights it keeps are never changed); the
    NF4 base is left as it is. Returns the merged layers, for `unmerge_adapters`."""
    from peft.tuners.lora import LoraLayer

    merged = []
    for m in model.modules():
        if not isinstance(m, LoraLayer) or m.merged or m.disable_adapters:
            continue
        weight = m.get_base_layer().weight
        if is_traceable_wrapper_subclass(weight) or not weight.is_floating_point():
            continue
        if not set(storages(weight)) <= copies:
            continue
        m.merge(adapter_names=[ADAPTER])
        merged.append(m)
    return merged


@torch.no_grad()
def unmerge_adapters(layers: list[nn.Module]) -> None:
    """The adapters taken back out of the weights `merge_adapters` changed (peft's unmerge)."""
    for m in layers:
        m.unmerge()


@contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """The base alone: every LoRA layer's adapters switched off (peft's flag), then back on."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    before = [m._disable_adapters for m in layers]
    # NOTE: the flag itself, not enable_adapters(): that also flips requires_grad of the adapters FSDP holds.
    for m in layers:
        m._disable_adapters = True
    try:
        yield
    finally:
        for m, was in zip(layers, before):
            m._disable_adapters = was
