"""--method dpo's and kto's reference pass, a step of setup like loading the weights: the reference model's summed
answer log-probabilities of every unit of the session's range (DPO: each pair's two answers; KTO: each item's own
sequence and the mismatched ones its micro-batches read) and of its held-out units, computed once, before training.

- The reference is --ref_model, else the model the chain started from (its checkpoints record it: a resumed session
  never takes the reference from the checkpoint it resumes), else, for a LoRA run, the base with its adapters switched
  off (no second model; computed with the run's own model).
- A model to load is built sharded like the run's, its weights frozen and stored in the compute dtype (fp16 on a
  T4), run once in eval mode, and freed before the trainable model is built: the two never share the GPUs.
- The result, by unit key (a dataset row; KTO: two items), goes into every checkpoint; a session that resumes inside its range, with the same
  reference, reads it from there and runs nothing.

--method grpo's reference (policy_reference) is loaded the same way but kept beside the policy for the session: its
completions are new every step.
"""

from __future__ import annotations

import gc
from typing import Any

import torch

from fsdp_opt.base import ConfigError
from fsdp_opt.config.choices import shard_count
from fsdp_opt.config.parse import Config
from fsdp_opt.config.specs import spec
from fsdp_opt.engine.logprobs import Reference, Units, head_logps
from fsdp_opt.engine.loss import HeadLoss
from fsdp_opt.model.adapters import adapters_off
from fsdp_opt.model.nf4 import load_quantized, quantize_base, store_base
from fsdp_opt.model.parallelize import DTYPES, fp32_products_on_cpu, initialize, shard_model, tie_and_check
from fsdp_opt.model.sources import build_meta_model, load_model_config, load_tokenizer, resolve_model, without_dropout
from fsdp_opt.runtime.distributed import DistEnv, all_ranks_ok, broadcast_object, print0, rank0_first
from fsdp_opt.runtime.hostmem import release_host_memory

# A method's state in a checkpoint's payload (under its method's key) holds its reference: {"ref_model", "beta",
# "reference", "eval_reference"} (Reference states).
ADAPTERS_OFF = "the base, adapters off"


def reference_name(config: Config, saved: dict[str, Any] | None) -> str:
    """--ref_model; else the reference the chain recorded; else the model (a LoRA run: its base, adapters off)."""
    if config.method.ref_model:
        return config.method.ref_model
    if saved and saved.get("ref_model"):
        return saved["ref_model"]
    return ADAPTERS_OFF if config.lora.enabled else config.model.model


def saved_reference(payload: dict[str, Any] | None, env: DistEnv, key: str) -> dict[str, Any] | None:
    """The checkpoint's DPO record (rank 0 reads it), on every rank."""
    return broadcast_object((payload or {}).get(key) if env.is_main else None)


def reusable(saved: dict[str, Any] | None, key: str, name: str, pairs: Units | None) -> Reference | None:
    """The checkpoint's reference log-probabilities (`key`: of the training or the held-out units) when they are this
    reference's and cover these units."""
    ref = Reference.from_state((saved or {}).get(key))
    if ref is None or pairs is None or saved.get("ref_model") != name:
        return None
    return ref if ref.covers(pairs) else None


def _frozen(model: torch.nn.Module, dtype: torch.dtype) -> None:
    for p in model.parameters():
        p.requires_grad_(False)
    store_base(model, dtype)


def with_model(
    config: Config, env: DistEnv, name: str, precision: str, tokenizer, batch_size: int, *pairs: Units | None
) -> list[Reference | None]:
    """The reference model loaded (sharded, frozen, compute dtype), run over the units, and freed."""
    strategy = config.parallel.sharding_strategy if config.parallel.sharding_strategy != "AUTO" else "FULL_SHARD"
    return score_model(
        name,
        env,
        precision,
        tokenizer,
        batch_size,
        *pairs,
        policy=config.model.model,
        attention=config.model.attn_implementation,
        strategy=strategy,
        seed=config.train.seed,
        label=config.method.method,
    )


