"""Flags of what trains: the model, the data slice, the optimization (config/layout.py: the parallel layout, LoRA).

Each field's `help` metadata is its flag's help text; the flag is `--<field name>`. `__post_init__` raises a
`ConfigError` naming the flag, before anything is built or written."""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_opt.base import ConfigError
from fsdp_opt.config.choices import (
    AUTO,
    BUILTIN_DATASETS,
    DATA_FORMATS,
    LR_SCHEDULES,
    PACKING_MODES,
    TRAIN_ON,
)
from fsdp_opt.config.flags import flag, parse_batch, parse_start


@dataclass
class ModelConfig:
    model: str = flag(
        "facebook/opt-1.3b",
        "Hugging Face hub id, local model folder, the built-in 'tiny-opt', or 'random:<id>': a shape the planner knows "
        "(random:facebook/opt-1.3b, say) with random weights, built here without a download (for checks).",
    )
    attn_implementation: str = flag(
        "auto",
        "Attention kernel: 'sdpa' (PyTorch scaled-dot-product) or 'eager'; auto: SDPA where the model has it, else "
        "eager (Gemma 2), with one line saying so.",
        choices=("auto", "sdpa", "eager"),
    )


@dataclass
class DataConfig:
    dataset: str = flag(
        "ash001/arxiv-abstract",
        "Hub dataset id, a local .jsonl/.json/.csv/.parquet/.txt file or folder, or a built-in: "
        f"{', '.join(repr(d) for d in BUILTIN_DATASETS)} (text, conversations, preference pairs, prompts). Or a "
        "mixture file (.yaml or .json, TRL's DatasetMixtureConfig layout with a weight on each source, and a source's own "
        "data_format and eval_split): row i of the mixture is defined exactly, and a range reads a range of each source "
        "(docs/data.md).",
    )
    dataset_config: str | None = flag(
        None,
        "The dataset's config (subset), as the Hub names it: e.g. sample-10BT of HuggingFaceFW/fineweb-edu, main of "
        "openai/gsm8k. Needed when a dataset has several and no default; an error lists them.",
    )
    dataset_split: str = flag(
        "train",
        "The split to train on, e.g. train_sft of HuggingFaceH4/ultrachat_200k; an error lists the splits there are.",
    )
    dataset_files: str | None = flag(
        None,
        "Data files of the repo or folder to read as --dataset_split, as a glob (e.g. 'data/en/*.parquet'), instead "
        "of the ones its card or its layout names.",
    )
    dataset_revision: str | None = flag(
        None,
        "A Hub dataset's revision (branch, tag or commit) to read. Default: the revision the chain's checkpoint "
        "recorded when resuming (so a dataset that gains a revision does not move under the chain), else main.",
    )
    text_column: str = flag("text", "Column holding the training text (--data_format text).")
    data_format: str = flag(
        "auto",
        "What a row is. text: one string; prompt_completion: a prompt and a completion, each a string or a list of "
        "messages (conversational); messages: a list of {role, content} (system, user, assistant); preference: a "
        "prompt, a chosen and a rejected answer (strings, or lists of messages; without a prompt column, two "
        "conversations whose shared first turns are the prompt), for --method dpo (and kto, unpaired); unpaired: a "
        "prompt, a completion and a label column of true/false (is the completion desirable?), for --method kto. "
        "auto: from the columns (an error names this flag when more than one format fits).",
        choices=DATA_FORMATS,
    )
    prompt_column: str = flag(
        "prompt", "Column holding the prompt (--data_format prompt_completion, prompt, preference)."
    )
    completion_column: str = flag("completion", "Column holding the completion (--data_format prompt_completion).")
    messages_column: str = flag("messages", "Column holding the conversation (--data_format messages).")
    chosen_column: str = flag("chosen", "Column holding the chosen answer (--data_format preference).")
    rejected_column: str = flag("rejected", "Column holding the rejected answer (--data_format preference).")
    train_on: str = flag(
        "auto",
        "Which tokens carry loss. completion: only the answers (a prompt_completion row's completion, each "
        "assistant turn of a conversation with its end-of-turn marker); all: every token. auto: completion for "
        "prompt_completion and messages rows, all for text rows.",
        choices=TRAIN_ON,
    )
    chat_template: str | None = flag(
        None,
        "The chat template that renders conversations: a Jinja file, or a built-in name (chatml). Default: the "
        "tokenizer's own. The exported model and the Hub export carry the template the run used.",
    )
    start_idx: int | str = flag(
        0,
        "First row of the slice to train on (inclusive), or 'auto': the chain picks its own range from the newest "
        "checkpoint in --output_dir and --hf_repo (with --range_size; --resume_file latest is implied).",
        type=parse_start,
    )
    end_idx: int | None = flag(None, "End of the slice (exclusive). Default: the end of the dataset.")
    range_size: int | None = flag(
        None,
        "With --start_idx auto: rows per range. No checkpoint: [0, N); after a finished range [s, e): [e, e+N), cut "
        "at the end of the data; after an interrupted one: the rest of it. --num_epochs is then the passes over "
        "the whole dataset.",
    )
    session_ranges: int = flag(
        1,
        "With --start_idx auto: the most ranges one session trains (0: no limit). A further range starts only "
        "when --time_limit leaves room for all of it at the measured step time; the names and pushes are those "
        "of separate sessions.",
    )
    max_length: int = flag(512, "Tokens per training sequence.")
    eval_rows: int = flag(
        0,
        "Held-out rows: eval loss and perplexity at every save (0: no evaluation). The N rows right after the slice, "
        "[end_idx, end_idx + N), or the first N rows of --eval_split.",
    )
    eval_split: str | None = flag(
        None,
        "Take the --eval_rows held-out rows from this split (e.g. test_sft; the built-ins have test), the same rows "
        "for every range, instead of the rows after the slice.",
    )
    packing: str = flag(
        "docs",
        "How rows fill the blocks of max_length tokens. docs: whole rows share a block, each attending only to "
        "itself with positions from 0 (the same losses as padding, in far fewer blocks); concat: rows joined end to "
        "end and cut every max_length tokens, attending across row ends; pad: one row per block, truncated and "
        "padded (the original recipe).",
        choices=PACKING_MODES,
    )
    pad_to_max_length: bool = flag(False, "Same as --packing pad (the original recipe's padding).")

    def __post_init__(self) -> None:
        if self.range_size is not None and self.range_size < 1:
            raise ConfigError(f"--range_size {self.range_size}: must be 1 or more")
        if self.session_ranges < 0:
            raise ConfigError(f"--session_ranges {self.session_ranges}: must be 1 or more (0: no limit)")
        if self.start_idx == AUTO:
            if self.end_idx is not None:
                raise ConfigError(f"--end_idx {self.end_idx}: not with --start_idx auto (--range_size sets the range)")
            if self.range_size is None:
                raise ConfigError("--start_idx auto: needs --range_size N (rows per range)")
        elif self.start_idx < 0:
            raise ConfigError(f"--start_idx {self.start_idx}: must be 0 or more")
        if self.end_idx is not None and self.end_idx <= self.start_idx:
            raise ConfigError(f"--end_idx {self.end_idx}: must be greater than --start_idx {self.start_idx}")
        if self.max_length < 2:
            raise ConfigError(f"--max_length {self.max_length}: must be at least 2")
        if self.eval_rows < 0:
            raise ConfigError(f"--eval_rows {self.eval_rows}: must be 0 or more")
        if self.eval_split is not None:
            if not self.eval_rows:
                raise ConfigError(f"--eval_split {self.eval_split}: needs --eval_rows N (how many of its rows)")
            if self.eval_split == self.dataset_split:
                raise ConfigError(
                    f"--eval_split {self.eval_split}: the split trained on (--dataset_split); held-out "
                    "rows must come from another"
                )
            if self.dataset_files:
                raise ConfigError(
                    f"--eval_split {self.eval_split}: not with --dataset_files (the files are the training split's)"
                )
        for name in ("dataset_split", "dataset_config", "dataset_files", "eval_split"):
            if getattr(self, name) is not None and not getattr(self, name).strip():
                raise ConfigError(f"--{name}: must not be empty")
        for name in (
            "text_column",
            "prompt_column",
            "completion_column",
            "messages_column",
            "chosen_column",
            "rejected_column",
        ):
            if not getattr(self, name):
                raise ConfigError(f"--{name}: must not be empty")
        if self.data_format == "text" and self.train_on == "completion":
            raise ConfigError(
                "--train_on completion: text rows have no completion (use --data_format prompt_completion "
                "or messages, or --train_on all)"
            )
        if self.pad_to_max_length:
            if self.packing == "concat":
                raise ConfigError("--pad_to_max_length: contradicts --packing concat (it means --packing pad)")
            self.packing = "pad"
        self.pad_to_max_length = self.packing == "pad"


