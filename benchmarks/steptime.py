"""The step-time model against the clock, in one run: this machine's rates are measured first (`fsdp_opt.calibrate`,
under torchrun like the training), then each configuration trains a few steps with the engine and its median step
time is held against the planner's prediction from those rates.

    python benchmarks/steptime.py --json steptime.json

Configurations differ in micro-batch, accumulation, sharding strategy and reduce mode at the same global batch
(opt-125m's shape with random weights by default, 2 CPU ranks). The check: every prediction within 25% of its
measured step time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# NOTE: the package is imported from this repository (the path above), so these imports come after it.
from fsdp_opt.config.parse import parse_args  # noqa: E402
from fsdp_opt.engine.step import train_step  # noqa: E402
from fsdp_opt.model.shapes import Shape, model_config  # noqa: E402
from fsdp_opt.planner.inputs import Inputs  # noqa: E402
from fsdp_opt.planner.steptime import Rates, step_time  # noqa: E402
from fsdp_opt.runtime.distributed import init_distributed, teardown  # noqa: E402
from fsdp_opt.runtime.exits import end_process  # noqa: E402
from fsdp_opt.train.build import setup  # noqa: E402

# name: (micro-batch, accumulation, strategy, reduce every micro-batch)
CONFIGS = {
    "b2_a2_full_last": (2, 2, "FULL_SHARD", False),
    "b4_a1_full": (4, 1, "FULL_SHARD", False),
    "b1_a4_full_every": (1, 4, "FULL_SHARD", True),
    "b2_a2_grad_op_every": (2, 2, "SHARD_GRAD_OP", True),
    "b1_a4_no_shard_last": (1, 4, "NO_SHARD", False),
}
TOLERANCE = 0.25


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="random:facebook/opt-125m")
    p.add_argument("--dataset", default="python-docs")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--max_length", type=int, default=128)
    p.add_argument("--precision", default="fp32")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--steps", type=int, default=3, help="timed steps")
    p.add_argument("--configs", nargs="*", default=None, help=f"a subset of {', '.join(CONFIGS)}")
    p.add_argument("--rates", default=None, help="a calibration JSON to predict from (default: measure now)")
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def flags(args: argparse.Namespace, name: str, out_dir: str) -> list[str]:
    b, a, strategy, every = CONFIGS[name]
    return [
        "--model",
        args.model,
        "--dataset",
        args.dataset,
        "--max_length",
        str(args.max_length),
        "--packing",
        "concat",
        "--batch_size",
        str(b),
        "--accum_steps",
        str(a),
        "--sharding_strategy",
        strategy,
        "--reduce_every_microbatch",
        str(every).lower(),
        "--precision",
        args.precision,
        "--output_dir",
        out_dir,
        "--wandb_mode",
        "disabled",
        "--device",
        "cpu",
        "--end_idx",
        "400",
    ]


def worker(args: argparse.Namespace) -> None:
    env = init_distributed("cpu")
    try:
        s = setup(parse_args(flags(args, args.worker, tempfile.mkdtemp(prefix="steptime-"))), env)
        times: list[float] = []
        for step in s.plan.steps(0):
            t0 = time.perf_counter()
            train_step(s, step)
            times.append(time.perf_counter() - t0)
            if len(times) == args.warmup + args.steps:
                break
        if env.is_main:
            timed = times[args.warmup :]
            Path(args.out).write_text(json.dumps({"step_time_s": statistics.median(timed), "times": timed}))
    finally:
        teardown()


def torchrun(args: argparse.Namespace, argv: list[str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}", *argv]
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONPATH": str(ROOT)}
    return subprocess.run(cmd, env=env, capture_output=True, text=True)


def run_json(args: argparse.Namespace, argv: list[str], out: Path) -> dict:
    proc = torchrun(args, [*argv, *(["--out", str(out)] if "--worker" in argv else ["--json", str(out)])])
    if out.exists():
        return json.loads(out.read_text())
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    raise SystemExit(f"error: {' '.join(argv[:3])}: exit {proc.returncode}: {tail}")


def predict(args: argparse.Namespace, name: str, measured_rates: dict) -> dict:
    b, a, strategy, every = CONFIGS[name]
    inputs = Inputs(
        gpus=args.nproc,
        batch_size=b,
        accum_steps=a,
        max_length=args.max_length,
        precision=args.precision,
        reduce_every_microbatch=every,
        packing="concat",
        cuda=False,
    )
    return step_time(
        Shape.of(model_config(args.model)), strategy, inputs, Rates.measured(measured_rates, args.precision)
    )


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.worker:
        worker(args)
        return 0
    names = args.configs or list(CONFIGS)
    with tempfile.TemporaryDirectory() as tmp:
        if args.rates:
            rates = json.loads(Path(args.rates).read_text())
        else:
            print("measuring this machine's rates ...", flush=True)
            rates = run_json(args, ["-m", "fsdp_opt.calibrate", "--device", "cpu"], Path(tmp) / "rates.json")
        rows = {}
        passthrough = [
            "--model",
            args.model,
            "--dataset",
            args.dataset,
            "--max_length",
            str(args.max_length),
            "--precision",
            args.precision,
            "--warmup",
            str(args.warmup),
            "--steps",
            str(args.steps),
        ]
        for name in names:
            print(f"running {name} ...", flush=True)
            measured = run_json(args, [__file__, *passthrough, "--worker", name], Path(tmp) / f"{name}.json")
            p = predict(args, name, rates)
            rows[name] = {
                **measured,
                "predicted_s": p["step_s"],
                "prediction": p,
                "ratio": p["step_s"] / measured["step_time_s"],
            }
    report = {
        "rates": rates,
        "configs": rows,
        "settings": {k: v for k, v in vars(args).items() if k not in ("worker", "out")},
        "tolerance": TOLERANCE,
        "all_within": all(abs(r["ratio"] - 1) <= TOLERANCE for r in rows.values()),
    }
    lines = [
        "| configuration | micro-batch x accum | strategy, reduce | measured | predicted | predicted / measured |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in rows.items():
        b, a, strategy, every = CONFIGS[name]
        lines.append(
            f"| {name} | {b} x {a} | {strategy}, {'every micro-batch' if every else 'last micro-batch'} | "
            f"{r['step_time_s']:.2f} s | {r['predicted_s']:.2f} s | {r['ratio']:.2f} |"
        )
    print("\n".join(lines))
    print(
        f"rates: matmul {rates['matmul_tflops'][args.precision]:.3f} TFLOPS ({args.precision}), all-gather "
        f"{rates['all_gather_gbps']['fp32']:.2f} GB/s, reduce-scatter {rates['reduce_scatter_gbps']['fp32']:.2f} GB/s, "
        f"AdamW {rates['optimizer_gbps']:.2f} GB/s; {rates['world_size']} ranks x {rates['threads_per_rank']} thread(s)"
    )
    print(f"every prediction within {TOLERANCE:.0%}: {'yes' if report['all_within'] else 'NO'}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.json}")
    return 0 if report["all_within"] else 1


if __name__ == "__main__":
    end_process(main)
