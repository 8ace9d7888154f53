"""What the notebooks call: tokens from Kaggle's secrets, the GPU check, the session's time budget, the
torchrun command lines, and the plots and tables of a look back. Everything here is plain Python, so the
notebooks stay short and the tests can run each piece on its own.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fsdp_opt.runtime.gpus import describe, from_a_child_process, from_nvidia_smi
from fsdp_opt.tracking.metrics import EVAL_FILE, read_metrics
from fsdp_opt.tracking.scoretable import heading, series

SECRET_NAMES = ("HF_TOKEN", "WANDB_API_KEY")


def load_secrets(names: Iterable[str] = SECRET_NAMES) -> dict[str, str]:
    """Put Kaggle secrets into os.environ where the environment lacks them. Returns where each name came from
    ("environment", "kaggle secrets" or "missing"); never a value."""
    found: dict[str, str] = {}
    client = None
    try:
        from kaggle_secrets import UserSecretsClient  # only on Kaggle

        client = UserSecretsClient()
    except Exception:  # noqa: BLE001 - not on Kaggle
        pass
    for name in names:
        if os.environ.get(name):
            found[name] = "environment"
            continue
        value = None
        if client is not None:
            try:
                value = client.get_secret(name)
            except Exception:  # noqa: BLE001 - the secret is not attached to this notebook
                value = None
        if value:
            os.environ[name] = value
            found[name] = "kaggle secrets"
        else:
            found[name] = "missing"
    return found


def gpu_summary() -> str:
    """One line per GPU: name, memory, compute capability, bf16 or not; CUDA is never initialised in this kernel
    (fsdp_opt.runtime.gpus asks nvidia-smi or a short-lived process)."""
    import torch

    if not torch.cuda.is_available():  # asks the driver for a count; creates no context
        return "no CUDA GPU: training runs on CPU with gloo (use nproc = 2 or more for FSDP across processes)"
    return (
        "\n".join(describe(from_nvidia_smi() or from_a_child_process()))
        or "CUDA is available but no GPU could be described"
    )


def process_age_seconds() -> float:
    """Seconds since this process (the notebook kernel) started; 0 where /proc is not there."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


def time_limit(
    session_hours: float = 12.0, reserve_minutes: float = 30.0, started_seconds_ago: float | None = None
) -> str | None:
    """--time_limit for a launch now: what is left of the session, less a reserve for the last save and push.

    None when less than 5 minutes would be left: not worth a launch."""
    age = process_age_seconds() if started_seconds_ago is None else started_seconds_ago
    left = session_hours * 3600 - age - reserve_minutes * 60
    if left < 300:
        return None
    minutes = int(left // 60)
    return f"{minutes // 60}h{minutes % 60:02d}m"


def flags(**values: Any) -> list[str]:
    """--name value pairs; None is left out, True is a bare --name, lists give several values."""
    out: list[str] = []
    for name, value in values.items():
        if value is None or value is False:
            continue
        out.append(f"--{name}")
        if value is True:
            continue
        if isinstance(value, (list, tuple)):
            out.extend(str(v) for v in value)
        else:
            out.append(str(value))
    return out


def torchrun(nproc: int | str, target: str, args: list[str], module: bool = False) -> str:
    """A `torchrun --standalone` command line for a script or a module (`-m`), shell-quoted."""
    exe = shutil.which("torchrun")
    launcher = (
        ["torchrun"]
        if exe and Path(exe).parent == Path(sys.executable).parent
        else [sys.executable, "-m", "torch.distributed.run"]
    )
    cmd = (
        launcher + ["--standalone", f"--nproc_per_node={nproc}"] + (["-m", target] if module else [target]) + list(args)
    )
    return shlex.join(cmd)


def launch(nproc: int | str, args: list[str]) -> str:
    """The training command starting its own workers (`python -m fsdp_opt --nproc_per_node N`: fsdp_opt/runtime/launch.py),
    shell-quoted, with this kernel's Python: a failure ends with the tool's own line and exit code."""
    return shlex.join([sys.executable, "-m", "fsdp_opt", "--nproc_per_node", str(nproc), *args])


def python_module(module: str, args: list[str]) -> str:
    """`python -m module args`, shell-quoted, with this kernel's Python."""
    return shlex.join([sys.executable, "-m", module, *args])


def process_count(nproc: int | str) -> int:
    """How many processes torchrun starts for --nproc_per_node: "gpu" is one per visible GPU."""
    if str(nproc) == "gpu":
        import torch

        return max(1, torch.cuda.device_count())
    return int(nproc)


# ---------------------------------------------------------------- a look back


def slice_boundaries(records: list[dict[str, Any]]) -> list[tuple[int, str]]:
    """(first global step, slice) for each slice in the order trained."""
    out: list[tuple[int, str]] = []
    for r in records:
        name = r.get("slice")
        if name is not None and (not out or out[-1][1] != name):
            out.append((r["step"], name))
    return out


def plot_loss_curve(path: str | os.PathLike, png: str | os.PathLike | None = None, smooth: int = 20):
    """Loss per global step with a moving average, and a dashed line where each slice starts. Saves `png`."""
    import matplotlib

    if "ipykernel" not in sys.modules:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_step = {r["step"]: r for r in read_metrics(path)}  # a step logged again after a resume: the later one
    records = [by_step[k] for k in sorted(by_step)]
    steps = [r["step"] for r in records]
    losses = [r["loss"] for r in records]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.plot(steps, losses, lw=0.8, alpha=0.4, label="loss")
    smooth = max(2, min(smooth, len(losses) // 5))
    if len(losses) >= smooth:
        window = [sum(losses[i - smooth + 1 : i + 1]) / smooth for i in range(smooth - 1, len(losses))]
        ax.plot(steps[smooth - 1 :], window, lw=1.8, label=f"mean of {smooth} steps")
    for step, name in slice_boundaries(records):
        ax.axvline(step, color="grey", ls="--", lw=0.8)
        ax.annotate(
            "rows [{}, {})".format(*name.split("-")),
            (step, 1.0),
            xycoords=("data", "axes fraction"),
            rotation=90,
            va="top",
            ha="right",
            fontsize=8,
        )
    ax.set_xlabel("global step")
    ax.set_ylabel("training loss (token mean)")
    ax.legend(loc="upper right")
    fig.tight_layout()
    if png is not None:
        fig.savefig(png, dpi=120)
    return fig


def plot_benchmarks(output_dir: str | os.PathLike, png: str | os.PathLike | None = None):
    """--eval_tasks' scores in eval.jsonl: each lm-eval metric against the end row of the range trained when it was
    scored, a panel a metric (a point a save). None, with a line saying so, when the run scored none."""
    import json

    import matplotlib

    if "ipykernel" not in sys.modules:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(output_dir) / EVAL_FILE
    lines = path.read_text().splitlines() if path.exists() else []
    found = series([json.loads(line) for line in lines if line.strip()])
    if not found:
        print(f"no lm-eval scores in {path} (train with --eval_tasks)")
        return None
    fig, axes = plt.subplots(len(found), 1, figsize=(9, 2.6 * len(found)), squeeze=False)
    for ax, ((task, key), points) in zip(axes[:, 0], found.items()):
        ax.plot([x for x, _ in points], [y for _, y in points], marker="o", lw=1.2)
        ax.set_ylabel(heading(task, key), fontsize=8)
    axes[-1, 0].set_xlabel("rows trained (the range's end)")
    fig.tight_layout()
    if png is not None:
        fig.savefig(png, dpi=120)
    return fig
