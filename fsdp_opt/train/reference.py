"""The models a method compares the trained one with, as setup builds them (train/components.py).

- **A reference pass** (DPO's, KTO's): the reference model's summed answer log-probabilities of every unit of the
  session's range (DPO: each pair's two answers; KTO: each item's own sequence and the mismatched ones its
  micro-batches read) and of its held-out units, computed once, before training, like loading the weights. The
  reference is --ref_model, else the model the chain started from (its checkpoints record it: a resumed session never
  takes the reference from the checkpoint it resumes), else, for a LoRA run, the base with its adapters switched off
  (no second model; computed with the run's own model once it is built). A model to load is built sharded like the
  run's, frozen in the compute dtype, run once in eval mode, and freed before the trainable model is built: the two
  never share the GPUs. The result, by unit key, goes into every checkpoint; a session that resumes inside its range,
  with the same reference, reads it from there and runs nothing.
- **A model kept beside** (GRPO's and RLOO's reference, distillation's teacher): loaded the same way and kept for
  the session, since its inputs (the sampled completions) are new every step.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Any

import torch

from fsdp_opt.base import ConfigError
from fsdp_opt.config.methods import SEQUENCE_SCORE
from fsdp_opt.engine.logprobs import Reference, Units, head_logps
from fsdp_opt.engine.loss import HeadLoss
from fsdp_opt.model.adapters import adapters_off
from fsdp_opt.model.loader import Build, load_model
from fsdp_opt.model.sources import load_model_config, load_tokenizer, resolve_model, without_dropout
from fsdp_opt.runtime.distributed import DistEnv, all_ranks_ok, print0, rank0_first
from fsdp_opt.runtime.hostmem import release_host_memory

ADAPTERS_OFF = "the base, adapters off"


def reference_name(ref_model: str | None, saved: dict[str, Any] | None, model: str, lora: bool) -> str:
    """--ref_model; else the reference the chain recorded; else the model (a LoRA run: its base, adapters off)."""
    if ref_model:
        return ref_model
    if saved and saved.get("ref_model"):
        return saved["ref_model"]
    return ADAPTERS_OFF if lora else model


@dataclass(frozen=True)
class Frozen:
    """How a model kept or scored beside the run's is loaded: the run's precision, sharding strategy, attention kernel
    and seed, and the tokenizer and model (their names) its own must match."""

    env: DistEnv
    precision: str
    strategy: str
    tokenizer: Any
    policy: str  # the run's --model, named in the lines
    attention: str = "auto"
    seed: int = 42


def load_frozen(how: Frozen, name: str, flag: str, vocabulary: int | None = None, bits: int = 16) -> torch.nn.Module:
    """A model by name, loaded sharded like the run's, frozen in the compute dtype (`bits` 4: its blocks' linear
    weights in NF4), in eval mode; refused in one line, naming `flag`, when its tokenizer is not the run's or (given
    `vocabulary`) its output layer's size is not."""
    env = how.env
    source = all_ranks_ok(lambda: resolve_model(name))
    config, tokenizer = rank0_first(lambda: (load_model_config(source, how.attention), load_tokenizer(source)))

    def same_tokens() -> None:
        if tokenizer.get_vocab() != how.tokenizer.get_vocab() or tokenizer.eos_token_id != how.tokenizer.eos_token_id:
            raise ConfigError(
                f"{flag} {name}: its tokenizer is not the policy's ({how.policy}): their log-probabilities of the same "
                "answers would be of other tokens"
            )
        if vocabulary is not None and config.vocab_size != vocabulary:
            raise ConfigError(
                f"{flag} {name}: its vocabulary has {config.vocab_size} entries and the model's ({how.policy}) "
                f"{vocabulary}: their next-token distributions cannot be compared"
            )

    all_ranks_ok(same_tokens)
    without_dropout(config)
    build = Build(source, config, how.precision, how.strategy, how.seed, trainable=False, bits=bits, flag=flag)
    return load_model(build, env).model


def free(env: DistEnv) -> None:
    """Hand back the memory of a model just dropped (the caller's last reference deleted): the GPU's cache, the host's
    arenas."""
    gc.collect()
    if env.device.type == "cuda":
        torch.cuda.empty_cache()
    release_host_memory()


