"""Flags of the training method (--method and each method's settings), checked against the method's spec
(config/specs.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fsdp_opt.base import ConfigError
from fsdp_opt.config.choices import BUILTIN_REWARDS
from fsdp_opt.config.flags import flag
from fsdp_opt.config.specs import DEFAULT_METHOD, LOSS_TYPES, METHOD_SPECS, METHODS, MethodSpec, method_flags, spec

SCALE_REWARDS = ("group", "batch", "none")  # --scale_rewards: the std an advantage is divided by
IMPORTANCE_LEVELS = ("token", "sequence")  # --importance_sampling_level: where the probability ratio is taken
DECODING = ("static", "graphs", "generate")  # --decoding: how completions are decoded (engine/decoding.py)


@dataclass
class MethodConfig:
    method: str = flag(
        DEFAULT_METHOD,
        "What a step trains. sft: next-token loss on the targets of --train_on. dpo: Direct Preference Optimization on "
        "preference rows: -log sigmoid(beta x the chosen answer's log-probability ratio to the reference model minus "
        "the rejected one's), summed log-probabilities of the answer tokens, averaged over the step's pairs. grpo: "
        "Group Relative Policy Optimization on prompt rows: --num_generations completions of each prompt, sampled from "
        "the policy, scored by --reward, each pushed up or down by its reward against its group's (TRL's loss). kto: "
        "Kahneman-Tversky Optimization on rows each labelled desirable or not (a label column of true/false; "
        "preference rows give their chosen answer as desirable and their rejected one as not): each completion's "
        "log-probability ratio to the reference model, against a KL estimate, through a sigmoid (TRL's loss). distill: "
        "on-policy distillation on prompt rows: a completion of each prompt sampled from the model, then each of its "
        "tokens' next-token distribution pulled toward --teacher_model's by the generalized Jensen-Shannon divergence "
        "of --beta (TRL's DistillationTrainer).",
        choices=METHODS,
    )
    beta: float | None = flag(
        None,
        "--method dpo and kto: the strength of the pull toward the reference model (DPO's and KTO's beta; default "
        "0.1). --method grpo: the weight of the KL term against the reference model (default 0: no reference model, "
        "as TRL). --method distill: which divergence from the teacher, in [0, 1]: 0 the forward KL (teacher to "
        "model), 1 the reverse KL (model to teacher; the default, as TRL), between them the generalized JSD of the "
        "mixture (1 - beta) p_model + beta p_teacher.",
    )
    teacher_model: str | None = flag(
        None,
        "--method distill: the teacher (a Hub id or local folder, as --model), loaded sharded like the model, frozen, "
        "in the compute dtype, and kept beside it; its tokenizer and vocabulary must be the model's.",
    )
    teacher_bits: int = flag(
        16,
        "--method distill: the teacher's weights in the compute dtype (16), or its blocks' linear weights as NF4 (4: "
        "4 bits each, torchao, as --base_bits 4 stores a LoRA base), for a teacher that would not fit beside the "
        "model otherwise.",
        choices=(16, 4),
    )
    ref_model: str | None = flag(
        None,
        "--method dpo and kto (or grpo with --beta > 0): the reference model (a Hub id or local folder, as --model). Default: "
        "the model the chain started from, which the chain records (a resumed session never takes it from its "
        "checkpoint); a LoRA run without it uses its base with the adapters switched off.",
    )
    num_generations: int = flag(8, "--method grpo: completions sampled per prompt (G, a group).")
    max_completion_length: int = flag(
        256, "--method grpo and distill: the most tokens a completion has (its end of text included)."
    )
    temperature: float = flag(
        1.0,
        "--method grpo and distill: the sampling temperature; the log-probabilities (distill: both models' "
        "distributions) are of the logits divided by it, as the completions were drawn.",
    )
    top_p: float = flag(1.0, "--method grpo and distill: nucleus sampling's share of the probability (1.0: off).")
    top_k: int = flag(0, "--method grpo and distill: sample among the k likeliest tokens only (0: off; 1: greedy).")
    epsilon: float = flag(0.2, "--method grpo: the clip range below 1 of the probability ratio.")
    epsilon_high: float | None = flag(None, "--method grpo: the clip range above 1 (default: --epsilon).")
    loss_type: str | None = flag(
        None,
        "--method grpo (default dapo): what the step's summed token losses are divided by. dapo: the step's "
        "completion tokens, all ranks; grpo: each completion's own tokens (a mean per completion), then the "
        "completions; dr_grpo: completions x --max_completion_length; bnpo: each micro-batch's completion tokens. "
        "--method kto (default kto): kto: 1 - sigmoid(beta x (ratio - KL)) of a desirable completion, 1 - "
        "sigmoid(beta x (KL - ratio)) of an undesirable one; apo_zero_unpaired: the same without the KL estimate "
        "(1 - sigmoid(beta x ratio), sigmoid(beta x ratio)).",
        choices=LOSS_TYPES,
    )
    desirable_weight: float = flag(
        1.0, "--method kto: the weight of a desirable row's loss (raise it when desirable rows are the fewer)."
    )
    undesirable_weight: float = flag(1.0, "--method kto: the weight of an undesirable row's loss.")
    scale_rewards: str = flag(
        "group",
        "--method grpo: an advantage is its reward less its group's mean, divided by the std of its group (group), of "
        "the step's rewards (batch), or by nothing (none); plus 1e-4.",
        choices=SCALE_REWARDS,
    )
    mask_truncated_completions: bool = flag(False, "--method grpo: a completion that never ends carries no loss.")
    num_iterations: int = flag(
        1,
        "--method grpo: how many times each generation is trained on (TRL's num_iterations, mu). Above 1 the "
        "log-probabilities the completions were sampled with are kept, the probability ratio moves off 1 and "
        "--epsilon clips it.",
    )
    steps_per_generation: int | None = flag(
        None,
        "--method grpo: the micro-steps one generation feeds (TRL's); default --accum_steps, so that one generation "
        "feeds one optimizer step; twice that, two (the generation's prompts sampled at once, then trained a step's "
        "worth at a time). A multiple of --accum_steps.",
    )
    delta: float | None = flag(
        None,
        "--method grpo: the two-sided clip's upper bound on the probability ratio (TRL's delta, INTELLECT-2; off by "
        "default); above 1 + --epsilon_high.",
    )
    importance_sampling_level: str = flag(
        "token",
        "--method grpo: the probability ratio per token (token), or per completion (sequence: the exp of the mean of "
        "its tokens' log-ratios, GSPO).",
        choices=IMPORTANCE_LEVELS,
    )
    decoding: str = flag(
        "static",
        "--method grpo and distill: how completions are decoded. static: all of a rank's completions as one batch with a KV cache "
        "sized once; graphs: the same, each decoding step captured once as a CUDA graph and replayed per token (CUDA "
        "only; off by default: no GPU has measured it yet, docs/grpo.md); generate: transformers' generate.",
        choices=DECODING,
    )
    reward: str | None = flag(
        None,
        f"--method grpo: the reward functions, comma-separated (or the flag repeated): a built-in "
        f"({', '.join(BUILTIN_REWARDS)}), path/to/file.py:function or module:function, called as TRL calls them: "
        "f(prompts=, completions=, completion_ids=, **columns), one float (or None) per completion.",
        action="append",
    )
    reward_weights: str | None = flag(
        None, "--method grpo: a weight per reward function, comma-separated (default 1 each)."
    )

    def __post_init__(self) -> None:
        t = spec(self.method)
        if isinstance(self.reward, list):  # repeated, comma-separated or both: one comma-separated value
            self.reward = ",".join(n.strip() for given in self.reward for n in given.split(",") if n.strip()) or None
        if self.beta is None:
            self.beta = t.beta  # the flag's default is this method's
        if t.reference == "always" and not self.beta > 0:
            raise ConfigError(f"--beta {self.beta}: must be greater than 0")
        if self.loss_type is not None and self.loss_type not in t.loss_types:
            where = f"one of {', '.join(t.loss_types)}" if t.loss_types else "it has none"
            raise ConfigError(f"--loss_type {self.loss_type}: not for --method {self.method} ({where})")
        if self.loss_type is None and t.loss_types:
            self.loss_type = t.loss_types[0]  # the flag's default is this method's
        for name in ("desirable_weight", "undesirable_weight"):
            value = getattr(self, name)
            if not value > 0:
                raise ConfigError(f"--{name} {value}: must be greater than 0")
        if self.beta < 0:
            raise ConfigError(f"--beta {self.beta}: must be 0 or more")
        if self.ref_model is not None and not self.uses_reference:
            raise ConfigError(
                f"--ref_model {self.ref_model}: only with --method dpo or kto, or grpo with --beta above 0"
            )
        self._own_flags(t)
        if t.teacher and not self.teacher_model:
            raise ConfigError(
                f"--teacher_model: --method {self.method} needs the teacher (a Hub id or local folder, as --model)"
            )
        if t.teacher and not 0 <= self.beta <= 1:
            raise ConfigError(f"--beta {self.beta}: must be in [0, 1] (0 forward KL, 1 reverse KL)")
        if not t.generates:
            return
        if t.group and self.num_generations < 2:
            raise ConfigError(
                f"--num_generations {self.num_generations}: must be 2 or more (an advantage compares a "
                "completion with the rest of its group)"
            )
        if self.max_completion_length < 1:
            raise ConfigError(f"--max_completion_length {self.max_completion_length}: must be 1 or more")
        if not self.temperature > 0:
            raise ConfigError(f"--temperature {self.temperature}: must be greater than 0")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"--top_p {self.top_p}: must be in (0, 1]")
        if self.top_k < 0:
            raise ConfigError(f"--top_k {self.top_k}: must be 0 (off) or more")
        if not 0 <= self.epsilon < 1 or (self.epsilon_high is not None and self.epsilon_high < 0):
            raise ConfigError(f"--epsilon {self.epsilon}: must be in [0, 1) (and --epsilon_high 0 or more)")
        if self.num_iterations < 1:
            raise ConfigError(f"--num_iterations {self.num_iterations}: must be 1 or more")
        if self.steps_per_generation is not None and self.steps_per_generation < 1:
            raise ConfigError(f"--steps_per_generation {self.steps_per_generation}: must be 1 or more")
        if self.delta is not None and not self.delta > 1 + self.clip_high:
            raise ConfigError(
                f"--delta {self.delta}: must be above 1 + --epsilon_high ({1 + self.clip_high:g}): it "
                "bounds the ratio from above where the clip does not"
            )
        if t.group and not self.reward:
            raise ConfigError(
                "--reward: --method grpo needs at least one reward function (a built-in: "
                f"{', '.join(BUILTIN_REWARDS)}; or path/to/file.py:function)"
            )

    def _own_flags(self, t: MethodSpec) -> None:
        """A method's own flag given to a method without it: one line naming the methods that have it (--beta,
        --ref_model and --loss_type have their own rules above)."""
        mine = {f for f, _ in t.flags}
        for f in dataclasses.fields(self):
            if f.name in mine or f.name in ("method", "beta", "ref_model", "loss_type") or f.name not in method_flags():
                continue
            if getattr(self, f.name) != f.default:
                owners = [m for m, s in METHOD_SPECS.items() if any(f.name == g for g, _ in s.flags)]
                raise ConfigError(f"--{f.name}: only with --method {' or '.join(owners)}")

    @property
    def spec(self) -> MethodSpec:
        return spec(self.method)

    @property
    def completions_per_prompt(self) -> int:
        """A step's completions of one prompt: a group of --num_generations, or one."""
        return self.num_generations if self.spec.group else 1

    @property
    def uses_reference(self) -> bool:
        """Whether the run scores against a reference model (DPO always; GRPO with a KL term)."""
        r = self.spec.reference
        return r == "always" or (r == "beta" and bool(self.beta and self.beta > 0))

    @property
    def reward_names(self) -> list[str]:
        return [n for n in (self.reward or "").split(",") if n]

    @property
    def clip_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high
