"""What setup builds for a method besides the trained model, once, as values: the components its spec names
(config/methods/base.py `needs`), each with its own lifecycle, so that no method repeats one.

- `REFERENCE_PASS` (DPO, KTO): train/reference.py ReferencePass, scored before the model is built (a loaded
  reference) or right after it (a LoRA run's base, adapters off), and read from the checkpoint where it has it.
- `REFERENCE_BESIDE` (GRPO, RLOO with --beta > 0) and `TEACHER` (distillation): a frozen model kept beside the trained
  one for the session.
- `GENERATOR` (GRPO, RLOO, distillation): how completions are decoded (where they end, on the model gathered once or
  its shards, the static cache or the graph path), and the generation a checkpoint was saved inside.
- `REWARDS` (GRPO, RLOO): the reward functions, loaded before anything is taken or built, pinned by their rule.

`state()` is what every checkpoint keeps of them, under the method's name; a further range in the same session asks
`for_range`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from fsdp_opt.base import ConfigError
from fsdp_opt.checkpoint.drift import line as drift_line
from fsdp_opt.config.choices import BUILTIN_REWARDS
from fsdp_opt.config.methods import GENERATOR, REFERENCE_BESIDE, REFERENCE_PASS, REWARDS, TEACHER, MethodSpec
from fsdp_opt.config.methods.base import Flags
from fsdp_opt.data.sequences import held_out_micro_batches
from fsdp_opt.data.tokens import end_rules
from fsdp_opt.engine.decoding import Decoder
from fsdp_opt.engine.generation import Decoding, Sampling
from fsdp_opt.engine.loss import HeadLoss
from fsdp_opt.engine.rewards import Reward, load_all, model_reward
from fsdp_opt.engine.rollout import Generation
from fsdp_opt.runtime.distributed import DistEnv, all_ranks_ok, broadcast_object, print0, scatter_object
from fsdp_opt.runtime.torchao_gate import check_for_nf4
from fsdp_opt.train.reference import (
    ADAPTERS_OFF,
    Frozen,
    ReferencePass,
    check_reward_model,
    load_frozen,
    load_reward_model,
    policy_reference,
    reference_name,
)


@dataclass(frozen=True)
class Setup:
    """What the components are built for: the ranks, the run's model (its name, config and tokenizer, whether it is a
    LoRA run), the slice's sequences and held-out ones, its plan and the epochs this session trains of it, the
    micro-batch, whether generation runs on the model gathered once (the layout decided), --allow_changes."""

    env: DistEnv
    model_name: str
    model_config: Any
    tokenizer: Any
    lora: bool
    sequences: Any
    held_out: Any
    plan: Any
    epochs: range
    batch_size: int
    gather: bool = True
    allow_changes: bool = False


@dataclass
class Components:
    """The components of one run's method (None: the spec does not name it)."""

    spec: MethodSpec
    settings: Flags
    rewards: list[Reward] | None = None
    weights: list[float] | None = None
    reference: ReferencePass | None = None
    beside_name: str | None = None  # the model kept beside (a reference by name, or ADAPTERS_OFF; the teacher)
    beside: Any = None  # a reference's log-probability function of a packed micro-batch, or the teacher module
    decoding: Decoding | None = None
    decoder: Decoder | None = None
    restored: Generation | None = None  # the generation a checkpoint was saved inside (this rank's part)
    changes: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # rank 0's: reward rules changed since

    def state(self) -> dict[str, Any]:
        """What checkpoints keep of the components (the method's loss adds a generation it is inside)."""
        out: dict[str, Any] = {}
        if self.reference is not None:
            out.update(self.reference.state(), beta=self.settings.beta)
        if self.rewards is not None:
            out.update(rewards=[r.pin() for r in self.rewards], ref_model=self.beside_name)
        if TEACHER in self.spec.needs:
            out["teacher_model"] = self.beside_name
        return out

    def describe(self) -> str:
        parts = []
        if self.reference is not None:
            parts.append(self.reference.describe())
        if self.spec.needs and REFERENCE_BESIDE in self.spec.needs and self.settings.uses_reference:
            parts.append(f"reference: {self.beside_name}")
        if self.rewards:
            parts.append("rewards: " + ", ".join(r.label for r in self.rewards))
        if self.decoding is not None:
            where = "the model gathered once" if self.decoding.gather else "the shards (layer by layer)"
            how = {
                "static": "a static KV cache",
                "graphs": "a static KV cache, each step replayed as a CUDA graph",
                "generate": "transformers' generate",
            }[self.decoding.decoding]
            parts.append(f"generation on {where}, decoded with {how}")
        return "; ".join(parts)

    def further_range(self) -> str | None:
        """Why the session cannot start the chain's next range itself (None: it can)."""
        if self.reference is not None and self.reference.name != ADAPTERS_OFF:
            return (
                f"--method {self.spec.name} scores a range with its reference model before the trainable model is built"
            )
        return None


