"""`python -m fsdp_opt --nproc_per_node N ...`: the training command starting its own workers on this machine.

It is what `torchrun --standalone --nproc_per_node N -m fsdp_opt ...` runs (torch's elastic launch API, with the
same rendezvous on a free local port and no restarts), and it ends as the tool ends: when a worker fails, the
worker's own error line (which it also leaves in torch elastic's error file) is the last line on the screen and its
exit code the command's: 2 for a user error, 3 for a checkpoint that did not reach the Hub. torchrun, on the same
failure, prints a traceback of its own and a "Root Cause" table after it, and exits 1. `torchrun ... fsdp_finetune.py`
and `torchrun ... -m fsdp_opt` keep working as before.

`N`: a number, `gpu` (one worker per GPU, counted without a CUDA context in this process; 1 without a GPU) or
`auto` (the same). Several machines: torchrun (docs/launching.md).
"""

from __future__ import annotations

import logging
import os
import sys
import uuid

from fsdp_opt.base import ConfigError
from fsdp_opt.runtime.gpus import from_a_child_process, from_nvidia_smi

FLAG = "--nproc_per_node"
# What torch elastic's agent sets in each worker it starts (torchrun's as well as ours).
UNDER_A_LAUNCHER = ("TORCHELASTIC_RUN_ID", "LOCAL_RANK")


def split_flag(argv: list[str]) -> tuple[str | None, list[str]]:
    """(the --nproc_per_node value, the other flags): `--nproc_per_node N` or `--nproc_per_node=N`."""
    rest, value = [], None
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == FLAG:
            if i + 1 >= len(argv):
                raise ConfigError(f"{FLAG}: give a number of workers, or gpu")
            value, i = argv[i + 1], i + 2
            continue
        if arg.startswith(FLAG + "="):
            value = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    return value, rest


def workers(value: str) -> int:
    """--nproc_per_node as a count of workers on this machine."""
    if value in ("gpu", "auto"):
        return max(1, len(from_nvidia_smi() or from_a_child_process()))
    try:
        n = int(value)
    except ValueError:
        raise ConfigError(f"{FLAG} {value}: give a number of workers, or gpu (one per GPU)") from None
    if n < 1:
        raise ConfigError(f"{FLAG} {value}: at least 1 worker")
    return n


def under_a_launcher() -> bool:
    return any(os.environ.get(k) for k in UNDER_A_LAUNCHER)


def launch(n: int, flags: list[str]) -> int:
    """The training command in `n` workers on this machine (torch's elastic launch); the exit code of the first that
    failed (its error line printed last), else 0."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # the agent's own lines (its start, a worker's failure as it sees it): the workers say what happened
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=n,
        run_id=uuid.uuid4().hex[:12],
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        monitor_interval=0.1,
    )
    try:
        elastic_launch(config, sys.executable)("-m", "fsdp_opt", *flags)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        said = failure.message if isinstance(failure.message, str) and failure.message.startswith("error:") else None
        code = failure.exitcode if failure.exitcode > 0 else 1
        line = said or (
            f"error: worker {rank} ended with exit code {failure.exitcode}"
            if failure.exitcode > 0
            else f"error: worker {rank} was ended by a signal ({failure.message})"
        )
        _last(line)
        return code
    except SignalException as exc:  # SIGTERM (a platform's stop) or Ctrl-C: passed on to the workers, as torchrun does
        _last(
            f"stopped: {exc.sigval.name} was passed on to the workers, which save at their next step and stop (their "
            "lines above)"
        )
        return 128 + int(exc.sigval)
    return 0


def _last(line: str) -> None:
    sys.stdout.flush()
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
