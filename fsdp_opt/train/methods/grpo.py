"""--method grpo: completions sampled from the policy for prompt rows, scored by reward functions, each pushed up or
down against its group (engine/grpo.py has the step; engine/generation.py the sampling; engine/rewards.py the
reward functions)."""

from __future__ import annotations

import json
import time
from typing import Any

import torch

from fsdp_opt.base import ConfigError
from fsdp_opt.checkpoint.drift import line as drift_line
from fsdp_opt.config.parse import Config
from fsdp_opt.data.formats import Rows, RowSpec
from fsdp_opt.data.prompts import PromptPlan, generation_slices, prompts_from_rows
from fsdp_opt.data.tokens import end_rules
from fsdp_opt.engine.generation import Sampling
from fsdp_opt.engine.groups import GroupSettings
from fsdp_opt.engine.grpo import GroupLoss
from fsdp_opt.engine.rewards import load_all
from fsdp_opt.engine.rollout import Generation, held_out_rewards
from fsdp_opt.planner.layout import gathered_generation_fits, with_generation_phase
from fsdp_opt.runtime.distributed import DistEnv, all_ranks_ok, broadcast_object, print0, scatter_object
from fsdp_opt.tracking.metrics import COMPLETIONS_FILE
from fsdp_opt.train import reference
from fsdp_opt.train.methods.base import Method, words
from fsdp_opt.train.session import Session


