"""--method distill: on-policy distillation from a teacher model on prompt rows (TRL 1.16's DistillationTrainer)."""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_opt.base import ConfigError
from fsdp_opt.config.methods.base import (
    GENERATION,
    GENERATOR,
    ON_PROMPTS,
    SAMPLED_FIELDS,
    TEACHER,
    MethodSpec,
    SamplingFlags,
    method_flag,
)


@dataclass
class DistillFlags(SamplingFlags):
    beta: float = method_flag(
        1.0,
        "Which divergence from the teacher, in [0, 1]: 0 the forward KL (teacher to model), 1 the reverse KL (model to "
        "teacher; the default, as TRL), between them the generalized JSD of the mixture (1 - beta) p_model + beta "
        "p_teacher.",
    )
    teacher_model: str | None = method_flag(
        None,
        "The teacher (a Hub id or local folder, as --model), loaded sharded like the model, frozen, in the compute "
        "dtype, and kept beside it; its tokenizer and vocabulary must be the model's.",
    )
    teacher_bits: int = method_flag(
        16,
        "The teacher's weights in the compute dtype (16), or its blocks' linear weights as NF4 (4: 4 bits each, "
        "torchao, as --base_bits 4 stores a LoRA base), for a teacher that would not fit beside the model otherwise.",
        choices=(16, 4),
    )

    def check(self) -> None:
        super().check()
        if not self.teacher_model:
            raise ConfigError(
                "--teacher_model: --method distill needs the teacher (a Hub id or local folder, as --model)"
            )
        if not 0 <= self.beta <= 1:
            raise ConfigError(f"--beta {self.beta}: must be in [0, 1] (0 forward KL, 1 reverse KL)")

    def describe(self) -> str:
        kind = {0.0: "forward KL", 1.0: "reverse KL"}.get(self.beta, f"generalized JSD, beta {self.beta:g}")
        return f"from teacher {self.teacher_model}: {kind} per completion token at temperature {self.temperature:g}"


DISTILL_FIELDS = (*SAMPLED_FIELDS, "entropy")  # entropy: the model's mean per completion token (nats, at --temperature)

DISTILL = MethodSpec(
    name="distill",
    flags=DistillFlags,
    **ON_PROMPTS,
    what="prompt rows (a prompt column; the model completes each, the teacher scores every token)",
    summary="distill: on-policy distillation on prompt rows: a completion of each prompt sampled from the model, then "
    "each of its tokens' next-token distribution pulled toward --teacher_model's by the generalized Jensen-Shannon "
    "divergence of --beta (TRL's DistillationTrainer).",
    needs=(GENERATOR, TEACHER),
    fields=DISTILL_FIELDS,
    phases=(GENERATION, TEACHER),
    unit="completion token",
    shown=("entropy",),
    no_dropout="completions are sampled on the same forward the loss takes",
)