@dataclass
class ReferencePass:
    """A reference's summed log-probabilities of the session's units and of its held-out ones, by unit key (what
    checkpoints keep under the method's key: {"ref_model", "reference", "eval_reference"})."""

    name: str
    units: Units | None
    held: Units | None
    found: list[Reference | None]
    label: str  # the method, in its lines

    @classmethod
    def before_model(
        cls,
        how: Frozen,
        name: str,
        saved: dict[str, Any] | None,
        units: Units | None,
        held: Units | None,
        batch_size: int,
        label: str,
    ) -> ReferencePass:
        """Before the model is built: the log-probabilities the checkpoint has, or those a loaded reference model
        gives (a LoRA run's adapters-off reference is scored once the model is: `after_model`)."""
        found = [reusable(saved, "reference", name, units), reusable(saved, "eval_reference", name, held)]
        if found[0] is not None:
            print0(f"{label}: reference {name}: its log-probabilities of this range read from the checkpoint")
        missing = [u if f is None else None for u, f in zip((units, held), found)]
        if name != ADAPTERS_OFF and any(m is not None for m in missing):
            model = load_frozen(how, name, "--ref_model")
            print0(f"{label}: reference {name}: loaded sharded in {how.precision}, scoring the {(units or held).noun}s")
            scored = [None if m is None else Reference.scored(model, m, batch_size, how.env) for m in missing]
            del model
            free(how.env)
            found = [f if f is not None else s for f, s in zip(found, scored)]
        return cls(name, units, held, found, label)

    def after_model(self, model: torch.nn.Module, env: DistEnv, batch_size: int) -> ReferencePass:
        """Once the model is built: the adapters-off reference's missing log-probabilities."""
        missing = [u if f is None else None for u, f in zip((self.units, self.held), self.found)]
        if self.name == ADAPTERS_OFF and any(m is not None for m in missing):
            print0(f"{self.label}: reference: the base with the adapters switched off, scoring the {self.units.noun}s")
            with adapters_off(model):
                scored = [None if m is None else Reference.scored(model, m, batch_size, env) for m in missing]
            self.found = [f if f is not None else s for f, s in zip(self.found, scored)]
        return self

    def state(self) -> dict[str, Any]:
        train, held = self.found
        return {
            "ref_model": self.name,
            "reference": train.state_dict(),
            "eval_reference": held.state_dict() if held is not None else None,
        }

    def describe(self) -> str:
        return f"reference: {self.name}"


def reusable(saved: dict[str, Any] | None, key: str, name: str, units: Units | None) -> Reference | None:
    """The checkpoint's reference log-probabilities (`key`: of the training or the held-out units) when they are this
    reference's and cover these units."""
    ref = Reference.from_state((saved or {}).get(key))
    if ref is None or units is None or saved.get("ref_model") != name:
        return None
    return ref if ref.covers(units) else None


def policy_reference(model: torch.nn.Module, head: HeadLoss | None, how: Frozen, name: str, temperature: float):  # noqa: ANN201
    """A reference kept beside the policy for the session (GRPO's, RLOO's): a function from a packed micro-batch to the
    reference's token log-probabilities (at the sampling temperature), and the model it loaded (None for a LoRA run's
    base with its adapters off, which is the policy's own model)."""
    if name == ADAPTERS_OFF:
        print0("reference: the base with the adapters switched off")

        @torch.no_grad()
        def off(batch: dict[str, torch.Tensor]) -> torch.Tensor:
            was = model.training
            model.eval()
            try:
                with adapters_off(model):
                    return head_logps(model, head, batch, temperature)[0]
            finally:
                model.train(was)

        return off, None
    beside = load_frozen(how, name, "--ref_model")
    print0(f"reference {name}: loaded sharded in {how.precision}, kept beside the policy")
    beside_head = HeadLoss.for_run(beside, 0)

    @torch.no_grad()
    def logps(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return head_logps(beside, beside_head, batch, temperature)[0]

    return logps, beside


def check_reward_model(name: str) -> None:
    """Rank 0, before anything is taken or built: --reward_model is a sequence classifier of one label."""
    config = load_model_config(resolve_model(name))
    kinds = config.architectures or [config.model_type]
    if config.num_labels != 1 or not any(k.endswith("ForSequenceClassification") for k in kinds):
        raise ConfigError(
            f"--reward_model {name}: not a sequence classifier of one label (it is {kinds[0]} with {config.num_labels} "
            "labels); a model trained with --method reward and exported is one"
        )


def load_reward_model(how: Frozen, name: str) -> tuple[torch.nn.Module, Any]:
    """--reward_model, loaded sharded like the run's and frozen in the compute dtype, with its own tokenizer (its pad
    token the one its scores are pooled before, as TRL sets it)."""
    source = all_ranks_ok(lambda: resolve_model(name))
    config, tokenizer = rank0_first(lambda: (load_model_config(source, how.attention), load_tokenizer(source)))
    config.pad_token_id = tokenizer.pad_token_id
    build = Build(
        source,
        config,
        how.precision,
        how.strategy,
        how.seed,
        head=SEQUENCE_SCORE,
        trainable=False,
        flag="--reward_model",
    )
    model = load_model(build, how.env).model
    print0(f"reward model {name}: loaded sharded in {how.precision}, scoring each completion")
    return model, tokenizer
