"""A checkpoint written before the package was laid out by concern (tests/fixtures/pre_layout, made by commit
068ef3e) still resumes exactly: the rest of the epoch matches a straight run of today's code and the losses the
old code logged when it ran the same epoch straight through."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import ROOT, read_jsonl, run_cli

FIXTURE = ROOT / "tests" / "fixtures" / "pre_layout"
STEP = 4  # the fixture's checkpoints were saved after optimizer step 4 of 10
ARGS = [
    "--dataset",
    "python-docs",
    "--end_idx",
    "60",
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
    "--num_epochs",
    "1",
    "--keep_last",
    "3",
]


def losses(path: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_jsonl(path)}


@pytest.mark.parametrize("kind", ["full", "sharded"])
def test_pre_layout_checkpoint_resumes_exactly(tmp_path, kind):
    work = tmp_path / "work"
    shutil.copytree(FIXTURE, work)
    name = "model_0-60-epoch-1-step-4" + (".pt" if kind == "full" else "")
    out = work / "out"
    out.mkdir()
    shutil.move(str(work / name), str(out / name))
    common = ARGS + ["--model", str(work / "model"), "--state_dict_type", kind, "--output_dir", str(out)]

    resumed = run_cli(common + ["--resume_file", name], work, nproc=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"at global step {STEP}" in resumed.stdout
    straight_out = tmp_path / "straight"
    straight = run_cli(
        ARGS + ["--model", str(work / "model"), "--state_dict_type", kind, "--output_dir", str(straight_out)],
        work,
        nproc=2,
    )
    assert straight.returncode == 0, straight.stderr[-3000:]

    got = {s: l for s, l in losses(out / "metrics.jsonl").items() if s > STEP}
    today = {s: l for s, l in losses(straight_out / "metrics.jsonl").items() if s > STEP}
    then = {s: l for s, l in losses(FIXTURE / f"metrics-{kind}.jsonl").items() if s > STEP}
    assert sorted(got) == sorted(today) == sorted(then) == list(range(STEP + 1, 11))
    for step in got:
        assert got[step] == pytest.approx(today[step], rel=1e-6, abs=1e-6), step
        assert got[step] == pytest.approx(then[step], rel=1e-6, abs=1e-6), step
