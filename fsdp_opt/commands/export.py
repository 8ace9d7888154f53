"""Turn a checkpoint into a Hugging Face model folder, or a sharded checkpoint into the single-file form.

    python -m fsdp_opt.export CHECKPOINT DIR [--dtype fp16|bf16|fp32] [--model NAME] [--merge]
    python -m fsdp_opt.export --single_file SHARDED_FOLDER OUT.pt

The folder holds config.json, model.safetensors, the tokenizer and generation_config.json, and loads with
`AutoModelForCausalLM.from_pretrained(DIR)`. A LoRA checkpoint gives a peft adapter folder (adapter_config.json,
adapter_model.safetensors) that `PeftModel.from_pretrained(base, DIR)` loads, or with --merge the base with the
adapters merged in, as a model folder. Writes go to a temporary folder renamed at the end.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fsdp_opt.base import CheckpointError, ConfigError
from fsdp_opt.checkpoint.export import export_checkpoint, to_single_file
from fsdp_opt.model.parallelize import DTYPES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fsdp_opt.export", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a .pt checkpoint or a sharded checkpoint folder")
    parser.add_argument("dest", help="model folder to write (or .pt file with --single_file)")
    parser.add_argument("--dtype", default="fp16", choices=sorted(DTYPES), help="weight dtype of the folder")
    parser.add_argument("--model", default=None, help="model the checkpoint belongs to, if it does not say")
    parser.add_argument("--single_file", action="store_true", help="convert a sharded folder into one .pt file")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="a LoRA checkpoint: write the base with the adapters merged in (default: the adapter folder)",
    )
    args = parser.parse_args(argv)
    try:
        if args.single_file:
            print(f"wrote {to_single_file(Path(args.checkpoint), Path(args.dest))}")
        else:
            print(
                f"wrote {export_checkpoint(Path(args.checkpoint), Path(args.dest), args.dtype, args.model, args.merge)}"
            )
    except (ConfigError, CheckpointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
