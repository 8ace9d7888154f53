"""A CPU run's step with the host allocator's threshold the package sets on a CPU device (32 MiB) against the
threshold it sets for a GPU run (1 MiB), side by side in one run.

    python benchmarks/allocator.py --rounds 2 --json allocator.json

Each launch is the plain demo's training (tiny-opt on python-docs, 2 CPU ranks under torchrun, the demo's flags and
its two epochs). The 1 MiB launches set `MALLOC_MMAP_THRESHOLD_=1048576`, which the package leaves in place (a threshold set
by the user wins), so both arms run the same code. The arms alternate, round by round, each run alone and then as two
launches at once (a CPU shared with another job, as a test suite's two workers share it). Reported per arm and way:
the trainer's own step time (its "step time: measured" line, the median over a launch's steps), the wall time, the
CPU seconds the processes spent in user and system mode, the peak host RAM of each rank; and whether every launch
ended at the same loss (the threshold moves no number).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fsdp_opt.commands.demo import DEMO_ARGS  # noqa: E402 - after the repository is on the path
from fsdp_opt.tracking.metrics import read_metrics  # noqa: E402

ARMS = {"32 MiB (CPU device)": None, "1 MiB (GPU runs)": "1048576"}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2, help="launches per arm, alternating")
    p.add_argument("--end_idx", type=int, default=754, help="rows of python-docs a launch trains in an epoch")
    p.add_argument("--num_epochs", type=int, default=2, help="epochs a launch trains (the demo's 2)")
    p.add_argument("--ways", default="1,2", help="launches at once, one way per number (1: alone; 2: two at once)")
    p.add_argument("--json", default=None, help="write the results here too")
    return p.parse_args(argv)


def command(threshold: str | None, out: Path, end_idx: int, epochs: int) -> tuple[list[str], dict[str, str]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "WANDB_", "MALLOC_"))}
    env.update(WANDB_MODE="disabled", HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    if threshold is not None:
        env["MALLOC_MMAP_THRESHOLD_"] = threshold
    args = list(DEMO_ARGS)
    args[args.index("--num_epochs") + 1] = str(epochs)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(ROOT / "fsdp_finetune.py"),
        *args,
        "--end_idx",
        str(end_idx),
        "--device",
        "cpu",
        "--output_dir",
        str(out),
    ]
    return cmd, env


def launch(threshold: str | None, out: Path, end_idx: int, epochs: int, together: int) -> dict:
    """`together` launches of one arm at once (2: as beside another job, or a test suite's second worker): the step
    time of each, the wall time of all, and the CPU seconds of all their processes."""
    procs = []
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    out.mkdir(parents=True)
    for k in range(together):  # output to files: a pipe left unread while another launch is waited on would stall it
        cmd, env = command(threshold, out / str(k), end_idx, epochs)
        with open(out / f"{k}.log", "w") as log:
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True))
    codes = [p.wait() for p in procs]
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    steps, peaks, losses = [], [], []
    for k, code in enumerate(codes):
        text = (out / f"{k}.log").read_text()
        if code != 0:
            sys.exit(f"allocator benchmark: a launch failed:\n{text[-4000:]}")
        steps.append(float(re.search(r"step time: measured ([\d.]+) s", text).group(1)))
        peaks.append([float(x) for x in re.search(r"host RAM peak per rank: ([\d., ]+) GiB", text).group(1).split(",")])
        losses.append(read_metrics(out / str(k))[-1]["loss"])
    return {
        "step_s": statistics.median(steps),
        "wall_s": wall,
        "user_s": after.ru_utime - before.ru_utime,
        "sys_s": after.ru_stime - before.ru_stime,
        "peak_rss_gib": [max(x[r] for x in peaks) for r in range(2)],
        "losses": losses,
    }


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    modes = {"alone" if n == 1 else f"{n} at once": n for n in map(int, args.ways.split(","))}
    runs: dict[str, dict[str, list[dict]]] = {name: {m: [] for m in modes} for name in ARMS}
    with tempfile.TemporaryDirectory(prefix="bench-alloc-") as tmp:
        for r in range(args.rounds):
            for mode, together in modes.items():
                for i, (name, threshold) in enumerate(ARMS.items()):
                    out = Path(tmp) / f"r{r}-{together}-{i}"
                    runs[name][mode].append(launch(threshold, out, args.end_idx, args.num_epochs, together))
    arms = {
        name: {
            mode: {key: statistics.median(x[key] for x in rs) for key in ("step_s", "wall_s", "user_s", "sys_s")}
            | {"peak_rss_gib": [max(x["peak_rss_gib"][k] for x in rs) for k in range(2)], "launches": rs}
            for mode, rs in by_mode.items()
        }
        for name, by_mode in runs.items()
    }
    cpu, gpu = arms.values()
    losses = {loss for by_mode in runs.values() for rs in by_mode.values() for x in rs for loss in x["losses"]}
    report = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "arms": arms,
        "step_ratio": {m: gpu[m]["step_s"] / cpu[m]["step_s"] for m in modes},
        "wall_ratio": {m: gpu[m]["wall_s"] / cpu[m]["wall_s"] for m in modes},
        "same_losses": len(losses) == 1,
    }
    print("| threshold | way | step (median) | wall | user CPU s | system CPU s | peak RSS per rank |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, by_mode in arms.items():
        for mode, a in by_mode.items():
            peaks = ", ".join(f"{p:.2f}" for p in a["peak_rss_gib"])
            print(
                f"| {name} | {mode} | {a['step_s']:.3f} s | {a['wall_s']:.1f} s | {a['user_s']:.1f} | {a['sys_s']:.1f} "
                f"| {peaks} GiB |"
            )
    for m in modes:
        print(f"1 MiB / 32 MiB, {m}: step time {report['step_ratio'][m]:.2f}, wall {report['wall_ratio'][m]:.2f}")
    print(f"the same last loss in every launch: {report['same_losses']}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
