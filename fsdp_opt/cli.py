"""`fsdp-opt <command> [flags]` (and `python -m fsdp_opt <command>`): which command runs, nothing else.

    fsdp-opt train ...      train a range of a dataset (the default: `fsdp-opt --start_idx 0 ...` trains)
    fsdp-opt plan ...       memory, host RAM, disk and step time before a run; --batch_size auto's choice
    fsdp-opt evaluate ...   the base model and checkpoints on held-out rows, or lm-eval's tasks (--tasks)
    fsdp-opt export ...     a checkpoint as a model folder, a Hub model repo, GGUF
    fsdp-opt demo ...       the built-in demos on CPU
    fsdp-opt check ...      a new GPU machine: the plan against what it measures

Each command is one module of fsdp_opt/commands, run as `python -m fsdp_opt.<module>` runs it (its own flags, its own
exit); `fsdp_finetune.py`, `torchrun ... fsdp_finetune.py` and `torchrun ... -m fsdp_opt` train as before.
"""

from __future__ import annotations

import runpy
import sys

# verb -> the module under fsdp_opt/commands that runs it
COMMANDS = {
    "train": "train",
    "plan": "plan",
    "evaluate": "evaluate",
    "export": "export",
    "demo": "demo",
    "check": "gpu_check",
}
USAGE = __doc__.split("\n\n")[1]


def split_command(argv: list[str]) -> tuple[str | None, list[str]]:
    """(the command's module, its flags); None with an unknown command. No command before the flags: train."""
    if not argv or argv[0].startswith("-"):
        return COMMANDS["train"], argv
    return COMMANDS.get(argv[0]), argv[1:]


def entry() -> None:
    argv = sys.argv[1:]
    if argv[:1] in (["-h"], ["--help"]):
        print(
            f"usage: fsdp-opt <command> [flags]; with no command, train\n\n{USAGE}\n\n`fsdp-opt <command> --help` lists a command's flags."
        )
        sys.exit(0)
    module, flags = split_command(argv)
    if module is None:
        print(f"error: fsdp-opt {argv[0]}: no such command (one of {', '.join(COMMANDS)})", file=sys.stderr)
        sys.exit(2)
    sys.argv = [f"fsdp-opt {argv[0]}" if argv and not argv[0].startswith("-") else sys.argv[0], *flags]
    runpy.run_module(f"fsdp_opt.commands.{module}", run_name="__main__", alter_sys=True)
