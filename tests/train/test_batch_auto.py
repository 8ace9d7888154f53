"""--batch_size auto: the run takes the plan's fastest configuration at the sequences per step it is given, says so,
predicts its step time from rates it measures (CPU), and trains exactly as that configuration typed by hand."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import read_jsonl, run_cli

ARGS = [
    "--model",
    "tiny-opt",
    "--dataset",
    "python-docs",
    "--max_length",
    "64",
    "--end_idx",
    "120",
    "--lr",
    "3e-3",
    "--precision",
    "fp32",
    "--save_every_steps",
    "0",
    "--wandb_mode",
    "disabled",
    "--seed",
    "3",
]
DECIDED = (
    "batch_size",
    "accum_steps",
    "sharding_strategy",
    "reduce_every_microbatch",
    "activation_checkpointing",
    "loss_chunk_tokens",
    "reduce_dtype",
)


def run(tmp: Path, name: str, extra: list[str]) -> tuple[str, list[dict]]:
    folder = tmp / name
    folder.mkdir()
    proc = run_cli(ARGS + extra + ["--output_dir", str(folder / "out")], folder, nproc=2)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout, read_jsonl(folder / "out" / "metrics.jsonl")


def test_batch_auto_trains_as_its_configuration_typed_by_hand(tmp_path):
    out, auto_rows = run(
        tmp_path, "auto", ["--batch_size", "auto", "--global_batch", "24", "--sharding_strategy", "AUTO"]
    )
    chosen = re.search(
        r"^--batch_size auto: micro-batch (\d+) x accum (\d+) x 2 GPU\(s\), .*\(24 sequences per step\); "
        r"predicted ([\d.]+) s per step",
        out,
        re.M,
    )
    assert chosen, out
    b, a = int(chosen[1]), int(chosen[2])
    assert b * a * 2 == 24  # the sequences per step are kept
    # The decided values are what the run prints (and stores) as its flags.
    flags = dict(re.findall(r"--(\w+) (\S+)", next(line for line in out.splitlines() if line.startswith("config: "))))
    assert (int(flags["batch_size"]), int(flags["accum_steps"])) == (b, a)
    assert re.search(rf"^step time: measured [\d.]+ s \(median of \d+\), predicted {float(chosen[3]):.3f} s", out, re.M)
    by_hand = []
    for name in DECIDED:
        by_hand += [f"--{name}", flags[name]]
    _, hand_rows = run(tmp_path, "hand", by_hand)
    assert [r["loss"] for r in auto_rows] == [r["loss"] for r in hand_rows]  # CPU fp32: equal, not close
    assert [r["tokens"] for r in auto_rows] == [r["tokens"] for r in hand_rows]
    assert len(auto_rows) >= 5
