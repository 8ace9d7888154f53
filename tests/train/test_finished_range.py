"""A finished range is done: the same command run again into the same folder (as Kaggle's "Save & Run All" runs a
finished session's cell again) says so in one line and exits 0, fast, training and writing nothing; with another
--lr it is refused in one line naming the flag and the ways forward; --overwrite trains it again, and the step log
keeps one record per step, the earlier run's moved to metrics.replaced.jsonl. On a fresh machine the Hub repo's
index answers the same question. (--start_idx auto's done chain: tests/train/test_auto_chain.py.)"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

from conftest import COMMON, HF_TOK, assert_clean_failure, hub_env, read_jsonl, run_cli, saved_names
from hubserver import HubServer

from fsdp_opt.tracking.metrics import METRICS_FILE

ARGS = COMMON + ["--end_idx", "16", "--batch_size", "2", "--precision", "fp32", "--wandb_mode", "disabled"]
CHECKPOINT = "tiny_opt_0-16-epoch-1.pt"


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under the folder by its sha256: what a run that writes nothing leaves as it was."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def steps(folder: Path, name: str = METRICS_FILE) -> list[int]:
    return [r["step"] for r in read_jsonl(folder / name)]


def test_a_finished_range_is_done_refused_with_other_settings_and_trained_again_with_overwrite(tmp_path):
    args = ARGS + ["--output_dir", "out"]
    first = run_cli(args, tmp_path, nproc=2)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    assert saved_names(first.stdout) == [CHECKPOINT]
    out = tmp_path / "out"
    trained, logged = snapshot(out), steps(out)
    assert logged == list(range(1, len(logged) + 1)) and logged

    started = time.perf_counter()
    again = run_cli(args, tmp_path, nproc=2)
    seconds = time.perf_counter() - started
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert again.stdout.strip().splitlines() == [
        f"chain: done: rows [0, 16), epoch 1, are trained already with these settings ({CHECKPOINT}, global step "
        f"{logged[-1]}, in --output_dir out). Nothing to train; --overwrite trains them again, and the chain goes on "
        f"with --start_idx 16 --end_idx 32 --resume_file {CHECKPOINT}"
    ]
    assert seconds < 15, seconds
    assert snapshot(out) == trained  # the checkpoint's bytes, metrics.jsonl: nothing trained, no lease left

    # Another --lr on the same range: refused, naming the flag and the ways forward; a session-only flag is not a
    # change of what the range trains (--time_limit), a layout flag is not compared (--batch_size with the same
    # global batch).
    other = run_cli(args + ["--lr", "1e-3", "--time_limit", "1h"], tmp_path, nproc=2)
    line = assert_clean_failure(
        other,
        "--lr 0.003 -> 0.001: rows [0, 16), epoch 1, are trained already",
        "a new --output_dir",
        "--overwrite",
        f"--start_idx 16 --end_idx 32 --resume_file {CHECKPOINT}",
    )
    assert "time_limit" not in line, line
    assert snapshot(out) == trained
    layout = run_cli(args + ["--batch_size", "1", "--accum_steps", "2"], tmp_path, nproc=2)
    assert layout.returncode == 0 and "chain: done: rows [0, 16)" in layout.stdout, layout.stdout + layout.stderr

    # --overwrite trains the range again: a new checkpoint in its place, one record per step in metrics.jsonl, and
    # the first run's records in metrics.replaced.jsonl.
    retrained = run_cli(args + ["--lr", "1e-3", "--overwrite"], tmp_path, nproc=2)
    assert retrained.returncode == 0, retrained.stdout[-2000:] + retrained.stderr[-2000:]
    assert saved_names(retrained.stdout) == [CHECKPOINT]
    assert retrained.stdout.startswith("overwrite: rows [0, 16), epoch 1, are trained already"), retrained.stdout
    assert snapshot(out)[CHECKPOINT] != trained[CHECKPOINT]
    assert steps(out) == logged and steps(out, "metrics.replaced.jsonl") == logged
    assert {r["lr"] for r in read_jsonl(out / METRICS_FILE)} == {1e-3}


def test_on_a_fresh_machine_the_hub_repo_says_the_range_is_done(tmp_path):
    """The range trained on one machine and pushed; the same command on another (an empty output folder) finds it in
    the repo's index: done, nothing downloaded, no lease taken, the repo as it was; another --lr is refused."""
    args = ARGS + ["--hf_repo", "me/done", "--hub_retries", "1"]
    with HubServer(token=HF_TOK) as server:
        m1 = tmp_path / "m1"
        m1.mkdir()
        first = run_cli(args + ["--output_dir", str(m1 / "out")], m1, nproc=2, env=hub_env(tmp_path, server, "m1"))
        assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
        repo = server.files("me/done")
        assert f"checkpoints/{CHECKPOINT}" in repo
        for i, extra in enumerate([[], ["--lr", "1e-3"]]):
            machine = tmp_path / f"m{i + 2}"
            machine.mkdir()
            proc = run_cli(
                args + extra + ["--output_dir", str(machine / "out")],
                machine,
                nproc=2,
                env=hub_env(tmp_path, server, f"m{i + 2}"),
            )
            if extra:
                assert_clean_failure(proc, "--lr 0.003 -> 0.001: rows [0, 16), epoch 1, are trained already")
            else:
                assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
                assert proc.stdout.strip().startswith("chain: done: rows [0, 16), epoch 1, are trained already"), (
                    proc.stdout
                )
                assert "in the Hub repo me/done). Nothing to train" in proc.stdout
            assert not (machine / "out").exists()
        assert server.files("me/done") == repo
