"""One way to build a model, for every model the package runs: the model being trained, a frozen reference or
teacher kept beside it, a reward model scoring completions, a checkpoint being evaluated, the CPU model an export
writes. A model class (a causal LM, or a sequence classifier of one label: a reward model) is made here and nowhere
else (peft's adapters beside it, model/adapters.py, load an adapter folder).

The fixed order on every rank: the skeleton on the meta device -> frozen (a reference, a teacher: its weights in the
compute dtype, or its blocks' linear weights in NF4) or adapters added (LoRA, on a frozen 16- or 4-bit base) -> the
caller's checks against the skeleton (a checkpoint's shapes) -> activation checkpointing and FSDP2 (each block, then
the root) -> the local shards allocated -> rank 0 reads the full weights once and every rank receives its shards by
broadcast -> the tie restored and nothing left on meta.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, PretrainedConfig, PreTrainedModel

from fsdp_opt.config.choices import shard_count
from fsdp_opt.config.methods import SEQUENCE_SCORE
from fsdp_opt.model.nf4 import load_quantized, quantize_base, store_base
from fsdp_opt.model.parallelize import DTYPES, fp32_products_on_cpu, shard_model, tie_and_check
from fsdp_opt.model.sources import ModelSource, fetch_error
from fsdp_opt.runtime.distributed import DistEnv, all_ranks_ok

SCORE_LAYER = "score"  # a sequence classifier's layer from hidden states to scores (transformers' name, every family)


def head_layers(head: str) -> tuple[str, ...]:
    """The layers of a head that train whole beside LoRA's adapters: a reward model's new score layer."""
    return (SCORE_LAYER,) if head == SEQUENCE_SCORE else ()


def model_class(head: str) -> type:
    """The transformers auto class of a head: the next-token layer, or a score per sequence."""
    return AutoModelForSequenceClassification if head == SEQUENCE_SCORE else AutoModelForCausalLM


def set_head(config: PretrainedConfig, head: str, pad_id: int | None) -> None:
    """A config read for a head it was not saved with: a score per sequence is one label, pooled at the last token
    that is not `pad_id` (as TRL's reward models are set up)."""
    if head == SEQUENCE_SCORE:
        config.num_labels = 1
        config.pad_token_id = pad_id


def meta_model(config: PretrainedConfig, head: str = "causal_lm") -> PreTrainedModel:
    """The model skeleton with no storage: every rank shards this."""
    with torch.device("meta"):
        return model_class(head).from_config(config, dtype=torch.float32)


def cpu_model(
    source: ModelSource,
    config: PretrainedConfig,
    seed: int,
    *,
    head: str = "causal_lm",
    weights: bool = True,
    dtype: torch.dtype = torch.float32,
) -> PreTrainedModel:
    """The whole model on CPU: its weights read (in `dtype`), or with no weights to read (the built-in model, a
    random: shape, `weights` False) initialised from `seed` in fp32 and cast. A score layer the weights lack (a causal
    LM read as a reward model) is initialised from `seed` too."""
    torch.manual_seed(seed)
    if source.pretrained_weights and weights:
        try:
            return model_class(head).from_pretrained(source.location, config=config, dtype=dtype)
        except Exception as exc:  # noqa: BLE001 - any failure to read the weights is one line
            raise fetch_error(source, exc) from None
    return model_class(head).from_config(config, dtype=torch.float32).to(dtype)


def full_state(
    model: nn.Module, weights: bool = True, prepare: Callable[[nn.Module], None] | None = None
) -> tuple[dict[str, torch.Tensor] | None, dict[str, torch.Tensor]]:
    """Rank 0: a CPU model's full weights (or None when `weights` is False) and its non-persistent buffers. `prepare`
    changes the model before its state is taken (LoRA adds its adapters)."""
    if prepare is not None:
        prepare(model)
    own = dict(model.named_buffers())
    buffers = {n: own[n].detach().clone() for n in non_persistent_buffer_names(model)}
    return (model.state_dict() if weights else None), buffers


def non_persistent_buffer_names(model: nn.Module) -> list[str]:
    """Buffers that state_dict() leaves out (e.g. rotary tables): they must be sent separately."""
    names = []
    for mod_name, module in model.named_modules():
        for b in sorted(getattr(module, "_non_persistent_buffers_set", ())):
            names.append(f"{mod_name}.{b}" if mod_name else b)
    return names


def initialize(
    model: nn.Module,
    env: DistEnv,
    source: ModelSource,
    config: PretrainedConfig,
    seed: int,
    *,
    weights: bool,
    loader: Any = None,
    prepare: Callable[[nn.Module], None] | None = None,
    **load: Any,
) -> None:
    """Allocate the local shards; with `weights`, fill them with the source's weights (rank 0 reads them once).

    Without `weights` (a checkpoint fills them next) rank 0 still builds the model on CPU when it has
    non-persistent buffers, which no state dict carries. `load` goes to cpu_model (head, dtype); `prepare(cpu model)`
    runs before its state is taken; `loader(model, full_state, env)` may load the weights itself (NF4 weights) and
    return True."""
    need = weights or bool(non_persistent_buffer_names(model))
    init = all_ranks_ok(
        lambda: (
            full_state(cpu_model(source, config, seed, weights=weights, **load), weights, prepare)
            if env.is_main and need
            else None
        )
    )
    state, buffers = init if init is not None else (None, None)
    materialize(model, env, buffers)
    if weights and not (loader is not None and loader(model, state, env)):
        load_weights(model, state, env)


def materialize(model: nn.Module, env: DistEnv, buffers: dict[str, torch.Tensor] | None) -> None:
    """Allocate this rank's shards; copy rank 0's non-persistent buffers (not in any state dict) to all ranks."""
    model.to_empty(device=env.device)
    own = dict(model.named_buffers())
    for name in non_persistent_buffer_names(model):
        buf = own[name]
        if env.is_main and buffers is not None:
            buf.copy_(buffers[name.replace("_checkpoint_wrapped_module.", "")].to(env.device))
        if env.world_size > 1:
            dist.broadcast(buf, src=0)


def load_weights(model: nn.Module, full_state: dict[str, torch.Tensor] | None, env: DistEnv) -> None:
    """Fill the local shards from rank 0's full state dict by broadcast."""
    set_model_state_dict(
        model,
        full_state if env.is_main else {},
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
    )


def freeze(model: nn.Module, dtype: torch.dtype) -> None:
    """No gradient anywhere, every weight stored in `dtype` (a reference, a teacher, a reward model that scores)."""
    for p in model.parameters():
        p.requires_grad_(False)
    store_base(model, dtype)


@dataclass(frozen=True)
class Build:
    """What to build: the model (its source and config, its head), how it is sharded and in which precision, and
    whether it trains (with its layout's options and LoRA adapters) or is frozen (its bits)."""

    source: ModelSource
    config: PretrainedConfig
    precision: str
    strategy: str
    seed: int = 42
    head: str = "causal_lm"
    trainable: bool = True
    bits: int = 16  # a frozen model's blocks' linear weights: the compute dtype (16) or NF4 (4)
    adapters: Any = None  # model/adapters.py Adapters: LoRA on a frozen base
    weights: bool = True  # False: the caller fills the shards next (a checkpoint)
    activation_checkpointing: bool = False
    reduce_dtype: str = "fp32"
    offload: bool = False
    compile: bool = False
    prefetch: int = 0
    flag: str = "--model"  # the flag that named it, in its lines


@dataclass
class Loaded:
    """The sharded model with its weights in place, and what sharding it found."""

    model: nn.Module
    block_classes: set[type]
    units: int  # its blocks, each an FSDP unit (the root is one more)


def load_model(build: Build, env: DistEnv, check: Callable[[nn.Module], None] | None = None) -> Loaded:
    """The model `build` describes, sharded on every rank with its weights in place. `check(model)` runs on the
    skeleton before it is sharded (a checkpoint's shapes against it)."""
    dtype = DTYPES[build.precision]
    model = meta_model(build.config, build.head)
    shards = shard_count(build.strategy, env.world_size, env.local_world_size)
    adapters, quantized = build.adapters, []
    if not build.trainable:
        freeze(model, dtype)
        if build.bits == 4:
            quantized = all_ranks_ok(lambda: quantize_base(model, shards, flag=f"{build.flag} with 4 bits"))
    if adapters is not None:
        all_ranks_ok(lambda: adapters.add_to(model, shards))
        quantized = adapters.quantized
    if check is not None:
        check(model)
    # one shard: NF4 weights stay out of FSDP, whole on every rank
    whole = {model.get_parameter(n) for n in quantized} if quantized and shards == 1 else None
    classes, units = shard_model(
        model,
        env,
        strategy=build.strategy,
        precision=build.precision,
        reduce_dtype=build.reduce_dtype,
        activation_checkpointing=build.activation_checkpointing and build.trainable,
        offload=build.offload,
        compile_blocks=build.compile,
        prefetch=build.prefetch,
        ignored=whole,
    )
    fp32_products_on_cpu(model, env.device, build.precision)

    def nf4_loader(m: nn.Module, full_state: dict[str, torch.Tensor] | None, e: DistEnv) -> bool:
        load_quantized(m, full_state, quantized, e)
        return True

    if adapters is not None:
        options = adapters.load_options()
    elif not build.trainable:
        options = {"dtype": dtype, "prepare": lambda m: freeze(m, dtype)}
    else:
        options = {}
    initialize(
        model,
        env,
        build.source,
        build.config,
        build.seed,
        weights=build.weights,
        loader=nf4_loader if quantized else None,
        head=build.head,
        **options,
    )
    if adapters is not None:
        adapters.share_fingerprint(env)
    if not build.trainable:
        tie_and_check(model)
        model.eval()
    return Loaded(model, classes, units)