class Grpo(Method):
    shown = ("reward",)
    state_key = "grpo"
    dropout_off_why = "completions are sampled and scored on the same forward the loss takes"

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.rewards, self.weights = [], []
        self.ref_name: str | None = None
        self.ref_model: torch.nn.Module | None = None
        self.settings: GroupSettings | None = None
        self.tokenizer = None
        self.written = 0  # completions.jsonl lines this session
        self.restored: Generation | None = None  # a checkpoint's generation, this rank's part (saved between its steps)
        self.loss: GroupLoss | None = None
        self.env: DistEnv | None = None

    # ------------------------------------------------------------ rows -> sequences

    def check(self) -> None:
        """The reward functions can be had (every rank): before anything is taken or built."""
        self.rewards, self.weights = all_ranks_ok(
            lambda: load_all(self.config.method.reward_names, self.config.method.reward_weights)
        )

    def check_rows(self, spec: RowSpec) -> None:
        if spec.format not in self.spec.rows:
            raise ConfigError(
                f"--method {self.name}: the rows are {words(spec)}, not prompts; name the prompt's "
                "column with --prompt_column (--data_format prompt)"
            )

    def sequences(
        self,
        rows: Rows,
        spec: RowSpec,
        tokenizer,
        *,
        train_on: str,
        max_length: int,
        packing: str,
        attention: str,
        pattern,
    ):  # noqa: ANN001, ANN201
        return prompts_from_rows(
            rows,
            tokenizer,
            max_length=max_length,
            max_completion_length=self.config.method.max_completion_length,
            packing=packing,
            attention=attention,
            pattern=pattern,
        )

    def eval_packing(self, packing: str) -> str:
        return packing

    def plan(self, config: Config, env: DistEnv, sequences, batch_size: int, accum_steps: int) -> PromptPlan:  # noqa: ANN001
        m = config.method
        return PromptPlan(
            sequences,
            batch_size=batch_size,
            accum_steps=accum_steps,
            rank=env.rank,
            world_size=env.world_size,
            seed=config.train.seed,
            generations=m.completions_per_prompt,
            slices=generation_slices(m.steps_per_generation, accum_steps),
            iterations=m.num_iterations,
        )

    def describe(self, sequences, packing_words: str, max_length: int) -> str:  # noqa: ANN001
        m = self.config.method
        return (
            f"{len(sequences)} prompts, {m.num_generations} completions each of up to {m.max_completion_length} "
            f"tokens ({packing_words} of {max_length} tokens)"
        )

    # ------------------------------------------------------------ setup

    def before_model(
        self, data, env: DistEnv, payload: dict[str, Any] | None, precision: str, tokenizer, layout
    ) -> None:  # noqa: ANN001
        if not self.rewards:
            self.check()
        saved = (payload or {}).get(self.state_key) or {} if env.is_main else {}
        all_ranks_ok(lambda: self._reward_drift(saved.get("rewards") or []) if env.is_main else None)
        self.restored = self._restore_generation(saved.get("generation"), env)
        # the reference the chain recorded (its first session's --model), unless --ref_model names one
        self.ref_name = broadcast_object(reference.reference_name(self.config, saved) if env.is_main else None)

    def _restore_generation(self, saved: dict[str, Any] | None, env: DistEnv) -> Generation | None:
        """The generation a checkpoint was saved inside (rank 0 holds it): each rank's own part, on the number of
        ranks that made it; on another number it is sampled again (one line, engine/grpo.py)."""
        parts = saved["ranks"] if saved and len(saved["ranks"]) == env.world_size else None
        mine = scatter_object(parts if env.is_main else None)
        return Generation.from_state(mine) if mine is not None else None

    def _reward_drift(self, saved: list[dict[str, str]]) -> None:
        """Rank 0, resuming: a reward function whose source changed since the checkpoint is drift (its rule changed
        the objective): one line, refused unless --allow_changes."""
        before = {r["name"]: r["source"] for r in saved}
        changed = [r.name for r in self.rewards if r.name in before and not r.same_rule(before[r.name])]
        for name in changed:
            print0(
                drift_line(
                    {
                        "flag": "reward",
                        "from": f"{name} (source {before[name]})",
                        "to": f"{name} (source {self.source_of(name)})",
                        "breaks": "another loss trains",
                    }
                )
            )
        if changed and not self.config.checkpoint.allow_changes:
            raise ConfigError(
                f"--reward {changed[0]}: its source changed since the checkpoint (the chain's objective "
                "would change mid-run); restore it, or pass --allow_changes to go on with the new rule"
            )

    def source_of(self, name: str) -> str:
        return next(r.source for r in self.rewards if r.name == name)

    def _generation_setup(self, s: Session) -> tuple[list[int], str | None, bool]:
        """Where a completion ends (its end ids, the template's end-of-turn text), and whether generation runs on the
        model gathered once (else on its shards: one line says so)."""
        self.tokenizer = s.tokenizer
        eos, stop = end_rules(s.tokenizer, s.model_config, s.blocks.conversational)
        gather = all_ranks_ok(
            lambda: gathered_generation_fits(self.config, s.env, s.model_config, s.precision, s.plan.global_batch)
        )
        if not gather:
            print0(
                f"{self.name}: the model gathered whole and its KV cache do not fit beside training: completions are "
                "generated on the shards, each block gathered in every decoding step (slower)"
            )
        return eos, stop, gather

    def after_model(self, s: Session) -> None:
        m, env = self.config.method, s.env
        eos, stop, gather = self._generation_setup(s)
        self.settings = self._settings(
            eos, stop, self.config.train.seed, training=True, gather=gather, decoding=self._decoding(s, gather)
        )
        self.loss = s.loss = GroupLoss(
            self.settings,
            s.blocks,
            s.tokenizer,
            self._reference(s) if m.uses_reference else None,
            restored=self.restored,
        )
        self.restored, self.env = None, env
        s.layout = with_generation_phase(  # the step's prediction with its generation and reference forward added
            s.layout,
            self.config,
            env,
            s.model_config,
            s.precision,
            s.plan.global_batch,
            gather,
            graphs=self.settings.decoding == "graphs",
            slices=s.plan.slices,
        )

    def _settings(self, eos: list[int], stop: str | None, seed: int, *, training: bool, **decided) -> GroupSettings:  # noqa: ANN003
        """The flags as a GRPO step reads them; for scoring held-out prompts (not training): greedy, no reference,
        nothing masked."""
        m = self.config.method
        return GroupSettings(
            generations=m.num_generations,
            sampling=Sampling(m.max_completion_length, *((m.temperature, m.top_p, m.top_k) if training else ())),
            epsilon=m.epsilon,
            epsilon_high=m.clip_high,
            beta=m.beta if training else 0.0,
            loss_type=m.loss_type,
            scale_rewards=m.scale_rewards,
            mask_truncated=m.mask_truncated_completions and training,
            rewards=self.rewards,
            weights=self.weights,
            seed=seed,
            eos_ids=eos,
            stop=stop,
            delta=m.delta,
            level=m.importance_sampling_level,
            **decided,
        )

    def _decoding(self, s: Session, gather: bool) -> str:
        """--decoding as this run can have it: graphs need a CUDA device; generation on the shards runs
        transformers' generate (every rank in every decoding step)."""
        chosen = self.config.method.decoding
        if chosen == "graphs" and s.env.device.type != "cuda":
            print0(
                f"{self.name}: --decoding graphs: CUDA graphs need a CUDA device (this run is on "
                f"{s.env.device.type}): decoding with the static cache, unreplayed"
            )
            return "static"
        if chosen != "generate" and not gather and s.env.world_size > 1:
            return "generate"
        return chosen

    def _reference(self, s: Session):  # noqa: ANN202
        c = self.config
        strategy = c.parallel.sharding_strategy if c.parallel.sharding_strategy != "AUTO" else "FULL_SHARD"
        logps, self.ref_model = reference.policy_reference(s, self.ref_name, c.method.temperature, strategy)
        return logps

    # ------------------------------------------------------------ the run

    def summary(self, s: Session) -> str:
        m = self.config.method
        ref = f"beta {m.beta:g}, reference: {self.ref_name}" if m.uses_reference else "beta 0 (no reference model)"
        where = "the model gathered once" if self.settings.gather else "the shards (layer by layer)"
        how = {
            "static": "a static KV cache",
            "graphs": "a static KV cache, each step replayed as a CUDA graph",
            "generate": "transformers' generate",
        }[self.settings.decoding]
        reuse = ""
        slices = s.plan.slices
        if m.num_iterations > 1 or slices > 1:
            reuse = (
                f"; each generation feeds {slices * m.num_iterations} steps ({slices} step(s) of prompts, trained "
                f"{m.num_iterations} time(s); ratio per {m.importance_sampling_level})"
            )
        return (
            f"{self.name}, {m.num_generations} completions per prompt, loss {m.loss_type}, {ref}, rewards: "
            f"{', '.join(r.label for r in self.rewards)}; generation on {where}, decoded with {how}{reuse}"
        )

    def state(self) -> dict[str, Any] | None:
        """The rewards' pins and the reference; saved between the steps of a generation, the generation itself
        (every rank's part: every rank calls this, as every rank saves)."""
        out: dict[str, Any] = {"rewards": [r.pin() for r in self.rewards], "ref_model": self.ref_name}
        if self.loss is not None and self.loss.pending:
            mine = self.loss.generation.state()
            parts = [mine]
            if self.env.world_size > 1:
                parts = [None] * self.env.world_size
                torch.distributed.all_gather_object(parts, mine)
            out["generation"] = {"ranks": parts}
        return out

    def after_step(self, s: Session, record: dict[str, Any]) -> None:
        """completions.jsonl: every completion the step trains for the first time, gathered to rank 0."""
        if s.loss.slot is None or s.loss.slot.iteration > 0:
            return
        mine = s.loss.current.records if s.loss.current else []
        everyone = [mine]
        if s.env.world_size > 1:
            everyone = [None] * s.env.world_size
            torch.distributed.all_gather_object(everyone, mine)
        if s.env.is_main:
            with (s.out_dir / COMPLETIONS_FILE).open("a") as f:
                for part in everyone:
                    for r in part:
                        f.write(json.dumps(r, ensure_ascii=False) + "\n")
            self.written += sum(len(p) for p in everyone)

    def at_save(self, s: Session) -> None:
        """W&B: a table of the last step's completions (the first 16)."""
        if s.env.is_main and s.loss.current is not None:
            s.wandb.log_table("completions", s.state.global_step, s.loss.current.records[:16])

    @property
    def eval_logged(self) -> tuple[str, ...]:  # type: ignore[override]
        return ("reward", *(f"reward_{r.label}" for r in self.rewards))

    def evaluate(self, s: Session) -> dict[str, Any]:
        """One greedy completion of each held-out prompt: the mean reward, in total and per function."""
        started = time.perf_counter()
        result = held_out_rewards(s.model, s.eval_blocks, s.tokenizer, self.settings, s.env, decoder=s.loss.decoder)
        result.pop("samples")
        result["seconds"] = round(time.perf_counter() - started, 3)
        per = ", ".join(f"{r.label} {result[f'reward_{r.label}']:.3f}" for r in self.rewards)
        print0(
            f"eval at step {s.state.global_step}: mean reward {result['reward']:.4f} ({per}) of a greedy completion "
            f"of each of rows {s.eval_label} ({result['prompts']} prompts, {result['seconds']:.1f} s)"
        )
        return result

    def switch_range(self, s: Session, data) -> None:  # noqa: ANN001
        s.loss.prompts = data.blocks

    # ------------------------------------------------------------ python -m fsdp_opt.evaluate

    def before_scoring(
        self,
        held,
        env: DistEnv,
        precision: str,
        tokenizer,
        batch_size: int,
        model_name: str,
        reference_name: str | None,
        strategy: str,
        seed: int,
        model_config=None,
    ) -> str | None:  # noqa: ANN001
        if not self.rewards:
            self.check()
        self.tokenizer = tokenizer
        eos, stop = end_rules(tokenizer, model_config, held.conversational)  # as training ends a completion
        self.settings = self._settings(eos, stop, seed, training=False, gather=True)
        return None

    def score(self, model, held, batch_size: int, env: DistEnv) -> dict[str, Any]:  # noqa: ANN001
        """The held-out reward, and (under `samples`) the completions it scored, every rank's, in row order: the
        report shows those, not completions of another length."""
        result = held_out_rewards(model, held, self.tokenizer, self.settings, env)
        everyone = [result["samples"]]
        if env.world_size > 1:
            everyone = [None] * env.world_size
            torch.distributed.all_gather_object(everyone, result["samples"])
        result["samples"] = sorted((x for part in everyone for x in part), key=lambda x: x["row"])
        return result

    def scored_what(self, sequences, packing: str, max_length: int, train_on: str) -> str:  # noqa: ANN001
        m = self.config.method
        return (
            f"{len(sequences)} prompts, one greedy completion each of up to {m.max_completion_length} tokens, scored "
            f"by {', '.join(r.label for r in self.rewards)}"
        )

    def score_line(self, result: dict[str, Any]) -> str:
        per = ", ".join(f"{k[len('reward_') :]} {v:.3f}" for k, v in result.items() if k.startswith("reward_"))
        return f"mean reward {result['reward']:.4f} ({per}) over {result['prompts']} prompts"

    @staticmethod
    def table(results: dict[str, Any]) -> list[str]:
        names = [k for k in results["models"][0] if k.startswith("reward_")]
        lines = [
            f"Held-out prompts {results['rows']} of `{results['dataset']}` ({results['models'][0]['prompts']:,} "
            "prompts), one greedy completion each:",
            "",
            "| model | mean reward | " + " | ".join(n[len("reward_") :] for n in names) + " |",
            "| --- | --- |" + " --- |" * len(names),
        ]
        return lines + [
            f"| {r['name']} | {r['reward']:.4f} | " + " | ".join(f"{r[n]:.4f}" for n in names) + " |"
            for r in results["models"]
        ]
