"""Run by torchrun from the tests: a session in phases (setup, two steps, a save), reporting this rank's peak
host RSS in each phase (and its RSS before setup) and the checkpoint files still mapped after setup. Arguments: the report path, how a full
checkpoint is loaded ("slices": each rank reads its own, "broadcast": rank 0 reads and broadcasts), the trainer's
flags."""

from __future__ import annotations

import json
import sys

from fsdp_opt.checkpoint import loading
from fsdp_opt.config.parse import parse_args
from fsdp_opt.engine.step import train_step
from fsdp_opt.runtime.distributed import init_distributed, teardown
from fsdp_opt.runtime.exits import end_process
from fsdp_opt.runtime.hostmem import configure_allocator, mapped_files, peak_rss_bytes, reset_peak, rss_bytes
from fsdp_opt.train.build import setup
from fsdp_opt.train.saving import save


def main() -> None:
    out_path, load, flags = sys.argv[1], sys.argv[2], sys.argv[3:]
    if load == "broadcast":  # as when the other ranks cannot see rank 0's file (nodes without a shared filesystem)
        loading._every_rank_sees = lambda path, env: False  # noqa: E731
    env = init_distributed("cpu")
    configure_allocator(cpu_device=True)  # as train.run.run does for a CPU device
    config = parse_args(flags)
    # the process before setup: Python, the imports and the process group, whose size varies with the machine
    report: dict = {"process": rss_bytes()["rss"]}
    reset_peak()
    session = setup(config, env)
    report["setup"] = peak_rss_bytes()
    report["mapped_after_setup"] = mapped_files(".pt")
    steps = session.plan.steps(session.state.epoch, session.state.offset)
    reset_peak()
    for _ in range(2):
        train_step(session, next(steps))
    report["step"] = peak_rss_bytes()
    reset_peak()
    save(session, epoch_end=False, evaluate=False)
    report["save"] = peak_rss_bytes()
    with open(f"{out_path}.rank{env.rank}", "w") as f:
        json.dump(report, f)
    teardown()


if __name__ == "__main__":
    end_process(main)
