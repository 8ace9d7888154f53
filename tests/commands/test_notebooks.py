"""The Kaggle notebooks: .py/.ipynb pairs in sync, and both executed with papermill on tiny-opt with 2 CPU ranks.
The Slurm launcher: bash syntax and its batch arithmetic."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from conftest import ROOT, read_jsonl, sandbox_env

NOTEBOOKS = ROOT / "notebooks"
PAIRS = ["01_train", "02_evaluate"]
PARAMETERS = {
    "model",
    "dataset",
    "range_size",
    "session_ranges",
    "num_epochs",
    "batch_size",
    "accum_steps",
    "hf_repo",
    "output_dir",
    "nproc",
}


@pytest.mark.parametrize("name", PAIRS)
def test_pair_in_sync(name):
    import jupytext

    source = jupytext.read(NOTEBOOKS / f"{name}.py")
    paired = jupytext.read(NOTEBOOKS / f"{name}.ipynb")
    assert [(c.cell_type, c.source) for c in source.cells] == [(c.cell_type, c.source) for c in paired.cells], (
        f"notebooks/{name}.py and .ipynb differ: run `jupytext --sync notebooks/{name}.py`"
    )
    first = paired.cells[0]
    assert first.cell_type == "code" and first.metadata.get("tags") == ["parameters"]
    assigned = {
        line.split("=")[0].strip() for line in first.source.splitlines() if "=" in line and not line.startswith("#")
    }
    assert PARAMETERS <= assigned
    if name == "01_train":  # the same cell every session: no row indices to edit
        assert not {"start_idx", "end_idx"} & assigned
    assert 'nproc = "gpu"' in first.source and "hf_repo = None" in first.source
    # The notebooks drive the package; they define no functions or classes of their own.
    for cell in paired.cells:
        if cell.cell_type == "code":
            assert not any(line.startswith(("def ", "class ")) for line in cell.source.splitlines()), cell.source


def run_notebook(name: str, tmp, parameters: dict, monkeypatch) -> dict:
    import papermill

    for key, value in sandbox_env(tmp, HF_TOKEN="hf_notebook-test-token").items():
        monkeypatch.setenv(key, value)
    out = tmp / f"{name}.out.ipynb"
    papermill.execute_notebook(
        str(NOTEBOOKS / f"{name}.ipynb"),
        str(out),
        parameters=parameters,
        cwd=str(tmp),
        kernel_name="python3",
        progress_bar=False,
        execution_timeout=600,
    )
    return json.loads(out.read_text())


def cell_text(nb: dict) -> str:
    parts = []
    for cell in nb["cells"]:
        for o in cell.get("outputs", []):
            parts.append("".join(o.get("text", "")))
            for mime, data in o.get("data", {}).items():
                if mime.startswith("text/"):
                    parts.append("".join(data))
    return "\n".join(parts)


def test_notebooks_run_end_to_end(tmp_path, monkeypatch):
    common = {
        "model": "tiny-opt",
        "dataset": "python-docs",
        "range_size": 40,
        "num_epochs": 1,
        "batch_size": 2,
        "accum_steps": 1,
        "hf_repo": None,
        "output_dir": str(tmp_path / "out"),
        "nproc": 2,
        "repo_dir": str(ROOT),
        "max_length": 64,
        "extra_flags": "--lr 3e-3 --eval_rows 8",
    }
    # Session 1: the range of range_size rows the chain starts with.
    train = run_notebook("01_train", tmp_path, common, monkeypatch)
    text = cell_text(train)
    assert "{'HF_TOKEN': 'environment', 'WANDB_API_KEY': 'missing'}" in text
    assert "hf_notebook-test-token" not in (tmp_path / "01_train.out.ipynb").read_text()
    assert "--time_limit" in text and "--start_idx auto --range_size 40" in text
    assert "tiny-opt: 1,383,424 parameters" in text and "| **total** |" in text  # the plan
    assert "the chain starts with rows [0, 40)" in text
    # The next session with the notebook's default range_size (5000): the rest of the data, [40, 754).
    rest = {k: v for k, v in common.items() if k != "range_size"} | {"batch_size": 16}
    again = cell_text(run_notebook("01_train", tmp_path, rest, monkeypatch))
    assert "going on with rows [40, 754)" in again and "ranges done 1; range now [40, 754)" in again
    metrics = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    slices = [m["slice"] for m in metrics]
    first = slices.count("0-40")
    assert first > 0 and slices == ["0-40"] * first + ["40-754"] * (len(slices) - first) and len(slices) > first
    assert [m["step"] for m in metrics] == list(range(1, len(metrics) + 1))
    png = tmp_path / "out" / "loss_curve.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    png.unlink()

    # Notebook 02 after it, with its default rows: no rows follow the range, so it evaluates on the test split. One
    # process (the evaluation on two ranks has its own tests in tests/train/test_evaluate.py).
    evaluation = run_notebook(
        "02_evaluate",
        tmp_path,
        {**rest, "nproc": 1, "max_new_tokens": 5, "extra_flags": "--num_prompts 2 --max_length 64"},
        monkeypatch,
    )
    report = json.loads((tmp_path / "out" / "eval_results.json").read_text())
    assert report["split"] == "split test" and report["rows"] == "[0, 200)"
    assert [m["name"] for m in report["models"]] == ["base (tiny-opt)", "tiny_opt_40-754-epoch-1.pt"]
    shown = cell_text(evaluation)
    for m in report["models"]:
        assert f"| {m['name']} | {m['loss']:.4f} | {m['perplexity']:.2f} |" in shown
    assert f"**Prompt:** {report['samples'][0]['prompt']}" in shown
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


SLURM = ROOT / "scripts" / "slurm_submit.sh"


def slurm(args: list[str], **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "FSDP_OPT_DRY_RUN": "1", "MASTER_ADDR": "node-a", **env}
    return subprocess.run(["bash", str(SLURM), *args], env=full, capture_output=True, text=True, timeout=60)


def test_slurm_script_syntax_and_arithmetic():
    assert subprocess.run(["bash", "-n", str(SLURM)], capture_output=True).returncode == 0
    for nodes, gpus, per_gpu, total in [(1, 1, 4, 64), (1, 8, 4, 128), (2, 8, 4, 512), (4, 8, 2, 64), (3, 2, 1, 6)]:
        proc = slurm(
            ["--total_batch_size", str(total), "--batch_size", str(per_gpu), "--model", "facebook/opt-1.3b"],
            SLURM_JOB_NUM_NODES=str(nodes),
            GPUS_PER_NODE=str(gpus),
            SLURM_JOB_ID="77",
        )
        assert proc.returncode == 0, proc.stderr
        accum = total // (per_gpu * nodes * gpus)
        assert accum * per_gpu * nodes * gpus == total
        command = proc.stdout.splitlines()[-1].split()
        assert command[:2] == ["srun", "--ntasks-per-node=1"]

        def value(flag):
            return command[command.index(flag) + 1]

        assert value("--nnodes") == str(nodes) and value("--nproc_per_node") == str(gpus)
        assert value("--accum_steps") == str(accum) and value("--batch_size") == str(per_gpu)
        assert value("--rdzv_endpoint") == "node-a:29500" and value("--rdzv_id") == "77"
        assert value("--model") == "facebook/opt-1.3b"
    bad = slurm(["--total_batch_size", "500", "--batch_size", "4"], SLURM_JOB_NUM_NODES="2", GPUS_PER_NODE="8")
    assert bad.returncode == 2 and bad.stderr.strip() == (
        "error: --total_batch_size 500 is not a multiple of --batch_size 4 x 16 GPUs (2 nodes x 8) = 64; use 448 or 512"
    )
    assert slurm(["--batch_size", "4"], GPUS_PER_NODE="1").stderr.startswith("error: --total_batch_size is required")
    assert "computes it" in slurm(["--total_batch_size", "8", "--accum_steps", "2"], GPUS_PER_NODE="1").stderr
