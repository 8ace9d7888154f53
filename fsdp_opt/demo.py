"""The CPU demo: tiny-opt on python-docs, 2 processes, end to end, then a one-line verdict.

python -m fsdp_opt.demo [--nproc 2] [--output_dir outputs/demo] [--chat | --dpo] [extra fsdp_finetune.py flags]

--chat trains on python-docs-chat instead (conversations in the built-in chatml template, loss on the answers
only), then asks the trained model the held-out questions and shows its answers beside the rows' own.
--dpo trains with DPO on python-docs-prefs (the right title chosen over a wrong one), then scores the held-out pairs
(its test split) for the model before and after: the share of pairs whose chosen answer it prefers.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

from fsdp_opt.tracking.metrics import read_metrics

ENTRY = Path(__file__).resolve().parents[1] / "fsdp_finetune.py"

# tiny-opt's activations are a few MB: the demos keep them instead of recomputing each layer in backward (the
# default for real models), which takes a sixth off a CPU step and changes no loss.
NO_RECOMPUTE = ["--activation_checkpointing", "false"]
DEMO_ARGS = [
    "--model", "tiny-opt", "--dataset", "python-docs", "--max_length", "128", "--batch_size", "4",
    "--num_epochs", "2", "--lr", "3e-3", "--warmup_steps", "20", "--seed", "0", *NO_RECOMPUTE,
]  # fmt: skip
CHAT_ROWS = 700  # of python-docs-chat's 754: the rest are held out, asked after training
DPO_ARGS = [
    "--model", "tiny-opt", "--dataset", "python-docs-prefs", "--method", "dpo", "--chat_template", "chatml",
    "--max_length", "128", "--end_idx", "320", "--batch_size", "4", "--num_epochs", "1", "--lr", "3e-3",
    "--warmup_steps", "10", "--seed", "0", "--eval_rows", "100", "--eval_split", "test", "--save_optimizer", "false",
    *NO_RECOMPUTE,
]  # fmt: skip
CHAT_ARGS = [
    "--model", "tiny-opt", "--dataset", "python-docs-chat", "--chat_template", "chatml", "--max_length", "256",
    "--end_idx", str(CHAT_ROWS), "--batch_size", "2", "--num_epochs", "2", "--lr", "3e-3", "--warmup_steps", "20",
    "--seed", "0", *NO_RECOMPUTE,
]  # fmt: skip


def echo_and_call(cmd: list[str]) -> int:
    """Show a command as the user would type it (`python ...`), run it, return its exit code."""
    print("$ python " + " ".join(cmd[1:]), flush=True)
    return subprocess.call(cmd)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="worker processes (CPU ranks)")
    parser.add_argument("--output_dir", default=None, help="where checkpoints and metrics go (replaced; default "
                        "outputs/demo, or outputs/demo-chat with --chat)")  # fmt: skip
    parser.add_argument("--chat", action="store_true", help="train on python-docs-chat, loss on the answers only")
    parser.add_argument("--dpo", action="store_true", help="DPO on python-docs-prefs, scored on its held-out pairs")
    args, extra = parser.parse_known_args(argv)
    out = Path(args.output_dir or ("outputs/demo-chat" if args.chat else "outputs/demo-dpo" if args.dpo else "outputs/demo"))
    shutil.rmtree(out, ignore_errors=True)
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}"]
    cmd = launch + [str(ENTRY)] + (CHAT_ARGS if args.chat else DPO_ARGS if args.dpo else DEMO_ARGS)
    cmd += ["--device", "cpu", "--output_dir", str(out)]
    cmd += extra
    code = echo_and_call(cmd)
    if code != 0:
        return code
    rows = read_metrics(out)
    first = sum(r["loss"] for r in rows[:10]) / min(10, len(rows))
    last = sum(r["loss"] for r in rows[-10:]) / min(10, len(rows))
    what = "answer-token loss" if args.chat else "pair loss" if args.dpo else "loss"
    # The evaluation after --chat or --dpo: one plain process (tiny-opt fits one; two CPU ranks would spend most of
    # their time passing each layer's shards back and forth for every generated token).
    evaluate = [sys.executable, "-m", "fsdp_opt.evaluate", "--checkpoints", "latest", "--output_dir", str(out),
                "--device", "cpu"]  # fmt: skip
    print(f"demo: {len(rows)} steps; mean {what} of the first 10 steps {first:.3f}, of the last 10 {last:.3f}")
    if args.dpo:
        report = out / "pairs.json"
        ask = evaluate + ["--eval_rows", "100", "--num_prompts", "0", "--json", str(report)]
        code = echo_and_call(ask)
        if code != 0:
            return code
        base, tuned = json.loads(report.read_text())["models"]
        print(f"demo: held-out accuracy {base['accuracy']:.0%} before training (the model is its own reference), "
              f"{tuned['accuracy']:.0%} after; reward margin {tuned['margin']:.2f}")  # fmt: skip
        print(f"demo: checkpoints and metrics.jsonl are in {out}/")
        return 0 if tuned["accuracy"] > base["accuracy"] else 1
    if args.chat:
        report = out / "answers.json"
        ask = evaluate + ["--eval_rows", "20", "--num_prompts", "4", "--json", str(report)]
        code = echo_and_call(ask)
        if code != 0:
            return code
        samples = json.loads(report.read_text())["samples"]
        ended = sum(1 for s in samples if next(reversed(s["outputs"].values())).endswith("<|im_end|>"))
        print(f"demo: the trained model ended {ended} of {len(samples)} answers with the template's <|im_end|>")
    print(f"demo: checkpoints and metrics.jsonl are in {out}/")
    return 0 if last < first else 1


if __name__ == "__main__":
    sys.exit(main())
