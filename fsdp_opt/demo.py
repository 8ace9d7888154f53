"""The CPU demo: tiny-opt on python-docs, 2 processes, end to end, then a one-line verdict.

python -m fsdp_opt.demo [--nproc 2] [--output_dir outputs/demo] [extra fsdp_finetune.py flags]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

from fsdp_opt.tracking.metrics import read_metrics

ENTRY = Path(__file__).resolve().parents[1] / "fsdp_finetune.py"

DEMO_ARGS = [
    "--model", "tiny-opt", "--dataset", "python-docs", "--max_length", "128", "--batch_size", "4",
    "--num_epochs", "2", "--lr", "3e-3", "--warmup_steps", "20", "--seed", "0",
]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="worker processes (CPU ranks)")
    parser.add_argument("--output_dir", default="outputs/demo", help="where checkpoints and metrics go (replaced)")
    args, extra = parser.parse_known_args(argv)
    out = Path(args.output_dir)
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}", str(ENTRY)]
    cmd += DEMO_ARGS + ["--device", "cpu", "--output_dir", str(out)] + extra
    print("$ " + " ".join(cmd[1:]), flush=True)
    code = subprocess.call(cmd)
    if code != 0:
        return code
    rows = read_metrics(out)
    first = sum(r["loss"] for r in rows[:10]) / min(10, len(rows))
    last = sum(r["loss"] for r in rows[-10:]) / min(10, len(rows))
    print(f"demo: {len(rows)} steps; mean loss of the first 10 steps {first:.3f}, of the last 10 {last:.3f}")
    print(f"demo: checkpoints and metrics.jsonl are in {out}/")
    return 0 if last < first else 1


if __name__ == "__main__":
    sys.exit(main())
