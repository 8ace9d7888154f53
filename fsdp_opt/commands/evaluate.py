r"""Held-out evaluation: token-mean loss and perplexity, and generated text, on any number of ranks.

Used by training (`--eval_rows`) and on its own, to put the base model next to checkpoints:

    python -m fsdp_opt.evaluate --checkpoints latest            # in the training run's folder
    torchrun --standalone --nproc_per_node=gpu -m fsdp_opt.evaluate --model facebook/opt-1.3b \
        --checkpoints opt_1.3B_0-5000-epoch-1.pt opt_1.3B_5000-10000-epoch-1.pt --hf_repo user/repo --json eval.json

Under torchrun the models are sharded with FSDP, so one that does not fit a single GPU is still evaluated.
Each rank takes every world_size-th block; ranks with fewer blocks run filler rows (no targets), so every rank
makes the same forward calls, which a sharded model needs. Sums of loss and target tokens are all-reduced.
"""

from __future__ import annotations

import argparse

from fsdp_opt.base import ConfigError
from fsdp_opt.config.benchmarks import add_lm_eval_flags, check_lm_eval_flags
from fsdp_opt.config.choices import DATA_FORMATS, STRATEGIES, TRAIN_ON
from fsdp_opt.config.flags import OneLineParser
from fsdp_opt.config.method import method_field
from fsdp_opt.config.parse import add_flag
from fsdp_opt.engine.decoding import PATHS
from fsdp_opt.runtime.distributed import init_distributed, teardown
from fsdp_opt.runtime.exits import end_process, fail
from fsdp_opt.runtime.hostmem import configure_allocator
from fsdp_opt.train.compare import DEFAULT_EVAL_ROWS, compare
from fsdp_opt.train.scores import benchmark

