"""The minutes around training, at a real model shape on this machine, each next to its floor; and a prediction of
the same minutes for opt-1.3b on Kaggle.

    python benchmarks/session.py --shape facebook/opt-350m --nproc 2 --json session.json

A model of the shape is built locally with random weights. Two sessions run under torchrun, as a user chains
them, against a loopback stand-in of the Hub (tests/hubserver.py, objects on this disk, the real huggingface_hub
client): a fresh one on rows [0, R), then one on an empty "machine" (new output folder, new Hub cache) that resumes
`latest` from the Hub on rows [R, 2R). Measured: launch to the first step, the save, the push (the checkpoint and
its weights file), the download, host peak RSS per rank (and the plan's figure), bytes written and read.

Floors, measured in the same run on the same disk (dd-style, 8 MiB blocks): writing the bytes once (with fsync)
for a save; copying them once (read + write) for a push or a download on one machine; reading them once for a
resume's load. The Kaggle prediction takes opt-1.3b's sizes from the plan, the stated link speeds (flags), and
this machine's measured-over-floor ratio for each stage.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

TOKEN = "hf_benchmark-token-for-the-loopback-hub-0000"
BLOCK = 8 * 2**20


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="facebook/opt-350m", help="an OPT size built with random weights, or tiny-opt")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument(
        "--rows", type=int, default=6, help="rows per session (a few steps: the minutes around training are measured)"
    )
    p.add_argument("--max_length", type=int, default=128)
    p.add_argument("--batch_size", type=int, default=1)
    p.add_argument(
        "--workdir", default=None, help="keep the model, checkpoints and Hub objects here (default: a temporary folder)"
    )
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument(
        "--kaggle_disk_mbps", type=float, default=250.0, help="assumed write and read rate of /kaggle/working"
    )
    p.add_argument("--kaggle_upload_mbps", type=float, default=100.0, help="assumed upload rate from Kaggle to the Hub")
    p.add_argument(
        "--kaggle_download_mbps", type=float, default=200.0, help="assumed download rate from the Hub to Kaggle"
    )
    return p.parse_args(argv)


# ---------------------------------------------------------------- floors


def write_floor(path: Path, nbytes: int) -> float:
    """Seconds to write `nbytes` once in 8 MiB blocks and fsync."""
    block = os.urandom(BLOCK)
    started = time.perf_counter()
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            f.write(block[: min(left, BLOCK)])
            left -= BLOCK
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - started


def read_floor(path: Path) -> float:
    started = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(BLOCK):
            pass
    return time.perf_counter() - started


def copy_floor(src: Path, dest: Path) -> float:
    started = time.perf_counter()
    with open(src, "rb") as a, open(dest, "wb") as b:
        while chunk := a.read(BLOCK):
            b.write(chunk)
        b.flush()
        os.fsync(b.fileno())
    return time.perf_counter() - started


def import_floor(modules: str) -> float:
    """Seconds a fresh interpreter takes to import `modules` (the least a launch pays before any work)."""
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", f"import {modules}"], check=True)
    return time.perf_counter() - started


def floors(workdir: Path, nbytes: int) -> dict[str, float]:
    a, b = workdir / "floor-a.bin", workdir / "floor-b.bin"
    try:
        out = {"bytes": nbytes, "write_s": write_floor(a, nbytes)}
        out["read_s"] = read_floor(a)
        out["copy_s"] = copy_floor(a, b)
    finally:
        a.unlink(missing_ok=True)
        b.unlink(missing_ok=True)
    # torchrun imports torch, then each worker imports the libraries training needs.
    out["launcher_import_s"] = import_floor("torch.distributed.run")
    out["worker_import_s"] = import_floor("torch, transformers, datasets")
    return out


# ---------------------------------------------------------------- sessions


def build_model(shape: str, dest: Path) -> Path:
    """A local model folder of `shape` with random weights and the built-in tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    from fsdp_opt.model.shapes import model_config
    from fsdp_opt.model.sources import ASSETS

    if (dest / "config.json").exists():
        return dest
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(model_config(shape))
    model.save_pretrained(dest)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ASSETS / "tiny-opt" / name, dest / name)
    return dest


