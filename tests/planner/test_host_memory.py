"""Host RAM across a session, measured per phase on 2 CPU ranks: a resume holds no more than a fresh start, the
resumed checkpoint is released, and `fsdp_opt.planner.host` predicts every phase.

The model has opt-1.3b's vocabulary on a small body, so the checkpoint (12 bytes per parameter, 0.2 GB) is a
large share of each process: a resume that kept it would peak about a quarter higher than a fresh start.
"""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
from conftest import ROOT, built_once, make_local_model, sandbox_env, torchrun_cmd

from fsdp_opt.model.shapes import Shape, model_config
from fsdp_opt.planner.host import IMPORTS_BYTES, host_memory
from fsdp_opt.planner.inputs import Inputs

SHAPE = dict(
    hidden_size=256,
    ffn_dim=1024,
    num_hidden_layers=4,
    num_attention_heads=4,
    vocab_size=50272,
    word_embed_proj_dim=256,
    dropout=0.0,
)
BATCH, LENGTH = 2, 64


@pytest.fixture(scope="module")
def wide_vocab_model(tmp_path_factory):
    # one folder for every worker: the fresh session's checkpoint, shared too, names the model it trained
    return (
        built_once(tmp_path_factory, "wide_vocab", lambda d: make_local_model(d / "wide-vocab", **SHAPE)) / "wide-vocab"
    )


def run_phases(tmp, name: str, load: str, flags: list[str]) -> list[dict]:
    out = tmp / f"{name}.json"
    cmd = torchrun_cmd(2, ROOT / "tests" / "workers" / "host_phases.py") + [str(out), load] + flags
    proc = subprocess.run(cmd, cwd=tmp, env=sandbox_env(tmp), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return [json.loads((tmp / f"{name}.json.rank{r}").read_text()) for r in range(2)]


def session_flags(model, out) -> list[str]:
    return [
        "--model",
        str(model),
        "--dataset",
        "python-docs",
        "--end_idx",
        "60",
        "--max_length",
        str(LENGTH),
        "--batch_size",
        str(BATCH),
        "--precision",
        "fp32",
        "--output_dir",
        str(out),
        "--keep_last",
        "0",
    ]


@pytest.fixture(scope="module")
def fresh_session(tmp_path_factory, wide_vocab_model):
    """A fresh session's phases (the load mode plays no part without a checkpoint to resume) and its outputs."""

    def build(tmp) -> None:
        run_phases(tmp, "fresh", "slices", session_flags(wide_vocab_model, tmp / "out"))

    tmp = built_once(tmp_path_factory, "fresh_session", build)
    return [json.loads((tmp / f"fresh.json.rank{r}").read_text()) for r in range(2)], tmp / "out"


@pytest.mark.parametrize("load", ["slices", "broadcast"])
def test_resume_releases_the_checkpoint_and_the_plan_predicts_each_phase(
    tmp_path, wide_vocab_model, fresh_session, load
):
    """slices: one machine, every rank reads its own part of the file. broadcast: rank 0 reads it all and sends it,
    as across machines without a shared filesystem."""
    fresh, fresh_out = fresh_session
    shutil.copytree(fresh_out, tmp_path / "out")
    flags = session_flags(wide_vocab_model, tmp_path / "out")
    resumed = run_phases(tmp_path, "resumed", load, flags + ["--resume_file", "latest"])

    for rank, (f, r) in enumerate(zip(fresh, resumed)):
        assert r["mapped_after_setup"] == [], f"rank {rank} still maps {r['mapped_after_setup']}"
        fresh_peak, resumed_peak = (max(x["setup"], x["step"], x["save"]) for x in (f, r))
        # On a CPU device blocks below 32 MiB stay in the heap, and where they land moves a phase's peak by up to
        # 2.5% from one run to the next (rank 1's step: 831-872 MB over three runs), so two runs differ by up to 5%.
        assert resumed_peak <= 1.10 * fresh_peak, (rank, f, r)

    shape = Shape.of(model_config(str(wide_vocab_model)))
    # The plan takes several machines to mean the broadcast load (no shared filesystem assumed).
    nodes = 2 if load == "broadcast" else 1
    inputs = Inputs(
        gpus=2, nodes=nodes, batch_size=BATCH, max_length=LENGTH, accum_steps=1, precision="fp32", cuda=False
    )
    plan = host_memory(shape, "FULL_SHARD", inputs)
    measured = {
        ("rank0", "start"): fresh[0]["setup"],
        ("other", "start"): fresh[1]["setup"],
        ("rank0", "resume"): resumed[0]["setup"],
        ("other", "resume"): resumed[1]["setup"],
        ("rank0", "step"): fresh[0]["step"],
        ("other", "step"): fresh[1]["step"],
        ("rank0", "save"): fresh[0]["save"],
        ("other", "save"): fresh[1]["save"],
    }
    # The process before setup (Python, torch, the process group) is the machine's: the plan's figure for it holds to
    # 20%, and each phase is checked on top of the size measured here, to 10%.
    process = max(x["process"] for x in fresh)
    assert abs(process / IMPORTS_BYTES - 1) < 0.20, (process, IMPORTS_BYTES)
    shift = process - IMPORTS_BYTES
    table = {
        k: (plan[k[0]][k[1]] + shift, got, round((plan[k[0]][k[1]] + shift) / got - 1, 3))
        for k, got in measured.items()
    }
    off = {f"{who} {phase}": row for (who, phase), row in table.items() if abs(row[2]) > 0.10}
    assert not off, f"phases off the plan by more than 10%: {off}; all: {table}"
    # The checks above can see a leak: a checkpoint kept after the resume would add its 12 bytes a parameter to the
    # later phases, more than the 10% a resumed peak may exceed a fresh one by plus the 5% two runs differ by
    # (about 20% of either rank's peak here: 194 MB against peaks of 0.95-0.98 GB).
    assert 12 * shape.params > 0.15 * max(max(x["setup"], x["step"], x["save"]) for x in fresh)
