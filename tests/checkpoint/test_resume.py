"""Checkpoints and resume: exactness, other rank counts, new slices, stop signals, time limits, pruning."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import (
    ASSETS,
    ENTRY,
    assert_clean_failure,
    built_once,
    kill_all_with,
    losses_by_step,
    read_jsonl,
    run_cli,
    sandbox_env,
    torchrun_cmd,
)

from fsdp_opt.checkpoint.drift import CHANGES_KEY
from fsdp_opt.checkpoint.names import MODEL_KEY, checkpoint_name, list_checkpoints
from fsdp_opt.checkpoint.save import EPOCHS_KEY, STEP_KEY
from fsdp_opt.hub.lease import LOCAL_LEASE

END = 60
BASE = [
    "--dataset",
    "python-docs",
    "--end_idx",
    str(END),
    "--max_length",
    "64",
    "--batch_size",
    "2",
    "--accum_steps",
    "2",
    "--lr",
    "2e-3",
    "--precision",
    "fp32",
    "--seed",
    "11",
]
TINY = ["--model", "tiny-opt"] + BASE  # dropout 0.1: exactness needs every rank's RNG restored


@pytest.fixture(scope="module")
def straight_dir(tmp_path_factory) -> Path:
    """2 epochs uninterrupted on 2 ranks: the reference for every resume below; it keeps both epochs' checkpoints."""

    def build(tmp: Path) -> None:
        proc = run_cli(TINY + ["--num_epochs", "2", "--output_dir", str(tmp / "out")], tmp, nproc=2)
        assert proc.returncode == 0, proc.stderr[-3000:]

    return built_once(tmp_path_factory, "straight", build) / "out"


@pytest.fixture(scope="module")
def straight(straight_dir) -> dict[int, float]:
    return losses_by_step(straight_dir / "metrics.jsonl")


def _assert_same(got: dict[int, float], want: dict[int, float], tol: float) -> None:
    assert sorted(got) == sorted(want)
    for step, loss in want.items():
        assert abs(got[step] - loss) <= tol * max(1.0, abs(loss)), (step, got[step], loss)


@pytest.mark.parametrize("kind", ["full", "sharded"])
def test_one_epoch_plus_resume_equals_two_epochs(tmp_path, straight, kind):
    out = tmp_path / "out"
    # Full checkpoints are written in the background here (the engine's default on a GPU): the saved state is the
    # step's, whatever the steps that run during the write do.
    writes = ["--async_save", "true"] if kind == "full" else []
    args = TINY + ["--state_dict_type", kind, "--output_dir", str(out)] + writes
    first = run_cli(args + ["--num_epochs", "1"], tmp_path, nproc=2)
    assert first.returncode == 0, first.stderr[-3000:]
    name = checkpoint_name("tiny_opt", 0, END, 1, sharded=kind == "sharded")
    second = run_cli(args + ["--num_epochs", "1", "--resume_file", name], tmp_path, nproc=2)
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"resumed {out / name} at global step {len(straight) // 2}" in second.stdout
    assert "note: the checkpoint packed" not in second.stdout  # the same packing: no note about another one
    # metrics.jsonl kept growing: one file holds both sessions, step numbers continuing.
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == sorted(straight)
    _assert_same(losses_by_step(out / "metrics.jsonl"), straight, 1e-6)
    assert (out / checkpoint_name("tiny_opt", 0, END, 2, sharded=kind == "sharded")).exists()