def run_session(
    args: argparse.Namespace,
    model: Path | str,
    hub_url: str,
    workdir: Path,
    name: str,
    start: int,
    resume: bool,
    async_save: bool,
) -> dict:
    """One session under torchrun; its output lines timestamped, its first metrics line watched."""
    out_dir = workdir / name
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "WANDB_", "RANK", "WORLD_SIZE", "MASTER_"))}
    env.update(
        HF_ENDPOINT=hub_url,
        HF_TOKEN=TOKEN,
        HF_HUB_DISABLE_XET="1",
        HF_HOME=str(workdir / f"hf_home_{name}"),
        WANDB_MODE="disabled",
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(ROOT),
        PYTHONUNBUFFERED="1",
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={args.nproc}",
        str(ROOT / "fsdp_finetune.py"),
        "--model",
        str(model),
        "--dataset",
        "python-docs",
        "--start_idx",
        str(start),
        "--end_idx",
        str(start + args.rows),
        "--max_length",
        str(args.max_length),
        "--batch_size",
        str(args.batch_size),
        "--precision",
        "fp32",
        "--hf_repo",
        "bench/run",
        "--output_dir",
        str(out_dir),
        "--keep_last",
        "0",
        "--async_save",
        str(async_save).lower(),
    ]
    if resume:
        cmd += ["--resume_file", "latest"]
    lines: list[tuple[float, str]] = []
    first_metrics: list[float] = []
    launched = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def watch_metrics() -> None:
        # The first line of this session's own slice (a resumed session also fetches earlier lines from the Hub).
        path, mine = out_dir / "metrics.jsonl", f'"slice": "{start}-{start + args.rows}"'
        while proc.poll() is None and not first_metrics:
            if path.exists() and mine in path.read_text():
                first_metrics.append(time.perf_counter())
            time.sleep(0.02)

    watcher = threading.Thread(target=watch_metrics, daemon=True)
    watcher.start()
    for raw in proc.stdout:
        for line in raw.replace("\r", "\n").split("\n"):
            if line.strip():
                lines.append((time.perf_counter() - launched, line.strip()))
    proc.wait()
    ended = time.perf_counter() - launched
    if proc.returncode != 0:
        errors = [line for _, line in lines if line.startswith("error:")]
        tail = "\n".join(errors or [line for _, line in lines[-30:]])
        raise SystemExit(f"session {name} failed ({proc.returncode}):\n{tail}")
    return summarize(lines, first_metrics[0] - launched if first_metrics else None, ended, out_dir)


def _find(lines: list[tuple[float, str]], pattern: str) -> tuple[float, re.Match] | None:
    for t, line in lines:
        m = re.search(pattern, line)
        if m:
            return t, m
    return None


