"""`python -m fsdp_opt.decodebench`: GRPO's decoding beside transformers' own, on one device, in a process of its own.

    python -m fsdp_opt.decodebench --model random:facebook/opt-1.3b --prompts 8 --new_tokens 128 --json peer.json

The model is a built-in shape with random weights (no download), fp16 on a GPU and fp32 on CPU, unsharded. Each way
decodes `--new_tokens` tokens for each of `--prompts` completions after random prompts of `--prompt_length` tokens
(no end of text: every completion runs its length), `--repeat` times after a warm-up round; the median is reported:

  hf_static  transformers' generate with cache_implementation="static" (greedy; on a GPU transformers compiles the
             decoding step and replays it as CUDA graphs: the peer GRPO's generation is held against);
  static     the run's decoding (engine/decoding.py): one batch, a static KV cache, the run's counter sampler;
  graphs     the same, each decoding step replayed as a CUDA graph (--decoding graphs; CUDA only).

Beside them: the tokens/s a device that only read the weights once a step would reach at its memory bandwidth
(runtime/gpus.MEMORY_GBPS): the bound a decoding step of a small batch is held to. gpu_check runs this after its GRPO
launch, at that launch's shape and batch (benchmarks/decode_step.py takes a step further apart).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from fsdp_opt.engine.decoding import Decoder
from fsdp_opt.engine.generation import Sampling, completion_keys, processors
from fsdp_opt.model.loader import cpu_model
from fsdp_opt.model.sources import load_model_config, resolve_model
from fsdp_opt.runtime.gpus import MEMORY_GBPS

WAYS = ("hf_static", "static", "graphs")


def build(name: str, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """A model of a built-in shape (or tiny-opt) with random weights, in eval mode on `device`."""
    source = resolve_model(name)
    model = cpu_model(source, load_model_config(source), 0, weights=False, dtype=dtype)
    return model.to(device).eval()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def hf_static_round(model: torch.nn.Module, ids: torch.Tensor, new_tokens: int) -> float:
    """Seconds of transformers' generate with its static cache (greedy), every completion its full length."""
    from transformers import GenerationConfig

    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        eos_token_id=None,
        pad_token_id=0,
        use_cache=True,
        num_beams=1,
        cache_implementation="static",
    )
    start = time.perf_counter()
    model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
    sync(ids.device)
    return time.perf_counter() - start


@torch.no_grad()
def decoder_round(model: torch.nn.Module, ids: torch.Tensor, new_tokens: int, decoder: Decoder) -> float:
    """Seconds of the run's decoding (its sampler, no end of text) with `decoder`."""
    keys = completion_keys(0, 1, list(range(len(ids))), [0] * len(ids))
    warp = processors(Sampling(new_tokens), keys, ids.shape[1])
    start = time.perf_counter()
    decoder.decode(
        model,
        ids.tolist(),
        lambda seen, logits: warp(seen, logits).argmax(dim=-1),
        max_new_tokens=new_tokens,
        eos_ids=[],
        pad_id=0,
        device=ids.device,
    )
    sync(ids.device)
    return time.perf_counter() - start


def measure(
    model: torch.nn.Module, ids: torch.Tensor, new_tokens: int, ways: tuple[str, ...], repeat: int
) -> dict[str, Any]:
    """Each way's rounds (after one warm-up round each): {way: {round_s, tokens_per_s[, capture_s]}} or, where a way
    cannot run here, {way: {skipped: why}}."""
    out: dict[str, Any] = {}
    for way in ways:
        if way == "graphs" and ids.device.type != "cuda":
            out[way] = {"skipped": "CUDA graphs need a CUDA device"}
            continue
        if way == "hf_static":
            run = lambda: hf_static_round(model, ids, new_tokens)  # noqa: E731
        else:
            decoder = Decoder(graphs=way == "graphs")
            run = lambda d=decoder: decoder_round(model, ids, new_tokens, d)  # noqa: E731
        warm = run()
        rounds = [run() for _ in range(max(1, repeat))]
        seconds = statistics.median(rounds)
        out[way] = {"round_s": seconds, "tokens_per_s": len(ids) * new_tokens / seconds, "warm_up_s": warm}
        if way != "hf_static":
            out[way]["path"] = decoder.last.path  # graphs: "static" where capture failed
    return out


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m fsdp_opt.decodebench", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="random:facebook/opt-1.3b", help="random:<built-in shape> or tiny-opt")
    p.add_argument("--prompts", type=int, default=8, help="completions decoded at once")
    p.add_argument("--prompt_length", type=int, default=64)
    p.add_argument("--new_tokens", type=int, default=128)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--ways", default=",".join(WAYS), help=f"comma-separated, of {', '.join(WAYS)}")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--json", default=None, help="write the report here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from transformers.utils import logging

    args = parse(argv)
    ways = tuple(w for w in args.ways.split(",") if w)
    unknown = [w for w in ways if w not in WAYS]
    if unknown:
        print(f"error: --ways {unknown[0]}: not one of {', '.join(WAYS)}", file=sys.stderr)
        return 2
    warnings.filterwarnings("ignore", category=FutureWarning)
    logging.set_verbosity_error()
    cuda = torch.cuda.is_available() if args.device == "auto" else args.device == "cuda"
    device = torch.device("cuda" if cuda else "cpu")
    model = build(args.model, device, torch.float16 if cuda else torch.float32)
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.randint(3, vocab, (args.prompts, args.prompt_length), generator=torch.Generator().manual_seed(1234))
    ids = ids.to(device)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    gbps = next((v for k, v in MEMORY_GBPS.items() if k in name), None)
    report: dict[str, Any] = {
        "model": args.model,
        "device": name,
        "dtype": "float16" if cuda else "float32",
        "prompts": args.prompts,
        "prompt_length": args.prompt_length,
        "new_tokens": args.new_tokens,
        "weights_bytes": weights,
        "ways": measure(model, ids, args.new_tokens, ways, args.repeat),
    }
    report["weight_read_bound_tokens_per_s"] = args.prompts * gbps * 1e9 / weights if gbps else None
    print(
        f"{args.model} on {name} ({report['dtype']}), {args.prompts} completions of {args.new_tokens} tokens after "
        f"{args.prompt_length}-token prompts"
    )
    print("| way | tokens/s | a round |")
    print("| --- | --- | --- |")
    for way, r in report["ways"].items():
        print(
            f"| {way} | {r['tokens_per_s']:,.0f} | {r['round_s']:.3f} s |"
            if "skipped" not in r
            else f"| {way} | - | {r['skipped']} |"
        )
    if gbps:
        print(
            f"the weights read once a step at {gbps:.0f} GB/s: {report['weight_read_bound_tokens_per_s']:,.0f} tokens/s"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
