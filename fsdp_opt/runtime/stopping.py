"""When to stop early: SIGTERM/SIGINT, or a wall-clock budget. The decision is agreed across ranks.

Each rank checks at a step boundary; an all-reduce (MAX) of the local reason makes every rank stop at the
same step, so the final save's collectives line up. A second Ctrl-C interrupts at once.
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
import threading
import time
from typing import Any

from fsdp_opt.runtime.distributed import max_over_ranks
from fsdp_opt.runtime.exits import LAUNCHED

REASONS = ("", "received SIGTERM", "received SIGINT", "time limit", "a checkpoint write failed")

WRITE_FAILED = REASONS[-1]


class StopControl:
    def __init__(self, time_limit_s: float | None, started: float | None = None):
        self.started = time.monotonic() if started is None else started
        self.deadline = None if time_limit_s is None else self.started + time_limit_s
        self.signal_code = 0
        self.slowest_step = 0.0  # seconds of the slowest step so far: the next one may take as long
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGINT and self.signal_code == REASONS.index("received SIGINT"):
            raise KeyboardInterrupt
        self.signal_code = REASONS.index("received SIGTERM" if signum == signal.SIGTERM else "received SIGINT")

    def seconds_left(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()

    def observe_step(self, seconds: float) -> None:
        self.slowest_step = max(self.slowest_step, seconds)

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def check(self, save_s: float, write_failed: bool = False) -> str | None:
        """The agreed reason to stop now, or None. Every rank must call it at the same step."""
        code = REASONS.index(WRITE_FAILED) if write_failed else self.signal_code
        left = self.seconds_left()
        # Stop while the next step and a save still fit in what is left, with a margin for exit.
        if not code and left is not None and left < self.slowest_step + save_s + 10.0:
            code = REASONS.index("time limit")
        return REASONS[max_over_ranks(code)] or None

    def close(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


def resume_command(name: str, argv: list[str] | None = None, program: str | None = None, same: bool = False) -> str:
    """The command line of this run with --resume_file pointing at `name`, launched as this one was
    (`fsdp_finetune.py` in a checkout, `-m fsdp_opt` from an installed package). `same`: the command unchanged (an
    auto chain finds `name` itself, as its newest checkpoint)."""
    args = list(sys.argv[1:] if argv is None else argv)
    program = sys.argv[0] if program is None else program
    target = "-m fsdp_opt" if os.path.basename(program) == "__main__.py" else "fsdp_finetune.py"
    if same:
        return " ".join([_launcher(target)] + [shlex.quote(a) for a in args])
    out = []
    skip = False
    for a in args:
        if skip:
            skip = False
            continue
        if a == "--resume_file":
            skip = True
            continue
        if a.startswith("--resume_file="):
            continue
        out.append(a)
    out += ["--resume_file", name]
    return " ".join([_launcher(target)] + [shlex.quote(a) for a in out])


def _launcher(target: str) -> str:
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    if local and os.environ.get(LAUNCHED) == "1":  # started by `python -m fsdp_opt --nproc_per_node N`
        return f"python -m fsdp_opt --nproc_per_node {local}"
    return (
        f"torchrun --standalone --nproc_per_node={local} {target}"
        if local and int(os.environ.get("WORLD_SIZE", "1")) == local
        else f"torchrun <same launcher flags> {target}"
        if local
        else f"python {target}"
    )