def test_sigkill_after_mid_epoch_checkpoint_then_resume_latest(tmp_path, straight):
    out = tmp_path / "out"
    args = TINY + [
        "--num_epochs",
        "2",
        "--save_every_steps",
        "4",
        "--keep_last",
        "0",
        "--output_dir",
        str(out),
        "--async_save",
        "true",
    ]  # the kill can land while a later checkpoint is being written
    proc = subprocess.Popen(
        torchrun_cmd(2) + args,
        cwd=tmp_path,
        env=sandbox_env(tmp_path),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    per_epoch = len(straight) // 2
    target = out / checkpoint_name("tiny_opt", 0, END, 2, (per_epoch // 4 + 1) * 4)  # first save of epoch 2
    deadline = time.time() + 240
    while not target.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    # Like a session that ends: torchrun and every worker (they run in sessions of their own) die at once.
    kill_all_with(str(out), signal.SIGKILL)
    proc.wait()
    assert target.exists(), "the run ended before the mid-epoch checkpoint"
    killed_at = max(r["step"] for r in read_jsonl(out / "metrics.jsonl"))
    assert killed_at < len(straight)
    resumed = run_cli(
        TINY + ["--num_epochs", "1", "--resume_file", "latest", "--output_dir", str(out)], tmp_path, nproc=2
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    latest = max(list_checkpoints(out), key=lambda p: p.stat().st_mtime)
    assert latest.name == checkpoint_name("tiny_opt", 0, END, 2)
    assert "resumed" in resumed.stdout and "epoch 1, sample" in resumed.stdout
    _assert_same(losses_by_step(out / "metrics.jsonl"), straight, 1e-6)


@pytest.mark.parametrize("kind", ["full", "sharded"])
def test_resume_on_another_rank_count_keeps_the_global_batches(tmp_path, det_model, kind):
    """2 ranks x batch 2 -> 1 rank x batch 4: same global batches, same losses (dropout off)."""
    base = (
        ["--model", str(det_model)] + BASE + ["--state_dict_type", kind, "--save_every_steps", "3", "--keep_last", "0"]
    )
    ref_out, out = tmp_path / "ref", tmp_path / "out"
    ref = run_cli(base + ["--num_epochs", "1", "--output_dir", str(ref_out)], tmp_path, nproc=2)
    assert ref.returncode == 0, ref.stderr[-3000:]
    want = losses_by_step(ref_out / "metrics.jsonl")
    name = checkpoint_name("tiny_det", 0, END, 1, 6, sharded=kind == "sharded")
    resumed = run_cli(
        ["--model", str(det_model)]
        + BASE
        + [
            "--batch_size",
            "4",
            "--state_dict_type",
            kind,
            "--num_epochs",
            "1",
            "--resume_file",
            str(ref_out / name),
            "--output_dir",
            str(out),
        ],
        tmp_path,
        nproc=0,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "1 rank(s)" in resumed.stdout and "= 8 sequences per step" in resumed.stdout
    got = losses_by_step(out / "metrics.jsonl")
    assert sorted(got) == [s for s in sorted(want) if s > 6]
    for step, loss in got.items():
        assert loss == pytest.approx(want[step], rel=1e-4), step


def test_new_slice_keeps_the_run_and_starts_at_its_first_batch(tmp_path):
    out = tmp_path / "out"
    common = [
        "--model",
        "tiny-opt",
        "--dataset",
        "python-docs",
        "--max_length",
        "64",
        "--batch_size",
        "2",
        "--warmup_steps",
        "30",
        "--lr",
        "3e-3",
        "--output_dir",
        str(out),
    ]
    a = run_cli(common + ["--start_idx", "0", "--end_idx", "60"], tmp_path, nproc=2)
    assert a.returncode == 0, a.stderr[-3000:]
    steps_a = len(read_jsonl(out / "metrics.jsonl"))
    b = run_cli(
        common + ["--start_idx", "60", "--end_idx", "120", "--resume_file", checkpoint_name("tiny_opt", 0, 60, 1)],
        tmp_path,
        nproc=2,
    )
    assert b.returncode == 0, b.stderr[-3000:]
    assert "the first batch of slice [60, 120)" in b.stdout
    rows = read_jsonl(out / "metrics.jsonl")
    second = rows[steps_a:]
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    assert second[0]["epoch"] == 0
    # The warm-up continues from the global step, not from zero.
    assert second[0]["lr"] == pytest.approx(3e-3 * min(1.0, (steps_a + 1) / 30))
    payload = torch.load(out / checkpoint_name("tiny_opt", 60, 120, 1), weights_only=True)
    assert payload[STEP_KEY] == len(rows) and payload[EPOCHS_KEY] == 1
    assert payload["slice"]["start_idx"] == 60 and payload["train_state"]["global_step"] == len(rows)


def test_changed_settings_are_each_one_line_breaking_ones_refused_unless_allowed(tmp_path, straight_dir, straight):
    """Resuming with other flags: each change is one line with both values. --packing breaks exactness: refused in
    one line, before anything is written. With --allow_changes the run goes on: the same slice packed another way has
    other blocks, so it keeps the model, optimizer and global step, starts the slice at its first batch, and says why;
    --lr is a choice, applied and recorded in the checkpoint."""
    out = tmp_path / "out"
    ckpt = straight_dir / checkpoint_name("tiny_opt", 0, END, 1)
    args = TINY + ["--packing", "concat", "--lr", "1e-3", "--resume_file", str(ckpt), "--output_dir", str(out)]
    refused = run_cli(args, tmp_path)
    line = assert_clean_failure(
        refused, f"--resume_file {ckpt.name}: --packing docs -> concat (the blocks change)", "--allow_changes"
    )
    assert "--lr" not in line  # only the breaking changes stop the run
    assert "settings: --lr 0.002 -> 0.001 (a choice: applied from this session on)" in refused.stdout
    assert not out.exists()
    proc = run_cli(args + ["--allow_changes"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "settings: --packing docs -> concat (breaks exactness: the blocks change)" in proc.stdout
    assert (
        "note: the checkpoint packed this slice with --packing docs; this run packs it with --packing concat, "
        "so its blocks differ and the slice starts again from its first batch"
    ) in proc.stdout
    per_epoch = len(straight) // 2
    assert f"at global step {per_epoch}; continuing at the first batch of slice [0, {END})" in proc.stdout
    rows = read_jsonl(out / "metrics.jsonl")
    assert rows[0]["step"] == per_epoch + 1 and rows[0]["epoch"] == 0
    saved = torch.load(out / checkpoint_name("tiny_opt", 0, END, 1), weights_only=True)
    assert [(c["flag"], c["from"], c["to"], c["step"]) for c in saved[CHANGES_KEY]] == [
        ("packing", "docs", "concat", per_epoch),
        ("lr", 0.002, 0.001, per_epoch),
    ]


def test_checkpoint_contents_load_with_weights_only(straight_dir):
    payload = torch.load(straight_dir / checkpoint_name("tiny_opt", 0, END, 1), weights_only=True)
    assert payload[MODEL_KEY]["lm_head.weight"].dtype == torch.float32
    assert set(payload["optimizer"]["state"]) >= {"model.decoder.layers.0.fc1.weight"}
    assert payload["scaler"]["scale"] == 1.0 and payload["lr_schedule"]["lr"] == 2e-3
    assert len(payload["rng"]) == 2 and isinstance(payload["rng"][1]["torch"], torch.Tensor)
    assert payload["slice"]["end_idx"] == END and payload["slice"]["dataset"] == "python-docs"
    assert payload["config"]["batch_size"] == 2 and "wandb_run_id" in payload
    assert payload["train_state"] == {"global_step": payload[STEP_KEY], "epoch": 1, "offset": 0}


def test_weights_only_checkpoint_is_smaller_and_resumes_and_keep_last_keeps_the_newest(tmp_path, straight_dir):
    out = tmp_path / "out"
    small = run_cli(
        TINY + ["--save_optimizer", "false", "--save_every_steps", "3", "--keep_last", "2", "--output_dir", str(out)],
        tmp_path,
        nproc=2,
    )
    assert small.returncode == 0, small.stderr[-3000:]
    name = checkpoint_name("tiny_opt", 0, END, 1)
    # --keep_last 2: the final checkpoint and the newest mid-epoch one, by global step.
    steps = len(read_jsonl(out / "metrics.jsonl"))
    last_mid = steps - 1 - (steps - 1) % 3
    assert sorted(p.name for p in list_checkpoints(out)) == sorted(
        [name, checkpoint_name("tiny_opt", 0, END, 1, last_mid)]
    )
    # Independent sizes: fp32 weights are 4 bytes per unique parameter; AdamW adds m and v (8 more).
    from transformers import AutoConfig, AutoModelForCausalLM

    n = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ASSETS)).num_parameters()
    assert (out / name).stat().st_size == pytest.approx(4 * n, rel=0.05)
    assert (straight_dir / name).stat().st_size == pytest.approx(12 * n, rel=0.05)
    assert torch.load(out / name, weights_only=True)["optimizer"] is None
    assert "MiB in" in small.stdout  # each save reports its size and duration
    again = run_cli(TINY + ["--resume_file", name, "--output_dir", str(out)], tmp_path, nproc=2)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "no optimizer state" in again.stdout


def test_sigterm_saves_and_exits_cleanly_then_resumes(tmp_path):
    out = tmp_path / "out"
    args = TINY + ["--num_epochs", "20", "--output_dir", str(out)]
    proc = subprocess.Popen(
        [sys.executable, str(ENTRY)] + args,
        cwd=tmp_path,
        env=sandbox_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 120
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3) and time.time() < deadline:
        time.sleep(0.05)
    assert (out / LOCAL_LEASE).exists()  # the chain's lease, held while the session runs
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr[-3000:]
    assert "stopping: received SIGTERM" in stdout
    assert not (out / LOCAL_LEASE).exists()  # ... and given back on the way out
    line = stdout.splitlines()[stdout.splitlines().index("resume with:") + 1].strip()
    assert line.startswith("python fsdp_finetune.py") and "--resume_file" in line
    name = line.split("--resume_file ")[1].split()[0]
    stopped_at = len(read_jsonl(metrics))
    assert name == checkpoint_name("tiny_opt", 0, END, 1, stopped_at)
    again = run_cli(TINY + ["--num_epochs", "1", "--resume_file", name, "--output_dir", str(out)], tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert read_jsonl(metrics)[stopped_at]["step"] == stopped_at + 1


def test_time_limit_saves_before_the_budget_and_prints_the_resume_command(tmp_path):
    out = tmp_path / "out"
    started = time.time()
    proc = run_cli(TINY + ["--num_epochs", "50", "--time_limit", "30s", "--output_dir", str(out)], tmp_path, nproc=2)
    took = time.time() - started
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "stopping: time limit" in proc.stdout and "--resume_file" in proc.stdout
    assert f"chain: lease on {out} taken for rows [0, {END})" in proc.stdout and not (out / LOCAL_LEASE).exists()
    assert "torchrun --standalone --nproc_per_node=2 fsdp_finetune.py" in proc.stdout
    steps = len(read_jsonl(out / "metrics.jsonl"))
    lines = proc.stdout.splitlines()
    name = lines[lines.index("resume with:") + 1].split("--resume_file ")[1].split()[0]
    assert steps > 0 and torch.load(out / name, weights_only=True)[STEP_KEY] == steps
    assert took < 60  # process start-up (~10 s) plus a 30 s budget, with the save inside it
