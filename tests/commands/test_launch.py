"""`python -m fsdp_opt --nproc_per_node N`, the README's command: the training command starting its own workers
(torch's elastic launch, as torchrun does) and ending as the tool ends. A bad reward function, a mixture changed
mid-chain and a missing dataset: the last line on the screen (stdout and stderr as one) is the tool's one line, the
exit code is 2, and the output folder holds nothing new. Under torchrun the same failure, and a flag typed wrong,
end with torchrun's own report and then the tool's line, last; a clean run and its resume command are the same as torchrun's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import ROOT, run_cli, sandbox_env

PROMPT_FLAGS = [
    "--model",
    "tiny-opt",
    "--dataset",
    "python-docs-prompts",
    "--chat_template",
    "chatml",
    "--method",
    "grpo",
    "--num_generations",
    "2",
    "--max_completion_length",
    "8",
    "--max_length",
    "128",
    "--end_idx",
    "8",
    "--batch_size",
    "2",
    "--device",
    "cpu",
]
MIXTURE = "datasets:\n  - path: a.jsonl\n    weight: 0.5\n  - path: b.jsonl\n    weight: 0.5\n"


def screen(args: list[str], cwd: Path, launcher: list[str]) -> subprocess.CompletedProcess:
    """A real launch (not forked: the launcher is what is tested), stdout and stderr in the order they came."""
    return subprocess.run(
        [*launcher, *args],
        cwd=cwd,
        env=sandbox_env(cwd),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )


def files_under(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) if folder.exists() else []


def test_a_user_error_is_the_last_line_on_the_screen(tmp_path):
    (tmp_path / "bad.py").write_text("def boom(completions, **kwargs):\n    raise ValueError('no rule for this one')\n")
    for name, weight in (("a", "alpha"), ("b", "beta")):
        rows = "".join(
            f'{{"text": "{weight} row {i} of the mixture, a sentence long enough to train on"}}\n' for i in range(40)
        )
        (tmp_path / f"{name}.jsonl").write_text(rows)
    (tmp_path / "mix.yaml").write_text(MIXTURE)
    mixed = [
        "--model",
        "tiny-opt",
        "--dataset",
        "mix.yaml",
        "--start_idx",
        "auto",
        "--range_size",
        "16",
        "--max_length",
        "64",
        "--batch_size",
        "2",
        "--device",
        "cpu",
        "--wandb_mode",
        "offline",
        "--output_dir",
        "chain",
    ]
    first = run_cli(mixed, tmp_path, nproc=2)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    (tmp_path / "mix.yaml").write_text(MIXTURE.replace("0.5\n  - path: b", "0.6\n  - path: b"))
    chain_before = files_under(tmp_path / "chain")
    ours = [sys.executable, "-m", "fsdp_opt", "--nproc_per_node", "2"]
    cases = {
        "reward": (
            PROMPT_FLAGS + ["--reward", "bad.py:boom", "--output_dir", "grpo"],
            "grpo",
            "error: --reward bad.py:boom: it raised on row ",
        ),
        "mixture": (
            mixed,
            "chain",
            "error: --dataset mix.yaml: the mixture is not the one this chain trained on: its "
            "weights changed (1:1 -> 6:5)",
        ),
        "dataset": (
            ["--model", "tiny-opt", "--dataset", "nowhere.jsonl", "--device", "cpu", "--output_dir", "gone"],
            "gone",
            "error: --dataset nowhere.jsonl: no such file or folder",
        ),
    }
    for name, (args, out, needle) in cases.items():
        before = files_under(tmp_path / out)
        proc = screen(args, tmp_path, ours)
        lines = [line for line in proc.stdout.splitlines() if line.strip()]
        assert proc.returncode == 2, (name, proc.stdout[-3000:])
        assert lines[-1].startswith(needle), (name, lines[-8:])
        assert "Traceback" not in proc.stdout and "ChildFailedError" not in proc.stdout, (name, proc.stdout[-3000:])
        assert files_under(tmp_path / out) == before, name  # no checkpoint, no metrics, no W&B run folder, no lease
        if name == "mixture":  # refused before the chain's lease and the data's own lines
            assert not [line for line in lines if line.startswith(("chain:", "data:"))], lines
    assert chain_before == files_under(tmp_path / "chain")
    # torchrun itself (its own script), on the same missing dataset and on a flag typed wrong: its report (a
    # traceback, ChildFailedError, the "Root Cause" table naming the worker's line), exit 1, then the tool's line, last
    torchrun = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc_per_node=2"]
    for args, needle in (
        ([*torchrun, "-m", "fsdp_opt", *cases["dataset"][0]], cases["dataset"][2]),
        ([*torchrun, str(ROOT / "fsdp_finetune.py"), "--batch_size", "many"], "error: argument --batch_size: "),
    ):
        theirs = screen(args, tmp_path, [])
        lines = theirs.stdout.strip().splitlines()
        assert theirs.returncode == 1 and "ChildFailedError" in theirs.stdout, theirs.stdout[-3000:]
        assert lines[-1].startswith(needle) and f"traceback : {lines[-1]}" in theirs.stdout, lines[-12:]


def test_a_clean_run_and_a_stopped_ones_resume_command(tmp_path):
    """Two workers train and save, exit 0; a --time_limit stop prints a resume command in the same form, which
    resumes."""
    args = [
        "--model",
        "tiny-opt",
        "--dataset",
        "python-docs",
        "--end_idx",
        "400",
        "--batch_size",
        "2",
        "--max_length",
        "64",
        "--device",
        "cpu",
        "--wandb_mode",
        "disabled",
        "--output_dir",
        "out",
        "--time_limit",
        "4s",
    ]
    proc = screen(args, tmp_path, [sys.executable, "-m", "fsdp_opt", "--nproc_per_node", "2"])
    assert proc.returncode == 0, proc.stdout[-3000:]
    command = proc.stdout.split("resume with:\n", 1)[1].splitlines()[0].strip()
    assert command.startswith("python -m fsdp_opt --nproc_per_node 2 --model tiny-opt"), command
    assert "--resume_file tiny_opt_0-400-epoch-1-step-" in command and (ROOT / "fsdp_opt").exists()