def check(spec: MethodSpec, settings: Flags, env: DistEnv) -> Components:
    """Every rank, before anything is taken or built: what the method's flags name can be had (the reward functions,
    torchao for a 4-bit teacher)."""
    components = Components(spec, settings)
    if REWARDS in spec.needs and not settings.reward and not settings.reward_model:
        raise ConfigError(
            f"--reward: --method {spec.name} needs at least one reward function (a built-in: {', '.join(BUILTIN_REWARDS)}; or "
            "path/to/file.py:function) or a --reward_model"
        )
    if REWARDS in spec.needs:
        models = 1 if settings.reward_model else 0
        components.rewards, components.weights = all_ranks_ok(
            lambda: load_all(settings.reward_names, settings.reward_weights, models)
        )
        if models:
            all_ranks_ok(lambda: check_reward_model(settings.reward_model) if env.is_main else None)
    if TEACHER in spec.needs and settings.teacher_bits == 4:
        all_ranks_ok(lambda: check_for_nf4("--teacher_bits 4"))
    return components


def before_model(components: Components, how: Frozen, payload: dict[str, Any] | None, made: Setup) -> Components:
    """Every rank, before the trainable model exists (the layout decided): the reference pass with a loaded model,
    the reward functions held to the chain's pins, the reference the chain recorded, the generation a checkpoint was
    saved inside. `made`: train/build.py's slice (its sequences, held-out ones, plan and the epochs it trains)."""
    spec, settings, env = components.spec, components.settings, how.env
    saved = broadcast_object((payload or {}).get(spec.name) if env.is_main else None) or {}
    name = reference_name(getattr(settings, "ref_model", None), saved, made.model_name, made.lora)
    if REFERENCE_PASS in spec.needs:
        micro = [m for epoch in made.epochs for m in made.plan.micro_batches(epoch)]
        units = made.sequences.reference_units(micro)
        held = made.held_out
        held_units = held.reference_units(held_out_micro_batches(held, made.batch_size)) if held is not None else None
        components.reference = ReferencePass.before_model(
            how, name, saved, units, held_units, made.batch_size, spec.name
        )
    if REWARDS in spec.needs:
        components.changes = all_ranks_ok(
            lambda: (
                refuse_changed_rewards(components, saved.get("rewards") or [], made.allow_changes)
                if env.is_main
                else []
            )
        )
        components.beside_name = name
    if TEACHER in spec.needs:
        components.beside_name = settings.teacher_model
    if GENERATOR in spec.needs:
        generation = saved.get("generation") if env.is_main else None
        parts = generation["ranks"] if generation and len(generation["ranks"]) == env.world_size else None
        mine = scatter_object(parts if env.is_main else None)
        components.restored = Generation.from_state(mine) if mine is not None else None
    return components


def refuse_changed_rewards(components: Components, saved: list[dict[str, str]], allow: bool) -> list[dict[str, Any]]:
    """Rank 0, resuming: a reward function whose source changed since the checkpoint is drift (its rule changed the
    objective): one line, refused unless --allow_changes; taken, it goes into the chain's record of changes (the
    changes returned)."""
    before = {r["name"]: r["source"] for r in saved}
    changed = [r for r in components.rewards if r.name in before and not r.same_rule(before[r.name])]
    changes = [
        {
            "flag": "reward",
            "from": f"{r.name} (source {before[r.name]})",
            "to": f"{r.name} (source {r.source})",
            "breaks": "another loss trains",
        }
        for r in changed
    ]
    for change in changes:
        print0(drift_line(change))
    if changed and not allow:
        raise ConfigError(
            f"--reward {changed[0].name}: its source changed since the checkpoint (the chain's objective would change "
            "mid-run); restore it, or pass --allow_changes to go on with the new rule"
        )
    return changes