def load_frozen(
    name: str,
    env: DistEnv,
    precision: str,
    tokenizer,
    *,
    policy: str,
    attention: str = "auto",
    strategy: str = "FULL_SHARD",
    seed: int = 42,
    flag: str = "--ref_model",
    vocabulary: int | None = None,
    bits: int = 16,
) -> torch.nn.Module:  # noqa: ANN001
    """A reference (or teacher) model by name, loaded sharded like the run's, its weights frozen in the compute dtype
    (`bits` 4: its blocks' linear weights in NF4, quantized whole as a LoRA run's 4-bit base is), in eval mode; refused
    in one line, naming `flag`, when its tokenizer is not the policy's or (given `vocabulary`) its output layer's size
    is not."""
    source = all_ranks_ok(lambda: resolve_model(name))
    ref_config, ref_tokenizer = rank0_first(lambda: (load_model_config(source, attention), load_tokenizer(source)))

    def same_tokens() -> None:
        if ref_tokenizer.get_vocab() != tokenizer.get_vocab() or ref_tokenizer.eos_token_id != tokenizer.eos_token_id:
            raise ConfigError(
                f"{flag} {name}: its tokenizer is not the policy's ({policy}): their "
                "log-probabilities of the same answers would be of other tokens"
            )
        if vocabulary is not None and ref_config.vocab_size != vocabulary:
            raise ConfigError(
                f"{flag} {name}: its vocabulary has {ref_config.vocab_size} entries and the model's ({policy}) "
                f"{vocabulary}: their next-token distributions cannot be compared"
            )

    all_ranks_ok(same_tokens)
    without_dropout(ref_config)
    dtype = DTYPES[precision]
    model = build_meta_model(ref_config)
    _frozen(model, dtype)
    shards = shard_count(strategy, env.world_size, env.local_world_size)
    quantized = all_ranks_ok(lambda: quantize_base(model, shards, flag=f"{flag} with 4 bits")) if bits == 4 else []
    # one shard: the NF4 weights stay out of FSDP, whole on every rank (as a LoRA run's 4-bit base)
    whole = {model.get_parameter(n) for n in quantized} if shards == 1 else None
    shard_model(model, env, strategy=strategy, precision=precision, activation_checkpointing=False, ignored=whole)
    fp32_products_on_cpu(model, env.device, precision)

    def nf4_loader(m: torch.nn.Module, full_state: dict[str, torch.Tensor] | None, e: DistEnv) -> bool:
        load_quantized(m, full_state, quantized, e)
        return True

    initialize(
        model,
        env,
        source,
        ref_config,
        seed,
        weights=True,
        dtype=dtype,
        prepare=lambda m: _frozen(m, dtype),
        loader=nf4_loader if quantized else None,
    )
    tie_and_check(model)
    model.eval()
    return model


def load_beside(  # noqa: ANN001
    s, name: str, flag: str, strategy: str | None = None, vocabulary: int | None = None, bits: int = 16
) -> torch.nn.Module:
    """A model kept beside the run's for the session (GRPO's reference, distillation's teacher): load_frozen with the
    run's precision, tokenizer, attention and sharding strategy (AUTO: FULL_SHARD)."""
    c = s.config
    if strategy is None:
        strategy = c.parallel.sharding_strategy if c.parallel.sharding_strategy != "AUTO" else "FULL_SHARD"
    return load_frozen(
        name,
        s.env,
        s.precision,
        s.tokenizer,
        policy=c.model.model,
        attention=c.model.attn_implementation,
        strategy=strategy,
        seed=c.train.seed,
        flag=flag,
        vocabulary=vocabulary,
        bits=bits,
    )


