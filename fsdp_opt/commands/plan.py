"""Will it fit? Per-GPU memory by component for each sharding strategy, checkpoint sizes against a disk
budget, and the host RAM a full save needs, before anything is launched.

    python -m fsdp_opt.plan --model facebook/opt-1.3b --gpus 2 --gpu_memory 15GiB --batch_size 4 --max_length 512

The flags are read first, from a parser that imports nothing heavy (planner/arguments.py): `--help` and a flag typed
wrong answer in a fraction of a second; the plan itself (commands/planning.py) needs the model's config and the
planner, which import transformers and torch.
"""

from __future__ import annotations

import sys

from fsdp_opt.base import ConfigError
from fsdp_opt.planner.arguments import build_parser


def main(argv: list[str] | None = None) -> int:
    try:
        a = build_parser().parse_args(argv)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # NOTE: imported here for the start-up time of --help and of a flag typed wrong: the plan pulls in transformers.
    from fsdp_opt.commands.planning import plan

    return plan(a)


if __name__ == "__main__":
    sys.exit(main())
