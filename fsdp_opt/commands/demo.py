"""The CPU demo: tiny-opt on python-docs, 2 processes, end to end, then a one-line verdict.

python -m fsdp_opt.demo [--nproc 2] [--output_dir DIR] [--chat | --dpo | --grpo] [extra training flags]

Without a choice it trains on python-docs (plain text) into outputs/demo.
--chat trains on python-docs-chat instead (conversations in the built-in chatml template, loss on the answers
only), then asks the trained model held-out questions and shows its answers beside the rows' own (outputs/demo-chat).
--dpo trains with DPO on python-docs-prefs (the right title chosen over a wrong one), then scores the held-out pairs
(its test split) for the model before and after: the share of pairs whose chosen answer it prefers (outputs/demo-dpo).
--grpo starts from the chat demo's model (it runs the chat demo first when outputs/demo-chat has no checkpoint) and
trains it with GRPO on python-docs-prompts, the same questions asked to be answered in one word, rewarded by the
built-in `length` reward (1 for an answer of one word that ends, else 0: the form, not the title, which a model this
small cannot know for a paragraph it has not seen); then the mean reward of a greedy answer to each held-out question,
before and after (outputs/demo-grpo).
Extra flags go to the training command after the demo's own, so they win (--seed 3, say).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from fsdp_opt.tracking.metrics import read_metrics

# tiny-opt's activations are a few MB: the demos keep them instead of recomputing each layer in backward (the
# default for real models), which takes a sixth off a CPU step and changes no loss.
NO_RECOMPUTE = ["--activation_checkpointing", "false"]
# two epochs at 3e-3, warmed up over 20 steps, from seed 0: the text and chat demos' schedule
TWO_EPOCHS = ["--num_epochs", "2", "--lr", "3e-3", "--warmup_steps", "20"]
DEMO_ARGS = [
    "--model",
    "tiny-opt",
    "--dataset",
    "python-docs",
    "--max_length",
    "128",
    "--batch_size",
    "4",
    *TWO_EPOCHS,
    "--seed",
    "0",
    *NO_RECOMPUTE,
]
CHAT_ROWS = 700  # of python-docs-chat's 754: the rest are held out, asked after training
DPO_ARGS = [
    "--model",
    "tiny-opt",
    "--dataset",
    "python-docs-prefs",
    "--method",
    "dpo",
    "--chat_template",
    "chatml",
    "--max_length",
    "128",
    "--end_idx",
    "320",
    "--batch_size",
    "4",
    "--num_epochs",
    "1",
    "--lr",
    "3e-3",
    "--warmup_steps",
    "10",
    "--seed",
    "0",
    "--eval_rows",
    "100",
    "--eval_split",
    "test",
    "--save_optimizer",
    "false",
    *NO_RECOMPUTE,
]
# The learning rate decays (cosine, to a tenth over the 170 steps after warm-up): the answers' format is then held
# with a margin. At a constant rate half the run's answers ended as the template ends a turn, and the rounding of a
# CPU's kernels decided whether all four asked did (docs/testing.md: the demos' margins).
CHAT_ARGS = [
    "--model",
    "tiny-opt",
    "--dataset",
    "python-docs-chat",
    "--chat_template",
    "chatml",
    "--max_length",
    "256",
    "--end_idx",
    str(CHAT_ROWS),
    "--batch_size",
    "2",
    *TWO_EPOCHS,
    "--lr_schedule",
    "cosine",
    "--lr_decay_steps",
    "170",
    "--min_lr_ratio",
    "0.1",
    "--seed",
    "0",
    *NO_RECOMPUTE,
]
# A rate of 5e-4, warmed up over 5 steps, then a cosine decay to a tenth over the 35 steps after it. At a constant
# 1e-3 from the first step, AdamW's first updates (each parameter moved by about the full rate) left some seeds'
# model never ending an answer: every group's rewards were then equal, with no advantage left to learn from (seed 1
# from step 2; with the warm-up and decay at 1e-3, seed 4 from step 10). docs/testing.md has the seeds and kernels.
GRPO_ARGS = [
    "--dataset",
    "python-docs-prompts",
    "--method",
    "grpo",
    "--reward",
    "length",
    "--max_length",
    "128",
    "--max_completion_length",
    "16",
    "--num_generations",
    "8",
    "--global_batch",
    "64",
    "--batch_size",
    "16",
    "--end_idx",
    "320",
    "--num_epochs",
    "1",
    "--lr",
    "5e-4",
    "--warmup_steps",
    "5",
    "--lr_schedule",
    "cosine",
    "--lr_decay_steps",
    "35",
    "--min_lr_ratio",
    "0.1",
    "--eval_rows",
    "32",
    "--eval_split",
    "test",
    "--seed",
    "0",
    "--save_optimizer",
    "false",
    *NO_RECOMPUTE,
]
CHAT_PROMPTS = 4  # held-out questions the chat demo asks
DPO_PAIRS = 100  # held-out pairs the DPO demo scores


def echo_and_call(cmd: list[str]) -> int:
    """Show a command as the user would type it (`python ...`), run it, return its exit code."""
    print("$ python " + " ".join(cmd[1:]), flush=True)
    return subprocess.call(cmd)


def ask(out: Path, flags: list[str], report: str) -> dict | None:
    """`python -m fsdp_opt.evaluate` on the demo's last checkpoint and the base, in one plain process (tiny-opt fits
    one; two CPU ranks would pass each layer's shards back and forth for every generated token): its JSON report, or
    None when it failed."""
    path = out / report
    cmd = [
        sys.executable,
        "-m",
        "fsdp_opt.evaluate",
        "--checkpoints",
        "latest",
        "--output_dir",
        str(out),
        "--device",
        "cpu",
        *flags,
        "--json",
        str(path),
    ]
    return json.loads(path.read_text()) if echo_and_call(cmd) == 0 else None


def chat_verdict(out: Path) -> tuple[str, bool] | None:
    report = ask(out, ["--eval_rows", "20", "--num_prompts", str(CHAT_PROMPTS)], "answers.json")
    if report is None:
        return None
    answers = [next(reversed(s["outputs"].values())) for s in report["samples"]]
    ended = sum(1 for a in answers if a.endswith("<|im_end|>") and "<|im_start|>" not in a)
    return f"the trained model ended {ended} of {len(answers)} answers with the template's <|im_end|>", ended == len(
        answers
    )


def before_and_after(
    out: Path, flags: list[str], report: str, key: str, says: Callable[[dict, dict], str]
) -> tuple[str, bool] | None:
    """The base and the trained model scored by evaluate: what `says(base, tuned)` prints, and whether `key` rose."""
    scored = ask(out, flags, report)
    if scored is None:
        return None
    base, tuned = scored["models"]
    return says(base, tuned), tuned[key] > base[key]


def dpo_verdict(out: Path) -> tuple[str, bool] | None:
    return before_and_after(
        out,
        ["--eval_rows", str(DPO_PAIRS), "--num_prompts", "0"],
        "pairs.json",
        "accuracy",
        lambda base, tuned: (
            f"held-out accuracy {base['accuracy']:.0%} before training (the model is its own "
            f"reference), {tuned['accuracy']:.0%} after; reward margin {tuned['margin']:.2f}"
        ),
    )


def grpo_verdict(out: Path) -> tuple[str, bool] | None:
    return before_and_after(
        out,
        ["--eval_rows", "32", "--num_prompts", "4", "--max_new_tokens", "16"],
        "rewards.json",
        "reward",
        lambda base, tuned: (
            f"mean reward of a greedy answer to each of {tuned['prompts']} held-out questions: "
            f"{base['reward']:.2f} before training (the chat demo's model), {tuned['reward']:.2f} after"
        ),
    )


def grpo_start(out: Path, nproc: int) -> list[str] | None:
    """The chat demo's model, exported as a model folder for GRPO to start from (the chat demo first, without one)."""
    chat = out.parent / "demo-chat"
    trained = sorted(chat.glob("*-epoch-2.pt"))
    if not trained:
        print(
            f"demo: --grpo starts from the chat demo's model; {chat}/ has none, so the chat demo trains first, then GRPO "
            "with its evaluation before and after: about 70 s in all on 2 idle CPU cores (39 s with the chat demo's "
            "checkpoint there), minutes on busy ones (7 min 18 s at a load average of 11 on 2 cores)",
            flush=True,
        )
        if main(["--chat", "--nproc", str(nproc), "--output_dir", str(chat)]) != 0:
            return None
        trained = sorted(chat.glob("*-epoch-2.pt"))
    start = out / "start"
    cmd = [sys.executable, "-m", "fsdp_opt.export", str(trained[-1]), str(start), "--dtype", "fp32"]
    return ["--model", str(start)] if echo_and_call(cmd) == 0 else None


