"""Fine-tune a Hugging Face causal LM with PyTorch FSDP2 on a slice [start_idx, end_idx) of a dataset.

    torchrun --standalone --nproc_per_node=gpu fsdp_finetune.py --num_epochs 1 \
        --start_idx 0 --end_idx 5000 --batch_size 4 --accum_steps 16 --hf_repo user/repo

Plain `python fsdp_finetune.py ...` runs as a world of one. `--help` lists every flag.
"""

from __future__ import annotations

import os
import sys

from fsdp_opt.config import build_parser, parse_args
from fsdp_opt.distributed import fail
from fsdp_opt.errors import ConfigError


def main(argv: list[str] | None = None) -> int:
    try:
        config = parse_args(argv)
    except ConfigError as exc:
        fail(str(exc))
    from fsdp_opt.trainer import run

    try:
        run(config)
    except ConfigError as exc:
        fail(str(exc))
    except KeyboardInterrupt:
        fail("interrupted", code=130)
    return 0


if __name__ == "__main__":
    if "-h" in sys.argv[1:] or "--help" in sys.argv[1:]:
        build_parser(description=__doc__.split("\n\n")[0]).print_help()
        sys.exit(0)
    code = main()
    # NOTE: here every file is written, W&B is closed and the uploads are done. What is left is the interpreter's
    # teardown, which can destroy gloo's worker threads out of order and abort (SIGABRT) a rank that has finished;
    # torchrun then kills the other ranks, e.g. rank 0 while it waits for its last push. So the process ends now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