# ---------------------------------------------------------------- python -m fsdp_opt.evaluate


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m fsdp_opt.evaluate", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="base model (default: the one the first checkpoint was trained from)")
    p.add_argument(
        "--checkpoints",
        nargs="*",
        default=["latest"],
        help="checkpoints or model folders to compare with the base: paths, names in --output_dir or the "
        "--hf_repo repo, `latest`, or Hugging Face model folders (default: latest)",
    )
    p.add_argument("--no_base", action="store_true", help="leave the base model out")
    p.add_argument("--dataset", default=None, help="default: the first checkpoint's dataset")
    p.add_argument("--dataset_config", default=None, help="the dataset's config (default: the first checkpoint's)")
    p.add_argument("--dataset_split", default=None, help="the split trained on (default: the first checkpoint's)")
    p.add_argument("--dataset_files", default=None, help="data files of the split (default: the first checkpoint's)")
    p.add_argument(
        "--eval_split",
        default=None,
        help="take the held-out rows from this split's first --eval_rows (default: the first checkpoint's; "
        "without one, the rows after its range, or when none are left, a test or validation split)",
    )
    # the trainer's method flags, of its types and choices (config/method.py); each defaults to the first checkpoint's
    for name, help_text in (
        (
            "method",
            "dpo: score preference pairs (DPO loss, rewards, accuracy) against the reference; kto: score labelled "
            "completions (KTO loss, rewards, KL estimate) against the reference; grpo: the mean reward of a greedy "
            "completion of each held-out prompt; distill: not here (this command loads no teacher; training reports "
            "the held-out divergence at each save) (default: the first checkpoint's method)",
        ),
        ("beta", "--method dpo and kto: beta (default: the first checkpoint's)"),
        (
            "reward",
            "--method grpo: the reward functions that score each model's greedy completion of each held-out "
            "prompt, as the trainer's --reward (default: the first checkpoint's)",
        ),
        (
            "ref_model",
            "--method dpo and kto: the reference (default: the one the first checkpoint recorded; a LoRA run's "
            "adapters-off reference is its base)",
        ),
    ):
        add_flag(p, method_field(name), default=None, help=help_text)
    p.add_argument("--chosen_column", default=None)
    p.add_argument("--rejected_column", default=None)
    p.add_argument("--text_column", default=None, help="default: the first checkpoint's, like every data flag here")
    p.add_argument("--data_format", default=None, choices=DATA_FORMATS)
    p.add_argument("--prompt_column", default=None)
    p.add_argument("--completion_column", default=None)
    p.add_argument("--messages_column", default=None)
    p.add_argument("--train_on", default=None, choices=TRAIN_ON, help="which tokens the held-out loss counts")
    p.add_argument(
        "--chat_template",
        default=None,
        help="a Jinja file or a built-in name (chatml); default: the one the first checkpoint trained with, "
        "else the tokenizer's own",
    )
    p.add_argument(
        "--start_idx",
        type=int,
        default=None,
        help="first held-out row (default: the end of the first checkpoint's range)",
    )
    p.add_argument("--eval_rows", type=int, default=DEFAULT_EVAL_ROWS, help="held-out rows [start_idx, start_idx + N)")
    p.add_argument("--max_length", type=int, default=None, help="block length (default: the first checkpoint's)")
    p.add_argument(
        "--packing",
        default=None,
        choices=["docs", "concat", "pad"],
        help="how the rows fill the blocks (default: docs, or concat for a run trained that way); docs and "
        "pad give each row's loss on its own, so their results agree",
    )
    p.add_argument("--batch_size", type=int, default=4, help="blocks per forward pass per rank")
    p.add_argument(
        "--prompts",
        nargs="*",
        default=None,
        help="default: from the first held-out rows: a text row's first words; a row's prompt or its "
        "conversation up to the first answer, through the chat template",
    )
    p.add_argument("--num_prompts", type=int, default=3, help="held-out rows whose prompts the models answer (0: none)")
    p.add_argument(
        "--max_new_tokens",
        type=int,
        default=40,
        help="tokens of each sample answer shown (a GRPO run's --reward report shows the completions it "
        "scored instead, of the run's --max_completion_length)",
    )
    p.add_argument("--do_sample", action="store_true", help="sample (default: greedy)")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top_p", type=float, default=0.95)
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="initialisation of the built-in tiny-opt (or a random: model) base, and sampling (default: the "
        "first checkpoint's, else 42)",
    )
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "fp16", "bf16"])
    p.add_argument("--sharding_strategy", default="FULL_SHARD", choices=[s for s in STRATEGIES if s != "HYBRID_SHARD"])
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--output_dir", default="outputs", help="where checkpoint names are looked up")
    p.add_argument("--hf_repo", default=None, help="Hub repo searched for checkpoints not found locally")
    p.add_argument("--json", default=None, help="write the report here too")
    p.add_argument(
        "--decoding",
        default="static",
        choices=PATHS,
        help="--tasks' generate_until requests: a static KV cache, each step a CUDA graph's replay with graphs (GPU)",
    )
    p.add_argument(
        "--gather_model",
        default="auto",
        choices=["auto", "true", "false"],
        help="--tasks: score on the model gathered whole once (true), or on its shards, each block gathered in every "
        "forward (false; slower); auto: gathered where it fits the GPU beside a batch's forward and KV cache",
    )
    add_lm_eval_flags(p)
    return p


def _checked(args: argparse.Namespace) -> argparse.Namespace:
    for flag in ("eval_rows", "batch_size", "max_new_tokens"):
        if getattr(args, flag) < 1:
            raise ConfigError(f"--{flag} {getattr(args, flag)}: must be at least 1")
    if args.num_prompts < 0:
        raise ConfigError(f"--num_prompts {args.num_prompts}: must be 0 (no generation) or more")
    check_lm_eval_flags(args)
    if args.no_base and not args.checkpoints:
        raise ConfigError("--no_base: with no --checkpoints there is nothing to evaluate")
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        args = _checked(build_parser().parse_args(argv))
    except ConfigError as exc:
        fail(str(exc))
    env = init_distributed(args.device)
    configure_allocator(cpu_device=env.device.type == "cpu")
    try:
        benchmark(args, env) if args.tasks else compare(args, env)
    except ConfigError as exc:
        fail(str(exc))
    finally:
        teardown()
    return 0


if __name__ == "__main__":
    end_process(main)
