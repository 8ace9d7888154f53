"""What a session pays for its data: bytes fetched, disk used and seconds to the first step for a short range at the
start, the middle and the end of a large split, against `datasets.load_dataset` of the whole split (what a session
paid before it read by range), side by side in one run.

    python benchmarks/data.py --rows 300000 --range 64 --json data.json

The dataset is made here (tests/hubdata.py: an UltraChat-like repo, split train_sft in parquet shards of many row
groups) and served by the loopback Hub (tests/hubserver.py, the real huggingface_hub and datasets clients, HTTP
range requests answered with 206). Every measurement starts from an empty Hugging Face cache. A session is the real
command under torchrun (tiny-opt, the chatml template, 2 CPU ranks); "seconds to the first step" runs from its
launch to its first metrics line, less that step.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
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


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=300_000, help="rows of the split")
    p.add_argument("--shards", type=int, default=6)
    p.add_argument("--row_group", type=int, default=1_000, help="rows per parquet row group")
    p.add_argument("--range", type=int, default=64, help="rows a session trains")
    p.add_argument("--nproc", type=int, default=2, help="ranks under torchrun (0: one plain process)")
    p.add_argument("--json", default=None, help="write the results here too")
    p.add_argument("--workdir", default=None, help="keep the files here (default: a temporary folder)")
    return p.parse_args(argv)


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def base_env(hub_url: str, hf_home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "WANDB_", "RANK", "WORLD_SIZE", "MASTER_"))}
    env.update(
        HF_ENDPOINT=hub_url,
        HF_HUB_DISABLE_XET="1",
        HF_HOME=str(hf_home),
        WANDB_MODE="disabled",
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(ROOT),
        PYTHONUNBUFFERED="1",
    )
    return env


def session(args: argparse.Namespace, server, workdir: Path, name: str, start: int) -> dict:
    """One training session on rows [start, start + range): fetched bytes, disk, seconds to the first step."""
    out_dir, hf_home = workdir / name, workdir / f"hf_home_{name}"
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}"] if args.nproc else []
    cmd = [
        sys.executable,
        *launcher,
        str(ROOT / "fsdp_finetune.py"),
        "--model",
        "tiny-opt",
        "--dataset",
        "bench/chat",
        "--dataset_split",
        "train_sft",
        "--chat_template",
        "chatml",
        "--start_idx",
        str(start),
        "--end_idx",
        str(start + args.range),
        "--max_length",
        "128",
        "--batch_size",
        "4",
        "--precision",
        "fp32",
        "--output_dir",
        str(out_dir),
        "--keep_last",
        "0",
        "--save_optimizer",
        "false",
    ]
    before = sum(server.sent.values())
    first: list[float] = []
    launched = time.perf_counter()
    proc = subprocess.Popen(
        cmd, env=base_env(server.url, hf_home), cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )

    def watch() -> None:
        path = out_dir / "metrics.jsonl"
        while proc.poll() is None and not first:
            if path.exists() and path.read_text().strip():
                first.append(time.perf_counter() - launched)
            time.sleep(0.02)

    threading.Thread(target=watch, daemon=True).start()
    output = proc.communicate()[0]
    if proc.returncode != 0:
        raise SystemExit(f"session {name} failed:\n{output[-3000:]}")
    row = json.loads((out_dir / "metrics.jsonl").read_text().splitlines()[0])
    step_s = row["tokens"] / row["tokens_per_second"] if row["tokens_per_second"] else 0.0
    return {
        "rows": f"[{start:,}, {start + args.range:,})",
        "fetched_bytes": sum(server.sent.values()) - before,
        "disk_bytes": folder_bytes(hf_home),
        "to_first_step_s": (first[0] if first else 0.0) - step_s,
    }


def whole_split(server, workdir: Path) -> dict:
    """datasets.load_dataset of the whole split, in a process of its own, as a session used to load it."""
    hf_home = workdir / "hf_home_whole"
    script = (
        "import time; t = time.perf_counter(); import datasets; "
        "ds = datasets.load_dataset('bench/chat', split='train_sft'); print(len(ds), time.perf_counter() - t)"
    )
    before = sum(server.sent.values())
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", script], env=base_env(server.url, hf_home), capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise SystemExit(f"load_dataset failed:\n{proc.stderr[-3000:]}")
    return {
        "rows": "the whole split",
        "fetched_bytes": sum(server.sent.values()) - before,
        "disk_bytes": folder_bytes(hf_home),
        "load_s": time.perf_counter() - started,
    }


def report(args: argparse.Namespace, total: int, ranges: list[dict], whole: dict, machine: dict) -> str:
    mib = lambda n: f"{n / 2**20:,.1f} MiB"  # noqa: E731
    lines = [
        f"Data: {args.rows:,} rows of conversations in {args.shards} parquet shards (row groups of {args.row_group:,}), "
        f"{mib(total)}, on the loopback Hub; {machine['cpu']}, Python {machine['python']}",
        "",
        "| what | bytes fetched | share of the dataset | disk used | seconds to the first step |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in ranges:
        lines.append(
            f"| a session on rows {r['rows']} | {mib(r['fetched_bytes'])} | {r['fetched_bytes'] / total:.1%} | "
            f"{mib(r['disk_bytes'])} | {r['to_first_step_s']:.1f} |"
        )
    lines.append(
        f"| `load_dataset` of the whole split | {mib(whole['fetched_bytes'])} | {whole['fetched_bytes'] / total:.1%} "
        f"| {mib(whole['disk_bytes'])} | {whole['load_s']:.1f} to load it, before anything else |"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from hubdata import make_chat_repo, repo_files
    from hubserver import HubServer

    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="fsdp-opt-data-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        repo = workdir / "repo"
        shutil.rmtree(repo, ignore_errors=True)
        make_chat_repo(repo, args.rows, 400, args.shards, args.row_group)
        for stale in [p for p in workdir.iterdir() if p.name.startswith(("hf_home_", "s_"))]:
            shutil.rmtree(stale, ignore_errors=True)
        with HubServer(storage_dir=workdir / "hub") as server:
            server.commit_dataset("bench/chat", repo_files(repo))
            total = server.dataset_bytes("bench/chat")
            starts = {"start": 0, "middle": args.rows // 2, "end": args.rows - args.range}
            ranges = [
                session(args, server, workdir, f"s_{name}", start) | {"where": name} for name, start in starts.items()
            ]
            whole = whole_split(server, workdir)
        machine = {
            "cpu": f"{os.cpu_count()} cores, {platform.processor() or platform.machine()}",
            "python": platform.python_version(),
        }
        text = report(args, total, ranges, whole, machine)
        print(text)
        if args.json:
            Path(args.json).write_text(
                json.dumps(
                    {
                        "dataset_bytes": total,
                        "ranges": ranges,
                        "whole": whole,
                        "machine": machine,
                        "rows": args.rows,
                        "range": args.range,
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
