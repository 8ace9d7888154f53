r"""The training command: `fsdp_finetune.py` in the repository, `python -m fsdp_opt` from an installed wheel.

torchrun --standalone --nproc_per_node=gpu -m fsdp_opt --num_epochs 1 \
    --start_idx 0 --end_idx 5000 --batch_size 4 --accum_steps 16 --hf_repo user/repo
"""

from __future__ import annotations

import os
import sys

from fsdp_opt.base import EXIT_NOT_PUSHED, ConfigError, NotPushedError
from fsdp_opt.config.parse import build_parser, parse_args
from fsdp_opt.runtime.exits import LAUNCHED, end_process, fail
from fsdp_opt.runtime.launch import launch, split_flag, under_a_launcher, workers

DESCRIPTION = "Fine-tune a Hugging Face causal LM with PyTorch FSDP2 on a slice [start_idx, end_idx) of a dataset."


def main(argv: list[str] | None = None) -> int:
    try:
        config = parse_args(argv)
    except ConfigError as exc:
        fail(str(exc))
    # NOTE: imported here for the start-up time of --help and of a bad flag: the trainer pulls in transformers and peft.
    from fsdp_opt.train.run import run

    try:
        run(config)
    except ConfigError as exc:
        fail(str(exc))
    except NotPushedError as exc:  # rank 0 alone meets it (the uploads are its): the other ranks have ended
        fail(str(exc), code=EXIT_NOT_PUSHED)
    except KeyboardInterrupt:
        fail("interrupted", code=130)
    return 0


def entry() -> None:
    """`python fsdp_finetune.py`, `python -m fsdp_opt` and torchrun with either: --help, or train and end the process;
    with --nproc_per_node (and no launcher around it), start the workers first (fsdp_opt/runtime/launch.py)."""
    if "-h" in sys.argv[1:] or "--help" in sys.argv[1:]:
        build_parser(description=DESCRIPTION).print_help()
        sys.exit(0)
    end_process(lambda: launch_or_train(sys.argv[1:]))


def launch_or_train(argv: list[str]) -> int:
    try:
        nproc, flags = split_flag(argv)
        if nproc is not None and under_a_launcher():
            raise ConfigError(
                f"--nproc_per_node {nproc}: this process was started by a launcher already (torchrun); "
                "give the number of workers to one of the two"
            )
        n = workers(nproc) if nproc is not None else None
    except ConfigError as exc:
        fail(str(exc))
    if n is None:
        return main(flags)
    os.environ[LAUNCHED] = "1"  # the workers leave their error line to this process, which prints it last
    return launch(n, flags)


if __name__ == "__main__":
    entry()
