"""The loss with the output layer at the target positions alone (engine/loss.py HeadLoss) against the whole logits
of the model's own forward, side by side in one run, on micro-batches where a share of the positions has a target.

    python benchmarks/head_loss.py --json head_loss.json

One process, the CPU (or the GPU with --device cuda), a model built from a config with random weights: tiny-opt
(4,096 tokens), and tiny-opt's layers with opt-1.3b's 50,272-token vocabulary (where the output layer weighs as
it does in a real model's step). Each micro-batch is 4 rows of 128 tokens whose targets are:
  text    every position (the worst case: nothing to skip);
  chat    the last third of each row (an answer after its question);
  grpo    the last 16 tokens of each row (a completion after a 112-token prompt, as the GRPO demo's).
Per case and arm: the median forward and backward of one micro-batch (the arms alternate, round by round), the peak
host memory the step added (RSS above what was resident before it; the allocator returns what is freed), and the
loss of both arms (the same to rounding).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from transformers import AutoModelForCausalLM  # noqa: E402

from fsdp_opt.engine.loss import HeadLoss, causal_lm_loss_sum  # noqa: E402 - after the repository is on the path
from fsdp_opt.model.shapes import model_config  # noqa: E402
from fsdp_opt.runtime.hostmem import configure_allocator, peak_rss_bytes, reset_peak  # noqa: E402

ROWS, LENGTH = 4, 128
CASES = {"text": 0, "chat": LENGTH - LENGTH // 3, "grpo": LENGTH - 16}  # the first position with a target


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=7, help="timed micro-batches per arm and case, alternating")
    p.add_argument("--vocabs", default="4096,50272", help="vocabulary sizes, each a model of tiny-opt's layers")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", default=None, help="write the results here too")
    return p.parse_args(argv)


def build(vocab: int, device: torch.device) -> torch.nn.Module:
    config = model_config("tiny-opt")
    config.vocab_size, config.dropout = vocab, 0.0
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).to(device).train()


def batch(vocab: int, first_target: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (ROWS, LENGTH), generator=g)
    labels = ids.clone()
    labels[:, :first_target] = -100
    return ids.to(device), labels.to(device)


def step(
    model: torch.nn.Module, head: HeadLoss | None, ids: torch.Tensor, labels: torch.Tensor
) -> tuple[float, float, int]:
    """One forward and backward: (seconds, loss, peak bytes the step added to the process's RSS)."""
    model.zero_grad(set_to_none=True)
    reset_peak()
    before = peak_rss_bytes()
    started = time.perf_counter()
    if head is None:
        loss = causal_lm_loss_sum(model(input_ids=ids).logits, labels)
    else:
        with head.hidden_states():
            hidden = model(input_ids=ids).logits
        loss = head.loss_sum(hidden, labels)
    loss.backward()
    if ids.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - started, float(loss.detach()), peak_rss_bytes() - before


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    configure_allocator()  # freed blocks go back to the system, so a step's peak is its own
    device = torch.device(args.device)
    results: dict = {
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "rows": ROWS,
        "length": LENGTH,
        "cases": {},
    }
    for vocab in (int(v) for v in args.vocabs.split(",")):
        model = build(vocab, device)
        arms = {"whole logits": None, "output layer at the targets": HeadLoss.for_run(model, 0)}
        for case, first in CASES.items():
            ids, labels = batch(vocab, first, device)
            runs: dict[str, list] = {arm: [] for arm in arms}
            for head in arms.values():  # one untimed micro-batch each: the first call's one-off costs
                step(model, head, ids, labels)
            for _ in range(args.rounds):
                for arm, head in arms.items():
                    runs[arm].append(step(model, head, ids, labels))
            row = {
                arm: {
                    "seconds": statistics.median(r[0] for r in rs),
                    "loss": rs[0][1],
                    "peak_added_mib": max(r[2] for r in rs) / 2**20,
                }
                for arm, rs in runs.items()
            }
            whole, at = row["whole logits"], row["output layer at the targets"]
            row["speedup"] = whole["seconds"] / at["seconds"]
            row["targets"] = int((labels[:, 1:] != -100).sum())
            results["cases"][f"vocab {vocab}, {case}"] = row
            print(
                f"vocab {vocab:>6}, {case:<4} ({row['targets']:>3} of {ROWS * LENGTH} positions with a target): "
                f"whole logits {whole['seconds'] * 1e3:7.1f} ms, +{whole['peak_added_mib']:6.1f} MiB; at the targets "
                f"{at['seconds'] * 1e3:7.1f} ms, +{at['peak_added_mib']:6.1f} MiB; {row['speedup']:.2f}x; loss "
                f"{whole['loss']:.4f} / {at['loss']:.4f}",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