# name -> (the training flags, the default output folder, what the loss is of, whether it must fall, the evaluation
# after training). GRPO's loss is not one that falls as the model learns: each group's advantages are centred on
# zero, and the reward is the measure (the loss's mean rose over seed 1's run as its reward went from 0.00 to 0.97).
DEMOS = {
    "plain": (DEMO_ARGS, "outputs/demo", "loss", True, None),
    "chat": (CHAT_ARGS, "outputs/demo-chat", "answer-token loss", True, chat_verdict),
    "dpo": (DPO_ARGS, "outputs/demo-dpo", "pair loss", True, dpo_verdict),
    "grpo": (GRPO_ARGS, "outputs/demo-grpo", "GRPO loss", False, grpo_verdict),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fsdp_opt.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="worker processes (CPU ranks)")
    parser.add_argument(
        "--output_dir",
        default=None,
        help="where checkpoints and metrics go, replaced (default: outputs/demo, outputs/demo-chat with "
        "--chat, outputs/demo-dpo with --dpo, outputs/demo-grpo with --grpo)",
    )
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--chat", action="store_true", help="train on python-docs-chat, loss on the answers only")
    which.add_argument("--dpo", action="store_true", help="DPO on python-docs-prefs, scored on its held-out pairs")
    which.add_argument(
        "--grpo",
        action="store_true",
        help="GRPO on python-docs-prompts from the chat demo's model, one-word answers rewarded",
    )
    args, extra = parser.parse_known_args(argv)
    name = "chat" if args.chat else "dpo" if args.dpo else "grpo" if args.grpo else "plain"
    flags, default_out, what, must_fall, verdict = DEMOS[name]
    out = Path(args.output_dir or default_out)
    shutil.rmtree(out, ignore_errors=True)
    if args.grpo:
        start = grpo_start(out, args.nproc)
        if start is None:
            return 1
        flags = start + flags
    # The installed package's own training command (`-m fsdp_opt`): the same from a checkout, a wheel or git.
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={args.nproc}",
        "-m",
        "fsdp_opt",
        *flags,
        "--device",
        "cpu",
        "--output_dir",
        str(out),
        *extra,
    ]
    code = echo_and_call(cmd)
    if code != 0:
        return code
    rows = read_metrics(out)
    first = sum(r["loss"] for r in rows[:10]) / min(10, len(rows))
    last = sum(r["loss"] for r in rows[-10:]) / min(10, len(rows))
    print(f"demo: {len(rows)} steps; mean {what} of the first 10 steps {first:.3f}, of the last 10 {last:.3f}")
    ok = last < first or not must_fall
    if verdict is not None:
        found = verdict(out)
        if found is None:
            return 1
        line, learned = found
        print(f"demo: {line}")
        ok = ok and learned
    print(f"demo: checkpoints and metrics.jsonl are in {out}/")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
