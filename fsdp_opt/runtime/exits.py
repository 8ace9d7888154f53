"""How a process of the tool ends: a user error as one line and its exit code (`fail`), a worker's error line where
its launcher looks for it, and `end_process`, which ends every command.

Nothing here imports torch: the training command's flags (and its --help) are read before torch is, so a typo costs
no second of imports. What ends a process after torch was imported (a rank out of GPU memory, its process group)
is asked of torch as it is already loaded.

Under torchrun (not this package's launcher) a worker's error ends in torchrun's own report: its traceback, a
"Root Cause" table naming the worker's line, exit 1, for a flag typed wrong as for a real failure. The worker
cannot silence that report, and the launcher exits after it; so the failing worker leaves a small process behind,
outside its process group, which writes the same line once torchrun has exited: the line the user reads last is the
tool's (`after_the_launcher`). `python -m fsdp_opt --nproc_per_node N` (runtime/launch.py) prints it last itself,
without torchrun's report, and exits with the worker's code.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

# Set by `python -m fsdp_opt --nproc_per_node N` (runtime/launch.py) for the workers it starts: it prints a worker's
# error line itself, last.
LAUNCHED = "FSDP_OPT_LAUNCHED"
# How long a rank other than 0 waits, on a user error, for rank 0 to print it and exit.
PRINT_WAIT_S = 30.0
# How long the line waits for torchrun to exit: torchrun stops the other workers (SIGTERM, then SIGKILL after 30 s)
# and prints its report. Past this the line is not written again (it is on the screen once already).
AFTER_LAUNCHER_S = 90.0

# The process left behind by a failing worker under torchrun: wait for torchrun (its pid; a zombie, not yet reaped
# by whatever waits for it, counts as gone), then write the line on the stderr it shares with torchrun.
_WAIT_THEN_SAY = """
import os, sys, time
pid, line, deadline = int(sys.argv[1]), sys.argv[2], time.monotonic() + float(sys.argv[3])
def alive():
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        if os.path.isdir("/proc/self"):
            return False
    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False
while alive():
    if time.monotonic() > deadline:
        sys.exit(0)
    time.sleep(0.02)
os.write(2, (line + "\\n").encode())
"""


def env_rank() -> int:
    """This process's rank from the launcher's environment (0 when not launched by torchrun)."""
    return int(os.environ.get("RANK", "0"))


def say(line: str) -> None:
    """One line on stderr in one write: under PYTHONUNBUFFERED, print() writes the text and its newline apart, and
    two ranks' lines could interleave."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def say_error(line: str) -> None:
    """A worker's error line: on stderr, and into torch elastic's error file where its launcher gave one (torchrun's
    report then names it as the root cause; this package's launcher prints it last, instead of the worker). Under
    torchrun the line comes once more, after torchrun's report (after_the_launcher)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    recorded = False
    if path:
        try:
            with open(path, "w") as f:
                json.dump({"message": line, "timestamp": int(time.time())}, f)
            recorded = True
        except OSError:
            pass
    if recorded and os.environ.get(LAUNCHED) == "1":
        return
    say(line)
    if recorded:
        after_the_launcher(line)


def after_the_launcher(line: str) -> None:
    """Leave a process that writes `line` to this process's stderr once the launcher (this worker's parent:
    torchrun) has exited, so that it is the last line of the launch. It runs in a session of its own: torchrun ends a
    worker's whole process group, and Ctrl-C reaches the terminal's group only. Not a child of the package: a bare
    Python with a few lines (no import of torch), started in about 20 ms."""
    try:
        subprocess.Popen(
            [sys.executable, "-c", _WAIT_THEN_SAY, str(os.getppid()), line, str(AFTER_LAUNCHER_S)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            start_new_session=True,
            close_fds=True,
        )
    except OSError:
        pass  # the line is on the screen once already, inside torchrun's report


def fail(message: str, code: int = 2) -> None:
    """Print a user error once (rank 0) as one line and exit without a traceback.

    NOTE: torchrun stops every rank as soon as one of them exits with an error. Every rank meets the same user error
    (the flags are parsed on each, and errors found later are agreed by all_ranks_ok), and a rank other than 0 that
    exited first would take rank 0 down before it printed the line: the user would see only torchrun's report. So
    the other ranks wait for rank 0 to print and exit (torchrun then stops them). One still running after
    PRINT_WAIT_S prints the line itself: rank 0 did not meet the error."""
    rank = env_rank()
    if rank == 0:
        say_error(f"error: {message}")
    else:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        time.sleep(PRINT_WAIT_S)
        say_error(f"error: (rank {rank}) {message}")
    teardown_quietly()
    sys.exit(code)


def teardown_quietly() -> None:
    """The process group gone, if this process made one (torch.distributed loaded and initialised)."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - exiting on a user error; the group may already be broken
        pass


def end_process(main: Callable[[], int | None]) -> None:
    """Run a command's `main` and end the process with its exit code, skipping the interpreter's teardown.

    `main` returns once its work is done: files written, W&B closed, uploads finished. What the teardown would
    add is the destruction of gloo's worker threads, which can happen out of order and abort (SIGABRT) a rank
    that has finished; torchrun then kills the other ranks, e.g. rank 0 while it waits for its last push. A user
    error (`fail`, argparse) ends the same way, with its own code. Running out of GPU memory is one line (the run does
    not fit: that is the user's choice of sizes, not a bug), exit 1; so is a package this Python lacks (a lent GPU
    image without datasets ended in a traceback). An unexpected exception keeps its traceback.
    """
    try:
        code = main()
    except ModuleNotFoundError as exc:
        if not exc.name or exc.name.split(".")[0] == "fsdp_opt":
            raise  # the package itself incomplete: a bug, with its traceback
        say_error(
            f"error: rank {env_rank()}: the package {exc.name.split('.')[0]!r} is not installed in this Python "
            f"({sys.executable}): pip install -r requirements.txt installs what fsdp-opt needs"
        )
        code = 1
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code
        else:  # sys.exit("message"): Python prints the message and exits with 1
            say(str(exc.code))
            code = 1
    except Exception as exc:
        if not out_of_gpu_memory(exc):
            raise
        say_error(oom_line(str(exc)))
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


def out_of_gpu_memory(exc: BaseException) -> bool:
    """torch's OutOfMemoryError (torch is loaded by then: only it raises one)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(exc, torch.OutOfMemoryError)


def oom_line(message: str) -> str:
    """The one line for a rank that ran out of GPU memory: what torch says of the device (without its advice on the
    allocator), and what makes a run fit."""
    said = message.split(" Of the allocated memory")[0].split(" If reserved")[0].strip().rstrip(";.")
    return (
        f"error: rank {env_rank()}: out of GPU memory ({said[:300]}). The run does not fit its GPUs: "
        "--batch_size auto picks a layout that fits (python -m fsdp_opt.plan with the same flags shows the peak), "
        "or train LoRA adapters (--lora_rank 16), on more GPUs, or with --cpu_offload"
    )
