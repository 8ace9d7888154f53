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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .errors import CheckpointError, ConfigError
from .flags import flag
from .torchao_gate import check_for_nf4

ADAPTER = "default"  # peft's adapter name inside the model; not part of the exported keys
KEY = "lora"  # the checkpoint key holding the run's LoRA identity


@dataclass
class LoraConfig:
    lora_rank: int = flag(
        0, "LoRA rank: train low-rank adapters (peft) on a frozen base instead of every weight. 0: full fine-tuning."
    )
    lora_alpha: float | None = flag(None, "LoRA scaling numerator (the update is alpha/rank x B A). Default: 2 x rank.")
    lora_dropout: float | None = flag(None, "Dropout on the adapters' input. Default: 0.05.")
    lora_targets: str | None = flag(
        None,
        "Comma-separated layer names to adapt (e.g. q_proj,v_proj), matched inside the decoder blocks. Default: every "
        "linear layer of the blocks (embeddings and lm_head stay frozen).",
    )
    base_bits: int = flag(16, "Storage of the frozen base: 16 (the compute dtype) or 4 (NF4, torchao).", choices=(16, 4))

    def __post_init__(self) -> None:
        if self.lora_rank < 0:
            raise ConfigError(f"--lora_rank {self.lora_rank}: must be 0 (full fine-tuning) or more")
        if self.lora_rank == 0:
            given = [n for n in ("lora_alpha", "lora_dropout", "lora_targets") if getattr(self, n) is not None]
            if given:
                raise ConfigError(f"--{given[0]}: only with --lora_rank of 1 or more (rank 0 is full fine-tuning)")
            if self.base_bits != 16:
                raise ConfigError(f"--base_bits {self.base_bits}: only with LoRA (--lora_rank 1 or more): a 4-bit base is frozen")
            return
        if self.lora_alpha is not None and not self.lora_alpha > 0:
            raise ConfigError(f"--lora_alpha {self.lora_alpha}: must be greater than 0")
        if self.lora_dropout is not None and not 0.0 <= self.lora_dropout < 1.0:
            raise ConfigError(f"--lora_dropout {self.lora_dropout}: must be in [0, 1)")
        if self.lora_targets is not None and not [t for t in self.lora_targets.split(",") if t.strip()]:
            raise ConfigError("--lora_targets: name at least one layer, e.g. q_proj,v_proj")

    @property
    def enabled(self) -> bool:
        return self.lora_rank > 0

    @property
    def alpha(self) -> float:
        return float(self.lora_alpha) if self.lora_alpha is not None else 2.0 * self.lora_rank

    @property
    def dropout(self) -> float:
        return 0.05 if self.lora_dropout is None else float(self.lora_dropout)


def block_linear_names(model: nn.Module) -> list[str]:
    """Full names of the linear layers inside the decoder blocks (the blocks the wrap policy shards)."""
    from transformers.pytorch_utils import Conv1D

    from .parallelize import find_block_classes, find_blocks

    blocks = {id(b) for b in find_blocks(model, find_block_classes(model))}
    names: list[str] = []
    prefix_of_block: list[str] = [n for n, m in model.named_modules() if id(m) in blocks]
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, Conv1D)) and any(name.startswith(p + ".") for p in prefix_of_block):
            names.append(name)
    return names


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
        r=settings.lora_rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout, target_modules=list(targets),
        bias="none", task_type="CAUSAL_LM", base_model_name_or_path=base,
    )  # fmt: skip


def inject(model: nn.Module, settings: LoraConfig, *, meta: bool, seed: int | None = None) -> list[str]:
    """Add the adapters to `model` in place (every base weight frozen). On a real model, `seed` fixes their initial
    values (lora_A random, lora_B zero, so the model's output is unchanged). Returns the adapted layers' names."""
    from peft import inject_adapter_in_model

    targets = find_targets(model, settings.lora_targets)
    if seed is not None:
        torch.manual_seed(seed)
    inject_adapter_in_model(peft_config(settings, targets), model, adapter_name=ADAPTER, low_cpu_mem_usage=meta)
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_" in name)
    return targets


def store_base(model: nn.Module, dtype: torch.dtype) -> None:
    """The frozen parameters in `dtype` (on meta: only their declared dtype), the adapters in fp32. The parameter
    objects stay the same, so tied weights stay tied."""
    for p in model.parameters():
        want = torch.float32 if p.requires_grad else dtype
        if p.dtype != want:
            p.data = p.data.to(want)


def _to_nf4() -> Any:
    """torchao's NF4 quantizer (its module moved between releases)."""
    check_for_nf4()
    try:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4
    except ImportError:
        from torchao.dtypes.nf4tensor import to_nf4
    return to_nf4


def base_linears(model: nn.Module) -> list[str]:
    """The frozen linear layers of the blocks (an adapted layer's base_layer; not the adapters themselves)."""
    return [n for n in block_linear_names(model) if ".lora_" not in n and not isinstance(model.get_submodule(n), _peft_layer())]


def _peft_layer() -> type:
    from peft.tuners.lora import LoraLayer

    return LoraLayer


NF4_BLOCK, NF4_SCALER_BLOCK = 64, 256  # torchao's defaults: 64 weights share a scale, 256 scales a factor


def quantize_base(model: nn.Module, shards: int) -> list[str]:
    """Every frozen linear weight of the blocks as a torchao NF4 tensor (4 bits, blocks of 64 with scales), which
    FSDP2 shards and gathers as its packed bytes. On meta only the layout is made. Returns the weights' names."""
    to_nf4 = _to_nf4()
    names = []
    unit = NF4_BLOCK * NF4_SCALER_BLOCK * shards
    for name in base_linears(model):
        layer = model.get_submodule(name)
        rows = layer.weight.shape[0]
        if layer.weight.numel() % unit or rows % shards:
            raise ConfigError(
                f"--base_bits 4: {name} ({rows} x {layer.weight.shape[1]}) does not split into {shards} NF4 shards "
                f"(each needs a multiple of {NF4_BLOCK * NF4_SCALER_BLOCK} weights); use --base_bits 16 or fewer ranks"
            )
        layer.weight = nn.Parameter(to_nf4(layer.weight.detach()), requires_grad=False)
        names.append(f"{name}.weight")
    return names