def policy_reference(s, name: str, temperature: float, strategy: str) -> tuple[Any, torch.nn.Module | None]:  # noqa: ANN001
    """--method grpo's reference, kept beside the policy for the session: a function from a packed micro-batch to the
    reference's token log-probabilities (at the sampling temperature), and the model it loaded (None for a LoRA run's
    base with its adapters off, which is the policy's own model)."""
    if name == ADAPTERS_OFF:
        print0("grpo: reference: the base with the adapters switched off")

        @torch.no_grad()
        def off(batch: dict[str, torch.Tensor]) -> torch.Tensor:
            was = s.model.training
            s.model.eval()
            try:
                with adapters_off(s.model):
                    return head_logps(s.model, s.head_loss, batch, temperature)[0]
            finally:
                s.model.train(was)

        return off, None
    model = load_beside(s, name, "--ref_model", strategy)
    print0(f"grpo: reference {name}: loaded sharded in {s.precision}, kept beside the policy")
    head = HeadLoss.for_run(model, 0)

    @torch.no_grad()
    def logps(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return head_logps(model, head, batch, temperature)[0]

    return logps, model


def free(env: DistEnv) -> None:
    """Hand back the memory of a model just dropped (the caller's last reference deleted): the GPU's cache, the host's
    arenas."""
    gc.collect()
    if env.device.type == "cuda":
        torch.cuda.empty_cache()
    release_host_memory()


def score_model(
    name: str,
    env: DistEnv,
    precision: str,
    tokenizer,
    batch_size: int,
    *pairs: Units | None,
    policy: str,
    attention: str = "auto",
    strategy: str = "FULL_SHARD",
    seed: int = 42,
    label: str = "dpo",
) -> list[Reference | None]:
    """A model by name, loaded sharded and frozen in the compute dtype, run over the units (DPO's pairs, KTO's
    sequences), and freed (the training run's reference pass, and evaluate's). `label`: the method, in its lines."""
    model = load_frozen(
        name, env, precision, tokenizer, policy=policy, attention=attention, strategy=strategy, seed=seed
    )
    print0(f"{label}: reference {name}: loaded sharded in {precision}, scoring the {_what(label)}")
    ref = _score(model, env, batch_size, *pairs)
    del model
    free(env)
    return ref


def with_adapters_off(
    model: torch.nn.Module, env: DistEnv, batch_size: int, *pairs: Units | None, label: str = "dpo"
) -> list[Reference | None]:
    """A LoRA run's reference: its own model with the adapters switched off."""
    print0(f"{label}: reference: the base with the adapters switched off, scoring the {_what(label)}")
    with adapters_off(model):
        return _score(model, env, batch_size, *pairs)


def _what(label: str) -> str:
    return f"{spec(label).unit}s"


def _score(model: torch.nn.Module, env: DistEnv, batch_size: int, *pairs: Units | None) -> list[Reference | None]:
    """Each set of units' reference (None for None: nothing to score)."""
    return [None if p is None else Reference.scored(model, p, batch_size, env) for p in pairs]


def prepare(
    config: Config,
    env: DistEnv,
    payload: dict[str, Any] | None,
    key: str,
    pairs: Units,
    held: Units | None,
    precision: str,
    tokenizer,
    batch_size: int | None = None,
) -> tuple[str, list[Reference | None]]:
    """Before the model is built: the reference's name, and its log-probabilities of the training and held-out units
    where the checkpoint has them or a model must be loaded for them (a LoRA run's adapters-off reference is scored
    once the model is built: finish()). `key`: the method's, in the checkpoint and in the lines; `batch_size`: the
    micro-batch to score in (default --batch_size, 1 with auto)."""
    saved = saved_reference(payload, env, key)
    name = reference_name(config, saved)
    found = [reusable(saved, "reference", name, pairs), reusable(saved, "eval_reference", name, held)]
    if found[0] is not None:
        print0(
            f"{key}: reference {name}: its log-probabilities of rows [{config.data.start_idx}, ..) read from the "
            "checkpoint"
        )
    missing = [p if f is None else None for p, f in zip((pairs, held), found)]
    if name != ADAPTERS_OFF and any(m is not None for m in missing):
        batch = batch_size or (config.train.batch_size if isinstance(config.train.batch_size, int) else 1)
        scored = with_model(config, env, name, precision, tokenizer, batch, *missing)
        found = [f if f is not None else s for f, s in zip(found, scored)]
    return name, found


def finish(
    name: str,
    found: list[Reference | None],
    model: torch.nn.Module,
    env: DistEnv,
    batch_size: int,
    pairs: Units,
    held: Units | None,
    label: str = "dpo",
) -> list[Reference | None]:
    """After the model is built: the adapters-off reference's missing log-probabilities."""
    missing = [p if f is None else None for p, f in zip((pairs, held), found)]
    if name == ADAPTERS_OFF and any(m is not None for m in missing):
        scored = with_adapters_off(model, env, batch_size, *missing, label=label)
        found = [f if f is not None else s for f, s in zip(found, scored)]
    return found


def record(name: str, beta: float, found: list[Reference | None]) -> dict[str, Any]:
    """What checkpoints keep of the reference."""
    train, held = found
    return {
        "ref_model": name,
        "beta": beta,
        "reference": train.state_dict(),
        "eval_reference": held.state_dict() if held is not None else None,
    }
