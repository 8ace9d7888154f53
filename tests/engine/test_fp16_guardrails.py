"""fp16 guardrails: a bf16-pretrained model whose fp16 forward overflows gets the probe's advice, the skipped-step
warning, then a one-line stop after a window of 50 overflowed steps; the skipped share is in metrics.jsonl. A healthy
fp16 run says none of it."""

from __future__ import annotations

import json

import torch
from conftest import read_jsonl, run_cli

from fsdp_opt.engine.fp16watch import STOP_WINDOW, SkipWatch, trained_in_bf16

RUN = [
    "--dataset",
    "python-docs",
    "--end_idx",
    "400",
    "--max_length",
    "32",
    "--batch_size",
    "1",
    "--accum_steps",
    "1",
    "--precision",
    "fp16",
    "--num_epochs",
    "1",
    "--lr",
    "1e-4",
]


def overflowing_model(dest):
    """tiny-opt's shape, its config saying bfloat16 as Llama's and Qwen's do, and feed-forward weights scaled so that
    activations pass fp16's largest value (65,504): the fp16 forward gives inf, then NaN."""
    from conftest import ASSETS, make_local_model
    from transformers import AutoConfig, AutoModelForCausalLM

    make_local_model(dest, dropout=0.0)
    model = AutoModelForCausalLM.from_pretrained(dest, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.decoder.layers:
            layer.fc1.weight.mul_(3000.0)
            layer.fc2.weight.mul_(3000.0)
    model.save_pretrained(dest)
    config = json.loads((dest / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))  # as the Hub's bf16 models say
    assert trained_in_bf16(AutoConfig.from_pretrained(dest)) and not trained_in_bf16(AutoConfig.from_pretrained(ASSETS))
    return dest


def test_an_fp16_overflow_storm_gets_advice_a_warning_then_a_one_line_stop(tmp_path):
    model = overflowing_model(tmp_path / "bf16-opt")
    proc = run_cli(RUN + ["--model", str(model), "--output_dir", str(tmp_path / "out")], tmp_path, timeout=600)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    out = proc.stdout
    probe = [l for l in out.splitlines() if "pretrained in bfloat16 and overflows fp16 on the first batch" in l]
    warn = [l for l in out.splitlines() if l.startswith("warning: fp16:")]
    assert len(probe) == 1 and probe[0].startswith("warning: ") and "--precision" in probe[0]
    assert warn and out.index(probe[0]) < out.index(warn[0])
    errors = [l for l in proc.stderr.splitlines() if l.startswith("error: ")]
    assert len(errors) == 1 and f"all of the last {STOP_WINDOW} steps overflowed" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr
    metrics = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    assert len(metrics) == STOP_WINDOW and all(m["skipped"] for m in metrics)
    assert metrics[-1]["skipped_rate"] == 1.0 and metrics[-1]["loss_scale"] < 1


def test_a_healthy_fp16_run_says_nothing_of_it(tmp_path):
    proc = run_cli(RUN + ["--model", "tiny-opt", "--end_idx", "40", "--output_dir", str(tmp_path / "out")], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "bfloat16" not in proc.stdout and "warning: fp16" not in proc.stdout
    metrics = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    assert all("skipped_rate" in m for m in metrics)


def test_the_skip_watch_windows():
    w = SkipWatch()
    # One skip in 20 is calibration: no warning. Two are.
    said = [w.observe(i == 5, 2.0**15)[1] for i in range(20)]
    assert not any(said)
    rate, warning, stop = w.observe(True, 2.0**14)
    assert rate == 2 / 20 and warning and "2 of the last 20 steps" in warning and stop is None
    assert w.observe(True, 2.0**13)[1] is None  # at most one warning per 20 steps
    # The loss scale finding its level: skips before the first step that goes through are not warned about
    w = SkipWatch()
    assert [w.observe(True, 2.0 ** (16 - i))[1] for i in range(3)] == [None] * 3
    assert w.observe(False, 2.0**13)[:2] == (3 / 4, None)
    assert w.observe(True, 2.0**12)[1] is None  # one skip since: calibration
    warning = w.observe(True, 2.0**11)[1]  # two since: counted from the first step that went through
    assert warning and "2 of the last 3 steps overflowed" in warning
    w = SkipWatch()
    results = [w.observe(True, 2.0 ** (15 - i)) for i in range(STOP_WINDOW)]
    assert all(r[2] is None for r in results[:-1]) and results[-1][2]
    assert any(r[1] and "below 1" in r[1] for r in results)