@torch.no_grad()
def load_quantized(model: nn.Module, full_state: dict[str, torch.Tensor] | None, names: list[str], env: Any) -> None:
    """Fill the NF4 shards: rank 0 sends each weight whole, every rank quantizes it whole (the same bytes on every
    rank and for any rank count) and keeps its own rows. The other weights load as usual."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    to_nf4 = _to_nf4()
    params = dict(model.named_parameters())
    for name in names:
        into = params[_sharded_name(params, name)]
        sharded = isinstance(into, DTensor)
        local = into._local_tensor if sharded else into  # the object FSDP2 gathers from
        shape = tuple(into.shape)
        full = full_state.pop(name).to(env.device) if env.is_main else torch.empty(shape, dtype=local.dtype, device=env.device)
        if env.world_size > 1:
            dist.broadcast(full, src=0)
        quantized = to_nf4(full)
        part = quantized
        if sharded:  # this rank's rows, wherever the mesh puts them (a shard group of HYBRID_SHARD included)
            (rows, _), (offset, _) = compute_local_shape_and_global_offset(shape, into.device_mesh, into.placements)
            part = torch.split(quantized, rows)[offset // rows]
        local.copy_(part)  # the packed bytes and scales
        # The whole tensor's scale mean and the NF4 code table travel with every shard (FSDP2 passes them to the
        # gathered weight as they are): made on meta with the skeleton, set here.
        local.scaler_mean, local.nf4 = part.scaler_mean.clone(), part.nf4.clone()
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    set_model_state_dict(model, full_state if env.is_main else {}, options=opts)


def _sharded_name(params: dict[str, Any], name: str) -> str:
    if name in params:
        return name
    return next(n for n in params if n.replace("_checkpoint_wrapped_module.", "") == name)


class Adapters:
    """One run's adapters: added to the meta model every rank shards, and to rank 0's CPU model that fills it."""

    def __init__(self, settings: LoraConfig, base: str, dtype: torch.dtype, seed: int):
        self.settings, self.base, self.dtype, self.seed = settings, base, dtype, seed
        self.targets: list[str] = []
        self.quantized: list[str] = []  # the NF4 weights with --base_bits 4
        self.shards = 1
        self.base_fingerprint: str | None = None  # known once rank 0 has read the base (and shared it)

    def add_to(self, model: nn.Module, shards: int = 1) -> None:
        """Every rank, on the meta skeleton, before sharding into `shards`."""
        self.targets = inject(model, self.settings, meta=True)
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
            inject(model, self.settings, meta=False, seed=self.seed)
            store_base(model, self.dtype)

        return {"dtype": self.dtype, "prepare": prepare}

    def share_fingerprint(self, env: Any) -> None:
        """Every rank: rank 0's fingerprint of the base to all."""
        if env.world_size > 1:
            from .distributed import broadcast_object

            self.base_fingerprint = broadcast_object(self.base_fingerprint)

    def identity(self) -> dict[str, Any]:
        return identity(self.settings, self.targets, self.base, self.base_fingerprint)


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
        "rank": settings.lora_rank, "alpha": settings.alpha, "dropout": settings.dropout, "targets": list(targets),
        "base": base, "base_fingerprint": base_fingerprint, "base_bits": settings.base_bits,
    }  # fmt: skip


def check_resume(saved: dict[str, Any] | None, here: dict[str, Any] | None, path: Path, flag: str = "--resume_file") -> bool:
    """Refuse, in one line, a resume whose adapters or base differ from this run's. Before the base is read (no
    fingerprint yet) a base of another name is left to the later check, which compares the weights themselves.
    Returns whether the adapters were compared (same base, same layers)."""
    if saved is None and here is None:
        return False
    if saved is None:
        raise CheckpointError(f"{flag} {path}: a full fine-tuning checkpoint; resume it without --lora_rank")
    if here is None:
        raise CheckpointError(f"{flag} {path}: a LoRA checkpoint (rank {saved['rank']}); resume it with --lora_rank {saved['rank']}")
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
    (tmp / "fsdp_opt_base.json").write_text(json.dumps({"base": info["base"], "base_fingerprint": info["base_fingerprint"]}) + "\n")
    if dest.exists():
        shutil.rmtree(dest)
    tmp.rename(dest)
    return dest


def load_base(info: dict[str, Any], seed: int, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The base model a LoRA checkpoint belongs to, on CPU, checked against the fingerprint the checkpoint recorded."""
    from .models import load_full_state_dict, load_model_config, resolve_model

    source = resolve_model(info["base"])
    config = load_model_config(source)
    config.use_cache = True
    built: list[nn.Module] = []
    state, _ = load_full_state_dict(source, config, seed, dtype=dtype, prepare=built.append)
    found = fingerprint(state)
    if found != info["base_fingerprint"]:
        raise CheckpointError(
            f"--model {info['base']}: its weights ({found}) are not the base the adapters were trained on "
            f"({info['base_fingerprint']})"
        )
    return built[0].eval()


def merged_state(adapter_dir: Path, info: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """The base with the adapter folder's update merged into its weights (peft's merge_and_unload), in fp32."""
    from peft import PeftModel

    model = PeftModel.from_pretrained(load_base(info, seed), str(adapter_dir))
    return model.merge_and_unload().state_dict()
