"""--reduce_dtype fp16: the gradients reduce-scattered in fp16 (half the bytes on the link). Its math against the fp32
reduce over 30+ steps of tiny-opt at 2 ranks, and its overflows: skipped, never applied."""

from __future__ import annotations

import json
import math
from pathlib import Path

from conftest import ROOT, launch, read_jsonl, run_cli_concurrently

ARGS = [
    "--model",
    "tiny-opt",
    "--dataset",
    "python-docs",
    "--max_length",
    "32",
    "--packing",
    "concat",
    "--batch_size",
    "1",
    "--accum_steps",
    "2",
    "--end_idx",
    "56",
    "--lr",
    "3e-3",
    "--precision",
    "fp16",
    "--save_every_steps",
    "0",
    "--wandb_mode",
    "disabled",
]
# Each step's loss with the fp16 reduce within this of the fp32 reduce's, and within this on average.
STEP_TOLERANCE = 0.03  # about 0.5% of the losses here (6.5 to 8.3)
MEAN_TOLERANCE = 0.005


def train_pairs(tmp_path: Path, extra: list[str]) -> dict[str, list[dict]]:
    """The fp32 and fp16 reduce runs of ARGS + extra, side by side (2 ranks each)."""
    folders = {dtype: tmp_path / f"{dtype}{len(extra)}" for dtype in ("fp32", "fp16")}
    for out in folders.values():
        out.mkdir()
    procs = run_cli_concurrently(
        [
            (ARGS + extra + ["--reduce_dtype", dtype, "--output_dir", str(out / "out")], out, None)
            for dtype, out in folders.items()
        ],
        timeout=400,
        nproc=2,
    )
    rows = {}
    for (dtype, out), proc in zip(folders.items(), procs):
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert f"{dtype} gradient reduction" in proc.stdout
        rows[dtype] = read_jsonl(out / "out" / "metrics.jsonl")
    return rows


def test_fp16_reduce_tracks_the_fp32_reduce_over_thirty_steps(tmp_path):
    rows = train_pairs(tmp_path, [])
    a, b = rows["fp32"], rows["fp16"]
    assert len(a) == len(b) >= 30
    assert not any(r["skipped"] for r in a + b)
    diffs = [abs(x["loss"] - y["loss"]) for x, y in zip(a, b)]
    assert max(diffs) <= STEP_TOLERANCE, diffs
    assert sum(diffs) / len(diffs) <= MEAN_TOLERANCE
    assert diffs[-1] > 0 or diffs[-2] > 0  # the two really differ: fp16 sums are not fp32 sums
    assert b[-1]["loss"] < b[0]["loss"] - 1.5  # and it trains


def test_overflows_are_skipped_and_halve_the_scale_not_applied(tmp_path):
    # A loss scale of 2^32 overflows fp16 at first: every run skips steps, halving the scale each time, until the
    # gradients fit. Summed over two ranks (and over micro-batches in fp16), the fp16 reduce overflows at scales
    # where the fp32 reduce does not: it skips at least as many steps.
    rows = train_pairs(tmp_path, ["--init_loss_scale", str(2**32)])
    a, b = rows["fp32"], rows["fp16"]
    for run in (a, b):
        assert all(math.isfinite(r["loss"]) for r in run)
        for before, after in zip(run, run[1:]):
            if before["skipped"]:
                assert after["loss_scale"] == before["loss_scale"] / 2
        assert run[0]["skipped"] and run[-1]["skipped_steps"] >= 5
    assert b[-1]["skipped_steps"] >= a[-1]["skipped_steps"]
    # Not corrupted: after its skips the fp16 reduce run ends where the fp32 reduce run ends.
    tail_a = sum(r["loss"] for r in a[-10:]) / 10
    tail_b = sum(r["loss"] for r in b[-10:]) / 10
    assert abs(tail_a - tail_b) <= 0.02 * tail_a
    assert tail_b < b[0]["loss"] - 1.0


def test_a_sum_past_fp16s_range_arrives_as_inf_and_trips_the_overflow_check(tmp_path):
    # Each rank's gradient is 40000 (finite in fp16); their sum, 80000, is not. Reduced in fp32 the norm is exact:
    # 8 gradients of 80000 -> sqrt(8) x 80000.
    out = tmp_path / "overflow.json"
    proc = launch([str(ROOT / "tests" / "workers" / "reduce_overflow.py")], [str(out)], tmp_path, nproc=2)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(out.read_text())
    assert r["fp32"]["block_grad_max"] == 80000.0
    assert math.isclose(r["fp32"]["norm"], math.sqrt(8) * 80000, rel_tol=1e-6)
    assert r["fp16"]["block_grad_max"] == math.inf and r["fp16"]["norm"] == math.inf
    assert r["fp16"]["grad_dtype"] == r["fp32"]["grad_dtype"] == "torch.float32"  # the sharded gradient stays fp32
