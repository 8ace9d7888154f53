"""Disk by default: before a save that would not fit, older local checkpoints go (the Hub's first, then the others,
the newest only once the Hub has it), so a disk that holds one resumable checkpoint plus the one being written runs
saves every few steps to the end with the default --keep_last 2 and no --disk_budget."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import read_jsonl, run_cli

from fsdp_opt.checkpoint.room import Held, choose

GB = 10**9


def held(name: str, size: float, step: int, **kw) -> Held:
    """`step` only names the order: the lists below are oldest first."""
    return Held(Path(name), int(size * GB), **kw)


def names(room) -> list[str]:
    return [str(h.path) for h in room.remove]


def test_the_hubs_copies_go_first_then_older_ones_and_the_newest_only_once_on_the_hub():
    a, b, c = held("a", 15.8, 100, on_hub=True), held("b", 15.8, 200), held("c", 15.8, 300, on_hub=True)
    # Kaggle: 20 GB, nothing else on it. One 15.8 GB checkpoint on disk leaves 4.2 GB free.
    assert names(choose([c], 15.8 * GB, int(4.2 * GB), None)) == ["c"]  # the Hub has the newest: it may go
    room = choose([held("c", 15.8, 300)], 15.8 * GB, int(4.2 * GB), None)
    assert room.remove == [] and not room.fits_disk  # the only copy of the newest stays; the save stops in one line
    queued = choose([held("c", 15.8, 300, queued=True, uploading=True)], 15.8 * GB, int(4.2 * GB), None)
    assert names(queued) == ["c"] and queued.wait_for_newest  # wait for its upload, then remove it
    # Older ones: on the Hub first (a), then not (b); the newest (c) stays once the rest is enough.
    assert choose([b, a, c], 15.8 * GB, int(20 * GB), None).remove == []  # it fits as it is
    room = choose([b, a, c], 15.8 * GB, int(5 * GB), None)
    assert names(room) == ["a"] and room.free_after == int(20.8 * GB) and room.fits_disk
    room = choose([b, a, c], 30 * GB, int(5 * GB), None)
    assert names(room) == ["a", "b"] and room.fits_disk and room.used_after == int(15.8 * GB)
    # An older checkpoint being uploaded right now is never removed (its file is being read).
    room = choose(
        [held("b", 15.8, 200, uploading=True, queued=True), held("c", 15.8, 300)], 15.8 * GB, int(5 * GB), None
    )
    assert room.remove == [] and not room.fits_disk
    # --disk_budget caps what stays even with free space; the newest not on the Hub stays over it (a warning).
    room = choose([a, b, c], 15.8 * GB, 100 * GB, 40 * GB)
    assert names(room) == ["a", "b"] and room.fits_budget
    room = choose([held("c", 15.8, 300)], 15.8 * GB, 100 * GB, 19 * GB)
    assert room.remove == [] and room.fits_disk and not room.fits_budget
    # Nothing needed: nothing removed.
    assert choose([a, b, c], 1 * GB, 50 * GB, None).remove == []


RUN = [
    "--model",
    "tiny-opt",
    "--dataset",
    "python-docs",
    "--end_idx",
    "64",
    "--max_length",
    "32",
    "--batch_size",
    "2",
    "--accum_steps",
    "1",
    "--precision",
    "fp32",
    "--num_epochs",
    "1",
    "--seed",
    "5",
]


@pytest.fixture
def small_disk(tmp_path):
    mount = tmp_path / "disk"
    mount.mkdir()

    def make(size: int) -> Path:
        proc = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True, text=True
        )
        if proc.returncode != 0:
            pytest.skip(f"a small disk needs a tmpfs mount (root): {proc.stderr.strip()}")
        return mount

    yield make
    subprocess.run(["umount", str(mount)], capture_output=True)


def test_saves_every_few_steps_run_to_the_end_on_a_disk_for_two_checkpoints(tmp_path, small_disk):
    ref = run_cli(
        RUN + ["--output_dir", str(tmp_path / "ref"), "--keep_last", "0", "--save_every_steps", "2"], tmp_path
    )
    assert ref.returncode == 0, ref.stdout + ref.stderr
    saved = sorted((tmp_path / "ref").glob("*.pt"))
    size = max(p.stat().st_size for p in saved)
    steps = [m["step"] for m in read_jsonl(tmp_path / "ref" / "metrics.jsonl")]
    assert len(saved) >= 4 and len(steps) >= 8  # several saves, each of which must find room

    # One checkpoint plus the one being written fit; a third does not (the default --keep_last 2 would need it).
    disk = small_disk(int(2.4 * size) // 4096 * 4096)
    out = disk / "out"
    proc = run_cli(RUN + ["--output_dir", str(out), "--save_every_steps", "2"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    removed = [l for l in proc.stdout.splitlines() if l.startswith("removed ") and "to make room" in l]
    assert removed and all("a newer checkpoint is kept" in l for l in removed), proc.stdout
    assert proc.stdout.count("\nsaved ") + proc.stdout.startswith("saved ") == len(saved)  # every save happened
    left = sorted(out.glob("*.pt"))
    assert saved[-1].name in [p.name for p in left]  # the epoch's end
    math = ("step", "loss", "grad_norm", "lr", "tokens")  # the same run, step for step
    assert [[m[k] for k in math] for m in read_jsonl(out / "metrics.jsonl")] == [
        [m[k] for k in math] for m in read_jsonl(tmp_path / "ref" / "metrics.jsonl")
    ]

    # The newest mid-epoch checkpoint on the small disk resumes exactly: the reference's losses, bit for bit.
    mid = max((p for p in left if "-step-" in p.name), key=lambda p: int(p.stem.rsplit("-", 1)[1]))
    at = int(mid.stem.rsplit("-", 1)[1])
    again = tmp_path / "again"
    again.mkdir()
    shutil.copy(mid, again / mid.name)
    resumed = run_cli(RUN + ["--output_dir", str(again), "--resume_file", mid.name], tmp_path)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    after = {m["step"]: m["loss"] for m in read_jsonl(again / "metrics.jsonl")}
    reference = {m["step"]: m["loss"] for m in read_jsonl(tmp_path / "ref" / "metrics.jsonl")}
    assert sorted(after) == [s for s in steps if s > at] and all(after[s] == reference[s] for s in after)


def test_the_save_stops_in_one_line_when_even_removing_is_not_enough(tmp_path, small_disk):
    disk = small_disk(8 * 2**20)  # smaller than one checkpoint of tiny-opt with its AdamW state
    proc = run_cli(RUN + ["--output_dir", str(disk / "out"), "--save_every_steps", "2"], tmp_path)
    assert proc.returncode != 0
    errors = [l for l in proc.stderr.splitlines() if l.startswith("error: ")]
    assert len(errors) == 1 and "cannot save" in errors[0] and "free there" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert not list((disk / "out").glob(".*tmp*"))  # no half-written file left
