"""Turn a checkpoint into a model people run: a Hugging Face model folder, GGUF for llama.cpp and Ollama, a Hub model
repo; or a sharded checkpoint into the single-file form.

    fsdp-opt export CHECKPOINT DIR [--dtype fp16|bf16|fp32] [--adapter] [--gguf q8_0 ...] [--push_to_hub user/name]
    fsdp-opt export CHECKPOINT --push_to_hub user/name        (built in a temporary folder, pushed, removed)
    fsdp-opt export --single_file SHARDED_FOLDER OUT.pt

(`python -m fsdp_opt.export` is the same command.) CHECKPOINT is a checkpoint (.pt, a sharded folder, a weights file)
or a model folder already exported. The folder holds config.json, the safetensors weights (sharded as transformers
shards them), the tokenizer with its chat template and generation_config.json: `AutoModelForCausalLM.from_pretrained`
loads it. A LoRA checkpoint is merged into its base (a 4-bit base dequantized first); --adapter writes the peft
adapter folder instead. --gguf writes llama.cpp's format for Llama, Mistral, Qwen2/3, Gemma 2/3 and Phi-3, with an
Ollama Modelfile; --push_to_hub pushes it all with a model card. Writes go to a temporary folder renamed at the end.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fsdp_opt.base import CheckpointError, ConfigError
from fsdp_opt.checkpoint.export import to_single_file
from fsdp_opt.checkpoint.gguf import GGUF_TYPES
from fsdp_opt.hub.release import Release, run_release
from fsdp_opt.model.parallelize import DTYPES


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fsdp-opt export", description=__doc__.splitlines()[0])
    parser.add_argument(
        "checkpoint", help="a checkpoint (.pt, sharded folder, weights file) or an exported model folder"
    )
    parser.add_argument(
        "dest", nargs="?", default=None, help="the folder to write (or the .pt file with --single_file)"
    )
    parser.add_argument("--dtype", default="fp16", choices=sorted(DTYPES), help="the weights' dtype in the folder")
    parser.add_argument("--model", default=None, help="the model the checkpoint belongs to, if it does not say")
    parser.add_argument("--single_file", action="store_true", help="convert a sharded folder into one .pt file")
    parser.add_argument(
        "--adapter", action="store_true", help="a LoRA checkpoint: write the peft adapter folder (default: merged)"
    )
    parser.add_argument("--merge", action="store_true", help="a LoRA checkpoint merged into its base (the default)")
    parser.add_argument(
        "--gguf",
        nargs="+",
        default=[],
        choices=GGUF_TYPES,
        metavar="TYPE",
        help=f"also write GGUF files for llama.cpp / Ollama, one per type ({', '.join(GGUF_TYPES)})",
    )
    parser.add_argument("--push_to_hub", default=None, metavar="USER/NAME", help="push the model repo (HF_TOKEN)")
    parser.add_argument("--hub_public", action="store_true", help="create the model repo public (default: private)")
    parser.add_argument("--hub_retries", type=int, default=5, help="pushes tried again after a passing Hub fault")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.single_file:
            if args.dest is None:
                raise ConfigError("--single_file: give the .pt file to write")
            print(f"wrote {to_single_file(Path(args.checkpoint), Path(args.dest))}")
            return 0
        if args.merge and args.adapter:
            raise ConfigError("--merge and --adapter: pick one (merged is the default)")
        release = Release(
            Path(args.checkpoint),
            Path(args.dest) if args.dest else None,
            dtype=args.dtype,
            model=args.model,
            adapter=args.adapter,
            gguf=list(dict.fromkeys(args.gguf)),
            push_to_hub=args.push_to_hub,
            private=not args.hub_public,
            hub_retries=args.hub_retries,
        )
        written = run_release(release, sys.argv[1:] if argv is None else list(argv))
        if written is not None:
            print(f"wrote {written}")
    except (ConfigError, CheckpointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