def summarize(lines: list[tuple[float, str]], first_metrics_s: float | None, ended: float, out_dir: Path) -> dict:
    from fsdp_opt.tracking.metrics import read_metrics

    rows = read_metrics(out_dir)
    slice_rows = [r for r in rows if r["slice"] == rows[-1]["slice"]]
    first = slice_rows[0]
    step_s = first["tokens"] / first["tokens_per_second"] if first["tokens_per_second"] else 0.0
    out: dict = {
        "end_s": ended,
        "steps": len(slice_rows),
        "first_step_s": step_s,
        "median_step_s": sorted(r["tokens"] / r["tokens_per_second"] for r in slice_rows)[len(slice_rows) // 2],
    }
    if first_metrics_s is not None:
        out["launch_to_first_step_s"] = first_metrics_s - step_s  # the first step starts this long after launch
    saved = _find(lines, r"^saved (\S+) \(([\d,.]+) MiB in ([\d.]+) s(?:; training waited ([\d.]+) s of it)?\)")
    if saved:
        out["save_bytes"] = Path(saved[1].group(1)).stat().st_size
        out["save_s"] = float(saved[1].group(3))
        out["save_training_waited_s"] = float(saved[1].group(4)) if saved[1].group(4) else out["save_s"]
    pushed = _find(
        lines,
        r"hub: pushed \S+ to \S+ \(.*?\): ([\d,.]+) GB in ([\d.]+) s \(its weights file made first in ([\d.]+) s\)",
    )
    if pushed:
        out["push_bytes"] = float(pushed[1].group(1).replace(",", "")) * 1e9
        out["push_s"] = float(pushed[1].group(2))
        out["weights_file_s"] = float(pushed[1].group(3))
    down = _find(lines, r"^downloaded (\S+): [\d,.]+ GB in ([\d.]+) s")
    if down:
        out["download_bytes"] = (out_dir / down[1].group(1)).stat().st_size  # the line rounds to 10 MB
        out["download_s"] = float(down[1].group(2))
    loaded = _find(lines, r"checkpoint found and read in ([\d.]+) s, loaded into the shards in ([\d.]+) s")
    if loaded:
        # Finding it (with the download, measured on its own above) and reading it; then each rank's slices copied.
        out["resume_read_s"] = float(loaded[1].group(1)) - out.get("download_s", 0.0)
        out["resume_load_s"] = out["resume_read_s"] + float(loaded[1].group(2))
    peaks = _find(lines, r"host RAM peak per rank: ([\d., ]+) GiB")
    if peaks:
        out["peak_rss_gib"] = [float(x) for x in peaks[1].group(1).split(",")]
    return out


def stage_floors(fresh: dict, resumed: dict, floor: dict, params: int, model: Path | str) -> dict[str, dict]:
    """Each measured stage with its bytes and its floor on this disk: write once, read once, or copy once."""
    rate = {k: floor["bytes"] / floor[f"{k}_s"] for k in ("write", "read", "copy")}  # bytes per second
    model_bytes = (
        sum(f.stat().st_size for f in Path(model).glob("*.safetensors")) if Path(model).is_dir() else 4 * params
    )
    imports = floor["launcher_import_s"] + floor["worker_import_s"]
    stages = {
        "save, in place (fresh)": (
            fresh["save_s"],
            fresh["save_bytes"],
            fresh["save_bytes"] / rate["write"],
            "write once",
        ),
        "save, in the background (resumed): training waited": (
            resumed["save_training_waited_s"],
            resumed["save_bytes"],
            resumed["save_bytes"] / rate["write"],
            "write once",
        ),
        "weights file for the Hub (read fp32, write fp16)": (
            fresh["weights_file_s"],
            6 * params,
            4 * params / rate["read"] + 2 * params / rate["write"],
            "read + write once",
        ),
        "push to the Hub stand-in (checkpoint + weights file)": (
            fresh["push_s"],
            fresh["push_bytes"],
            fresh["push_bytes"] / rate["copy"],
            "copy once",
        ),
        "download on a fresh machine": (
            resumed["download_s"],
            resumed["download_bytes"],
            resumed["download_bytes"] / rate["copy"],
            "copy once",
        ),
        "resume: read and load the checkpoint": (
            resumed["resume_load_s"],
            resumed["save_bytes"],
            resumed["save_bytes"] / rate["read"],
            "read once",
        ),
        "launch to the first step (fresh)": (
            fresh["launch_to_first_step_s"],
            model_bytes,
            imports + model_bytes / rate["read"],
            "imports + read the model",
        ),
        "launch to the first step (resumed, with the download)": (
            resumed["launch_to_first_step_s"],
            resumed["download_bytes"],
            imports + resumed["download_bytes"] / rate["copy"] + resumed["save_bytes"] / rate["read"],
            "imports + download + read",
        ),
    }
    return {k: {"measured_s": m, "bytes": b, "floor_s": f, "floor": what} for k, (m, b, f, what) in stages.items()}


def plan_host(shape: str, args: argparse.Namespace) -> dict:
    from fsdp_opt.model.shapes import Shape, model_config
    from fsdp_opt.planner.host import host_memory
    from fsdp_opt.planner.inputs import Inputs

    s = Shape.of(model_config(shape))
    inputs = Inputs(
        gpus=args.nproc,
        batch_size=args.batch_size,
        max_length=args.max_length,
        accum_steps=1,
        precision="fp32",
        cuda=False,
    )
    host = host_memory(s, "FULL_SHARD", inputs)
    gib = 2**30
    return {
        "params": s.params,
        "fresh": [host["peak_fresh"]["rank0"] / gib] + [host["peak_fresh"]["other"] / gib] * (args.nproc - 1),
        "resumed": [host["peak_resumed"]["rank0"] / gib] + [host["peak_resumed"]["other"] / gib] * (args.nproc - 1),
    }


# ---------------------------------------------------------------- Kaggle


def kaggle_prediction(args: argparse.Namespace, stages: dict[str, dict]) -> dict:
    """opt-1.3b on 2xT4: each stage's bytes at the stated link speed, times this machine's measured/floor ratio.

    The background save's ratio is training's wait (the gather) over the disk floor, so on Kaggle it stands for the
    same share of the write that training does not wait for; a GPU's gather moves over PCIe, not gloo, so it is an
    upper bound there. The resume is not a ratio: its floor here is a read from the page cache (the file was just
    written or downloaded), so on Kaggle it is the file read once at the disk rate plus the work beyond that read
    measured here (copying the slices into the shards), scaled by the bytes."""
    ratios = {k: v["measured_s"] / v["floor_s"] for k, v in stages.items()}
    from fsdp_opt.base import GIB
    from fsdp_opt.model.shapes import Shape, model_config
    from fsdp_opt.planner.host import host_memory
    from fsdp_opt.planner.inputs import Inputs

    shape = Shape.of(model_config("facebook/opt-1.3b"))
    full, weights = 12 * shape.params, 2 * shape.params
    disk, up, down = (x * 1e6 for x in (args.kaggle_disk_mbps, args.kaggle_upload_mbps, args.kaggle_download_mbps))
    host = host_memory(
        shape, "FULL_SHARD", Inputs(gpus=2, batch_size=4, max_length=512, accum_steps=16, precision="fp16")
    )
    waited = ratios["save, in the background (resumed): training waited"]
    resume = stages["resume: read and load the checkpoint"]
    stages = {
        "save, in place (training waits for the disk)": full / disk * ratios["save, in place (fresh)"],
        "save, in the background (training waits for the gather)": full / disk * waited,
        "weights file for the Hub": (4 * shape.params + weights)
        / disk
        * ratios["weights file for the Hub (read fp32, write fp16)"],
        "push (checkpoint + weights file)": (full + weights)
        / up
        * ratios["push to the Hub stand-in (checkpoint + weights file)"],
        "download on a fresh machine": full / down * ratios["download on a fresh machine"],
        "resume: read and load the checkpoint": full / disk
        + max(0.0, resume["measured_s"] - resume["floor_s"]) * full / resume["bytes"],
    }
    return {
        "checkpoint_bytes": full,
        "weights_bytes": weights,
        "assumed_mbps": {
            "disk": args.kaggle_disk_mbps,
            "upload": args.kaggle_upload_mbps,
            "download": args.kaggle_download_mbps,
        },
        "stages_s": stages,
        "host_peak_gib": {
            "rank0_fresh": host["peak_fresh"]["rank0"] / GIB,
            "rank0_resumed": host["peak_resumed"]["rank0"] / GIB,
            "machine": max(host["peak_fresh"]["machine"], host["peak_resumed"]["machine"]) / GIB,
        },
    }


# ---------------------------------------------------------------- report


def report(args, fresh: dict, resumed: dict, floor: dict, plan: dict, kaggle: dict, machine: dict, stages: dict) -> str:
    rate = {k: floor["bytes"] / 1e6 / floor[f"{k}_s"] for k in ("write", "read", "copy")}
    lines = [
        f"{args.shape} shape ({plan['params']:,} parameters, random weights), {args.nproc} CPU ranks, {machine['cpu']}",
        f"floors on this disk: write {rate['write']:,.0f} MB/s (fsync), read {rate['read']:,.0f} MB/s, copy "
        f"{rate['copy']:,.0f} MB/s; imports: torchrun {floor['launcher_import_s']:.1f} s, a worker {floor['worker_import_s']:.1f} s",
        "",
        "| stage | measured | bytes | floor | ratio |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, st in stages.items():
        lines.append(
            f"| {name} | {st['measured_s']:.1f} s | {st['bytes'] / 1e9:,.2f} GB | {st['floor_s']:.1f} s "
            f"({st['floor']}) | {st['measured_s'] / st['floor_s']:.2f}x |"
        )
    lines += [
        "",
        f"saves: in place {fresh['save_s']:.1f} s (training waited all of it); in the background {resumed['save_s']:.1f} s "
        f"(training waited {resumed['save_training_waited_s']:.1f} s); a training step here: {fresh['median_step_s']:.1f} s",
        f"host peak RSS per rank: fresh {', '.join(f'{x:.2f}' for x in fresh['peak_rss_gib'])} GiB, resumed "
        f"{', '.join(f'{x:.2f}' for x in resumed['peak_rss_gib'])} GiB; plan: fresh "
        f"{', '.join(f'{x:.2f}' for x in plan['fresh'])}, resumed {', '.join(f'{x:.2f}' for x in plan['resumed'])} GiB",
        "",
        f"Kaggle 2xT4, opt-1.3b (prediction): checkpoint {kaggle['checkpoint_bytes'] / 1e9:.2f} GB, weights file "
        f"{kaggle['weights_bytes'] / 1e9:.2f} GB; assumed disk {kaggle['assumed_mbps']['disk']:.0f} MB/s, upload "
        f"{kaggle['assumed_mbps']['upload']:.0f} MB/s, download {kaggle['assumed_mbps']['download']:.0f} MB/s, each "
        "scaled by this machine's measured/floor ratio (the resume: the file read once from disk, plus the copying "
        "measured here beyond its read)",
        "",
        "| stage | minutes |",
        "| --- | --- |",
    ]
    lines += [f"| {k} | {v / 60:.1f} |" for k, v in kaggle["stages_s"].items()]
    h = kaggle["host_peak_gib"]
    lines += [
        "",
        f"host RAM (plan): rank 0 peaks at {h['rank0_fresh']:.1f} GiB fresh, {h['rank0_resumed']:.1f} GiB "
        f"resumed; the machine (2 ranks) at {h['machine']:.1f} GiB",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from hubserver import HubServer

    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="fsdp-opt-session-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        model = "tiny-opt" if args.shape == "tiny-opt" else build_model(args.shape, workdir / "model")
        plan = plan_host(str(model), args)
        for stale in ("fresh", "resumed", "hub", "hf_home_fresh", "hf_home_resumed"):  # a kept --workdir: new machines
            shutil.rmtree(workdir / stale, ignore_errors=True)
        floor = floors(workdir, 12 * plan["params"])
        with HubServer(token=TOKEN, storage_dir=workdir / "hub") as server:
            # The fresh session writes its checkpoints in place, the resumed one in the background (--async_save):
            # the same save, side by side, with and without training waiting for the disk.
            fresh = run_session(args, model, server.url, workdir, "fresh", 0, resume=False, async_save=False)
            resumed = run_session(args, model, server.url, workdir, "resumed", args.rows, resume=True, async_save=True)
        stages = stage_floors(fresh, resumed, floor, plan["params"], model)
        ratios = {k: v["measured_s"] / v["floor_s"] for k, v in stages.items()}
        machine = {
            "cpu": f"{os.cpu_count()} cores, {platform.processor() or platform.machine()}",
            "python": platform.python_version(),
        }
        kaggle = kaggle_prediction(args, stages)
        text = report(args, fresh, resumed, floor, plan, kaggle, machine, stages)
        print(text)
        if args.json:
            Path(args.json).write_text(
                json.dumps(
                    {
                        "shape": args.shape,
                        "nproc": args.nproc,
                        "fresh": fresh,
                        "resumed": resumed,
                        "floors": floor,
                        "stages": stages,
                        "ratios": ratios,
                        "plan": plan,
                        "kaggle": kaggle,
                        "machine": machine,
                    },
                    indent=1,
                )
            )
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