def after_model(
    components: Components, model: torch.nn.Module, head: HeadLoss | None, how: Frozen, made: Setup
) -> Components:
    """Every rank, once the trainable model is built (before a checkpoint's state is loaded into it): the adapters-off
    reference pass, the model kept beside, and how completions are decoded."""
    spec, settings, env = components.spec, components.settings, how.env
    if components.reference is not None:
        components.reference = components.reference.after_model(model, env, made.batch_size)
    if REFERENCE_BESIDE in spec.needs and settings.uses_reference:
        components.beside, _ = policy_reference(model, head, how, components.beside_name, settings.temperature)
    if REWARDS in spec.needs and settings.reward_model:
        scorer, tokenizer = load_reward_model(how, settings.reward_model)
        components.rewards = [
            *components.rewards,
            model_reward(settings.reward_model, scorer, tokenizer, env, made.batch_size),
        ]
    if TEACHER in spec.needs:
        components.beside = load_frozen(
            how,
            settings.teacher_model,
            "--teacher_model",
            vocabulary=made.model_config.vocab_size,
            bits=settings.teacher_bits,
        )
        nf4 = ", its blocks' linear weights in NF4" if settings.teacher_bits == 4 else ""
        print0(
            f"{spec.name}: teacher {settings.teacher_model}: loaded sharded in {how.precision}{nf4}, frozen, kept beside the model"
        )
    if GENERATOR in spec.needs:
        components.decoding = decoding(spec, settings, made, env, how.seed)
        if components.decoding.decoding != "generate":
            components.decoder = Decoder(graphs=components.decoding.decoding == "graphs")
    return components


def decoding(spec: MethodSpec, settings: Flags, made: Setup, env: DistEnv, seed: int) -> Decoding:
    """How this run decodes: where a completion ends (its end ids, the template's end-of-turn text), on the model
    gathered once or its shards (the layout decided), and --decoding as this run can have it (graphs need a CUDA
    device; on the shards every rank runs every decoding step, through transformers' generate)."""
    conversational = (made.sequences if made.sequences is not None else made.held_out).conversational
    eos, stop = end_rules(made.tokenizer, made.model_config, conversational)
    gather = made.gather
    if not gather:
        print0(
            f"{spec.name}: the model gathered whole and its KV cache do not fit beside training: completions are "
            "generated on the shards, each block gathered in every decoding step (slower)"
        )
    chosen = settings.decoding
    if chosen == "graphs" and env.device.type != "cuda":
        print0(
            f"{spec.name}: --decoding graphs: CUDA graphs need a CUDA device (this run is on {env.device.type}): "
            "decoding with the static cache, unreplayed"
        )
        chosen = "static"
    if chosen != "generate" and not gather and env.world_size > 1:
        chosen = "generate"
    sampling = Sampling(settings.max_completion_length, settings.temperature, settings.top_p, settings.top_k)
    return Decoding(sampling=sampling, seed=seed, eos_ids=eos, stop=stop, gather=gather, decoding=chosen)


def for_evaluation(spec: MethodSpec, settings: Flags, how: Frozen, made: Setup, reference: str | None) -> Components:
    """`python -m fsdp_opt.evaluate`: what the method's scorer reads besides the models it compares: the reference's
    log-probabilities of the held-out units (a LoRA run's adapters-off reference is its base), and how completions
    are decoded (on the model gathered once). A method that keeps a teacher is refused first."""
    env = how.env
    if TEACHER in spec.needs:
        raise ConfigError(
            f"--method {spec.name}: python -m fsdp_opt.evaluate does not load a teacher; training reports the held-out "
            "divergence from it at each save (--eval_rows)"
        )
    components = check(spec, settings, env)
    if REFERENCE_PASS in spec.needs:
        name = reference or made.model_name
        name = made.model_name if name == ADAPTERS_OFF else name
        held = made.held_out.reference_units(held_out_micro_batches(made.held_out, made.batch_size))
        components.reference = ReferencePass.before_model(how, name, None, None, held, made.batch_size, spec.name)
    if REWARDS in spec.needs and settings.reward_model:
        scorer, tokenizer = load_reward_model(how, settings.reward_model)
        components.rewards = [
            *components.rewards,
            model_reward(settings.reward_model, scorer, tokenizer, env, made.batch_size),
        ]
    if GENERATOR in spec.needs:
        components.decoding = decoding(spec, settings, made, env, how.seed)
        if components.decoding.decoding != "generate":
            components.decoder = Decoder(graphs=components.decoding.decoding == "graphs")
    return components


def for_range(components: Components, model: torch.nn.Module, made: Setup) -> Components:
    """A further range in the same session: the adapters-off reference of the new range's units (the adapters
    trained so far switched off); the rest goes on as it is."""
    if components.reference is None:
        return dataclasses.replace(components, restored=None)
    env = made.env
    micro = [m for epoch in made.epochs for m in made.plan.micro_batches(epoch)]
    held = made.held_out
    held_units = held.reference_units(held_out_micro_batches(held, made.batch_size)) if held is not None else None
    fresh = dataclasses.replace(
        components.reference, units=made.sequences.reference_units(micro), held=held_units, found=[None, None]
    )
    return dataclasses.replace(components, reference=fresh.after_model(model, env, made.batch_size), restored=None)