@dataclass
class TrainConfig:
    num_epochs: int = flag(
        1,
        "Epochs this invocation runs over the slice, counting one that a resume finishes. With --start_idx auto: "
        "passes of the chain over the whole dataset.",
    )
    initial_epoch: int = flag(0, "Epoch number to start counting from when not resuming.")
    batch_size: int | str = flag(
        4,
        "Micro-batch size per rank (sequences per forward pass), or 'auto': the fastest configuration the plan "
        "finds that fits this GPU at the same sequences per step (--global_batch, else what --accum_steps and the "
        "ranks imply at a micro-batch of 4): it chooses the micro-batch, --accum_steps, --loss_chunk_tokens, "
        "--activation_checkpointing, --cpu_offload where nothing else fits, the reduce mode (when auto), the "
        "strategy (with --sharding_strategy AUTO) and the reduce dtype (with --reduce_dtype auto).",
        type=parse_batch,
    )
    accum_steps: int = flag(1, "Micro-batches per optimizer step. Global batch = batch_size x ranks x accum_steps.")
    global_batch: int | None = flag(
        None,
        "Sequences per optimizer step (all ranks), instead of --accum_steps: accum_steps = N / (batch_size x ranks), "
        "which must divide exactly. Keeps the global batch when the rank count changes between sessions. "
        "(--total_batch_size is the same flag.)",
        aliases=("--total_batch_size",),
    )
    lr: float = flag(5e-6, "Peak learning rate (AdamW).")
    warmup_steps: int = flag(0, "Linear warm-up steps, counted in global optimizer steps.")
    lr_schedule: str = flag(
        "constant",
        "After warm-up: 'constant', or 'linear'/'cosine' decay to min_lr_ratio*lr over lr_decay_steps.",
        choices=LR_SCHEDULES,
    )
    lr_decay_steps: int = flag(0, "Global steps (after warm-up) over which linear/cosine decay runs.")
    min_lr_ratio: float = flag(0.0, "Final learning rate of a decay schedule, as a fraction of lr.")
    weight_decay: float = flag(0.0, "AdamW weight decay, applied to matrices and embeddings only.")
    max_grad_norm: float = flag(1.0, "Clip the global gradient norm to this value; 0 disables clipping.")
    seed: int = flag(42, "Seed for model init, data order and dropout.")
    init_loss_scale: float = flag(
        2.0**16, "Starting loss scale for fp16 (halved on overflow, doubled after 2000 good steps)."
    )
    loss_chunk_tokens: int = flag(
        0,
        "Compute the output projection and loss N target tokens at a time, recomputed in backward, so the "
        "micro-batch's logits never exist at once (opt-1.3b at 4 x 512 in chunks of 256: 0.19 GiB instead of 1.15; "
        "see the plan). 0: the "
        "logits of all target tokens at once. Either way the output layer runs only where a token has a target "
        "(not on prompts or padding) for a model whose logits are a plain projection.",
    )

    def __post_init__(self) -> None:
        if self.loss_chunk_tokens < 0:
            raise ConfigError(f"--loss_chunk_tokens {self.loss_chunk_tokens}: must be 0 (off) or more")
        for name in ("num_epochs", "accum_steps") + (() if self.batch_size == AUTO else ("batch_size",)):
            value = getattr(self, name)
            if value < 1:
                raise ConfigError(f"--{name} {value}: must be 1 or more")
        if self.global_batch is not None:
            if self.global_batch < 1:
                raise ConfigError(f"--global_batch {self.global_batch}: must be 1 or more")
            if self.accum_steps != 1:
                raise ConfigError(
                    f"--global_batch and --accum_steps {self.accum_steps}: give one of them (accum_steps is derived)"
                )
        if self.batch_size == AUTO and self.loss_chunk_tokens:
            raise ConfigError(
                f"--loss_chunk_tokens {self.loss_chunk_tokens}: not with --batch_size auto (it chooses "
                "the loss chunking; give --batch_size N to set it yourself)"
            )
        if self.initial_epoch < 0:
            raise ConfigError(f"--initial_epoch {self.initial_epoch}: must be 0 or more")
        if not self.lr > 0:
            raise ConfigError(f"--lr {self.lr}: must be greater than 0")
        if self.warmup_steps < 0:
            raise ConfigError(f"--warmup_steps {self.warmup_steps}: must be 0 or more")
        if self.lr_schedule != "constant" and self.lr_decay_steps < 1:
            raise ConfigError(f"--lr_schedule {self.lr_schedule}: needs --lr_decay_steps of 1 or more")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"--min_lr_ratio {self.min_lr_ratio}: must be between 0 and 1")
        if self.weight_decay < 0:
            raise ConfigError(f"--weight_decay {self.weight_decay}: must be 0 or more")
        if not self.init_loss_scale >= 1:
            raise ConfigError(f"--init_loss_scale {self.init_loss_scale}: must be 1 or more")
        if self.max_grad_norm < 0:
            raise ConfigError(f"--max_grad_norm {self.max_grad_norm}: must be 0 (off) or more")

    def samples_per_step(self, world_size: int) -> int:
        """Sequences per optimizer step, all ranks: --global_batch, or what the other flags imply (a micro-batch of 4
        where --batch_size is auto)."""
        if self.global_batch is not None:
            return self.global_batch
        return (4 if self.batch_size == AUTO else self.batch_size) * self.accum_steps * world_size

    def accum_for(self, world_size: int) -> int:
        """--accum_steps, or the one --global_batch implies for this many ranks."""
        if self.global_batch is None:
            return self.accum_steps
        per_step = self.batch_size * world_size
        if self.global_batch % per_step:
            low = self.global_batch // per_step * per_step
            options = " or ".join(str(x) for x in (low, low + per_step) if x > 0)
            raise ConfigError(
                f"--global_batch {self.global_batch}: not a multiple of --batch_size {self.batch_size} x "
                f"{world_size} rank(s) = {per_step}; use {options}, or another --batch_size"
            )
        return self.global_batch // per_step
