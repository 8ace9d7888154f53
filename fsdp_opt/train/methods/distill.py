"""--method distill: on-policy distillation. Each step samples a completion of each prompt from the model (GRPO's
prompts, plan, sampling and completions.jsonl: this class is GRPO's method with the rewards, the groups and the
reference taken out and a teacher put in), and pulls the model's next-token distributions on those completions toward
the teacher's (engine/distill.py has the loss)."""

from __future__ import annotations

from typing import Any

from fsdp_opt.base import ConfigError
from fsdp_opt.engine.distill import DistillLoss, DistillSettings, held_out_divergence
from fsdp_opt.engine.generation import Sampling
from fsdp_opt.planner.layout import with_generation_phase
from fsdp_opt.runtime.distributed import DistEnv, all_ranks_ok, print0
from fsdp_opt.runtime.torchao_gate import check_for_nf4
from fsdp_opt.train import reference
from fsdp_opt.train.methods.grpo import Grpo
from fsdp_opt.train.session import Session


class Distill(Grpo):
    shown = ("entropy",)
    state_key = "distill"

    def __init__(self, config) -> None:  # noqa: ANN001
        super().__init__(config)
        self.teacher = None
        self.distill: DistillSettings | None = None

    def check(self) -> None:
        """A 4-bit teacher's torchao, before anything is taken or built (the teacher is loaded once the model is)."""
        if self.config.method.teacher_bits == 4:
            all_ranks_ok(lambda: check_for_nf4("--teacher_bits 4"))

    def describe(self, sequences, packing_words: str, max_length: int) -> str:  # noqa: ANN001
        m = self.config.method
        return (
            f"{len(sequences)} prompts, one completion each of up to {m.max_completion_length} tokens "
            f"({packing_words} of {max_length} tokens)"
        )

    def before_model(
        self, data, env: DistEnv, payload: dict[str, Any] | None, precision: str, tokenizer, layout
    ) -> None:  # noqa: ANN001
        """Nothing: a step's completions are its own (no checkpoint falls inside them), and --teacher_model is a flag
        the chain's drift check compares."""

    def after_model(self, s: Session) -> None:
        m, c, env = self.config.method, self.config, s.env
        eos, stop, gather = self._generation_setup(s)
        self.distill = DistillSettings(
            sampling=Sampling(m.max_completion_length, m.temperature, m.top_p, m.top_k),
            beta=m.beta,
            seed=c.train.seed,
            eos_ids=eos,
            stop=stop,
            gather=gather,
            decoding=self._decoding(s, gather),
        )
        self.teacher = reference.load_beside(
            s, m.teacher_model, "--teacher_model", vocabulary=s.model_config.vocab_size, bits=m.teacher_bits
        )
        nf4 = ", its blocks' linear weights in NF4" if m.teacher_bits == 4 else ""
        print0(
            f"{self.name}: teacher {m.teacher_model}: loaded sharded in {s.precision}{nf4}, frozen, kept beside the "
            "model"
        )
        self.loss = s.loss = DistillLoss(self.distill, s.blocks, s.tokenizer, self.teacher)
        self.env = env
        s.layout = with_generation_phase(  # the step's prediction with its generation and the teacher's forward
            s.layout,
            self.config,
            env,
            s.model_config,
            s.precision,
            s.plan.global_batch,
            gather,
            graphs=self.distill.decoding == "graphs",
            slices=s.plan.slices,
            beside_config=self.teacher.config,  # the teacher's forward at its own size
        )

    def summary(self, s: Session) -> str:
        m = self.config.method
        kind = {0.0: "forward KL", 1.0: "reverse KL"}.get(m.beta, f"generalized JSD, beta {m.beta:g}")
        where = "the model gathered once" if self.distill.gather else "the shards (layer by layer)"
        return (
            f"{self.name} from teacher {m.teacher_model}: {kind} per completion token at temperature "
            f"{m.temperature:g}; one completion per prompt, generated on {where}"
        )

    def state(self) -> dict[str, Any] | None:
        return {"teacher_model": self.config.method.teacher_model}

    @property
    def eval_logged(self) -> tuple[str, ...]:  # type: ignore[override]
        return ("divergence", "entropy")

    def evaluate(self, s: Session) -> dict[str, Any]:
        """One greedy completion of each held-out prompt: the mean divergence per completion token from the
        teacher."""
        models = s.loss.models(s.model, s.head_loss)
        result = held_out_divergence(
            models, s.eval_blocks, s.tokenizer, self.distill, s.env, s.plan.batch_size, s.loss.decoder
        )
        print0(
            f"eval at step {s.state.global_step}: divergence from the teacher {result['divergence']:.4f} per token "
            f"of a greedy completion of each of rows {s.eval_label} ({result['prompts']} prompts, "
            f"{result['tokens']:,} tokens)"
        )
        return result

    def before_scoring(self, *args, **kwargs) -> str | None:  # noqa: ANN002, ANN003
        raise ConfigError(
            "--method distill: python -m fsdp_opt.evaluate does not load a teacher; training reports the held-out "
            "divergence from it at each save (--eval_rows)"
        )
