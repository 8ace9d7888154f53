"""Measure this machine's rates for the step-time model, in processes like the trainer's (what `plan --calibrate`
launches; see fsdp_opt.planner.calibrate).

    torchrun --standalone --nproc_per_node=2 -m fsdp_opt.calibrate --device cpu --json rates.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from fsdp_opt.planner.calibrate import measure
from fsdp_opt.runtime.distributed import init_distributed, teardown
from fsdp_opt.runtime.exits import end_process


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fsdp_opt.calibrate", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--json", default=None, help="write the rates here (rank 0)")
    a = p.parse_args(argv)
    env = init_distributed(a.device)
    try:
        rates = measure(env, ("fp32", "fp16", "bf16") if env.device.type == "cpu" else ("fp32", "fp16"))
        if env.is_main:
            text = json.dumps(rates)
            if a.json:
                Path(a.json).write_text(text)
            print(text)
    finally:
        teardown()
    return 0


if __name__ == "__main__":
    end_process(main)
