"""What one decoding step of GRPO's generation costs on one device, taken apart: the model's forward alone, then
transformers' generate around it, then the run's sampler, then LoRA adapters, then the run's own decoding (a static
KV cache; each step replayed as a CUDA graph) and transformers' static-cache generate, side by side in one process.

    python benchmarks/decode_step.py --model random:facebook/opt-1.3b --json decode.json     # on a GPU
    python benchmarks/decode_step.py --model tiny-opt --new_tokens 8                          # on CPU

The model is a built-in shape with random weights (no download), in fp16 on a GPU and fp32 on CPU, unsharded (no
FSDP: gpu_check's GRPO launch gives the gathered model's figure under FSDP2 to set beside these). Every way decodes
`--new_tokens` tokens for `--prompts` completions after random prompts of `--prompt_length` tokens, `--repeat` times
(the median is reported):

  forward        the model's forward on one new token per completion with the KV cache, greedy, in a plain loop;
  generate       transformers' generate (greedy, its KV cache, no end of text: every completion runs its length);
  sampler        generate with the run's counter-based draw (engine/generation.py's logits processors);
  sampler_lora   the same on the model with LoRA adapters of rank `--lora_rank` on every linear layer of the blocks
                 (peft, eval mode), as --method grpo --lora_rank generates without merging them;
  static         the run's decoding (engine/decoding.py, --decoding static): one batch, a static KV cache, the sampler;
  graphs         the same, each step replayed as a CUDA graph (--decoding graphs; on CPU: skipped);
  hf_static      transformers' generate with cache_implementation="static" (on a GPU it compiles the step and replays
                 it as CUDA graphs): the peer (fsdp_opt/commands/decodebench.py has these three, for gpu_check).

Reported per way: milliseconds per decoding step (the round's seconds less its prefill, over the tokens) and
generated tokens/s. Beside them: the milliseconds a step would take if it only read the weights at the device's
memory bandwidth (runtime/gpus.MEMORY_GBPS), what the plan's decoding time counts. The gap is the host's work per
step: Python and kernel launches, which grow with the modules a step runs, not with their size.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402 - after the repository is on the path
from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import GenerationConfig  # noqa: E402
from transformers.utils import logging  # noqa: E402

from fsdp_opt.commands.decodebench import build, measure, sync  # noqa: E402
from fsdp_opt.engine.generation import Sampling, completion_keys, processors  # noqa: E402
from fsdp_opt.runtime.gpus import MEMORY_GBPS  # noqa: E402

WAYS = ("forward", "generate", "sampler", "sampler_lora", "static", "graphs", "hf_static")
LINEAR = ("q_proj", "k_proj", "v_proj", "out_proj", "o_proj", "fc1", "fc2", "gate_proj", "up_proj", "down_proj")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="random:facebook/opt-1.3b", help="random:<built-in shape> or tiny-opt")
    p.add_argument("--prompts", type=int, default=8, help="completions decoded at once")
    p.add_argument("--prompt_length", type=int, default=64)
    p.add_argument("--new_tokens", type=int, default=128)
    p.add_argument("--lora_rank", type=int, default=16)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", default=None, help="write the report here")
    return p.parse_args(argv)


@torch.no_grad()
def forward_loop(model: torch.nn.Module, ids: torch.Tensor, new_tokens: int) -> tuple[float, float]:
    """(prefill seconds, decoding seconds) of a greedy loop over the model's forward with its KV cache."""
    device = ids.device
    start = time.perf_counter()
    out = model(input_ids=ids, use_cache=True)
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    sync(device)
    prefill = time.perf_counter() - start
    cache = out.past_key_values
    for _ in range(new_tokens - 1):
        out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
        cache, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    sync(device)
    return prefill, time.perf_counter() - start - prefill


@torch.no_grad()
def generate_round(model: torch.nn.Module, ids: torch.Tensor, new_tokens: int, sampled: bool) -> float:
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        eos_token_id=None,
        pad_token_id=0,
        use_cache=True,
        num_beams=1,
    )
    keys = completion_keys(0, 1, list(range(len(ids))), [0] * len(ids))
    extra = {"logits_processor": processors(Sampling(new_tokens), keys, ids.shape[1])} if sampled else {}
    start = time.perf_counter()
    model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config, **extra)
    sync(ids.device)
    return time.perf_counter() - start


def with_lora(model: torch.nn.Module, rank: int) -> torch.nn.Module:
    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.05, target_modules=sorted(names & set(LINEAR)))
    return get_peft_model(model, config).eval()


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers renaming past_key_values: the loop's
    logging.set_verbosity_error()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.float16 if cuda else torch.float32
    model = build(args.model, device, dtype)
    vocab = model.get_input_embeddings().num_embeddings
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(3, vocab, (args.prompts, args.prompt_length), generator=g).to(device)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    gbps = next((v for k, v in MEMORY_GBPS.items() if k in name), None)

    rounds: dict[str, list[float]] = {w: [] for w in WAYS[:4]}
    prefills: list[float] = []
    forward_loop(model, ids, 4)  # warm-up: kernels, allocator
    for way in WAYS[:3]:
        for _ in range(max(1, args.repeat)):
            if way == "forward":
                prefill, decode = forward_loop(model, ids, args.new_tokens)
                prefills.append(prefill)
                rounds[way].append(decode)
            else:
                rounds[way].append(generate_round(model, ids, args.new_tokens, way == "sampler"))
    ours = measure(model, ids, args.new_tokens, ("static", "graphs", "hf_static"), args.repeat)
    lora = with_lora(model, args.lora_rank)
    generate_round(lora, ids, 4, True)  # warm-up
    rounds["sampler_lora"] = [generate_round(lora, ids, args.new_tokens, True) for _ in range(max(1, args.repeat))]

    prefill = statistics.median(prefills)
    steps = args.new_tokens - 1  # the first token comes from the prefill
    report: dict = {
        "model": args.model,
        "device": name,
        "dtype": str(dtype).removeprefix("torch."),
        "prompts": args.prompts,
        "prompt_length": args.prompt_length,
        "new_tokens": args.new_tokens,
        "lora_rank": args.lora_rank,
        "weights_bytes": weights,
        "prefill_s": prefill,
        "ways": {},
    }
    for way in WAYS:
        if way in ours:  # the whole rounds decodebench measured (a skipped way says why)
            r = ours[way]
            report["ways"][way] = (
                r if "skipped" in r else {**r, "ms_per_step": 1e3 * max(0.0, r["round_s"] - prefill) / steps}
            )
            continue
        seconds = statistics.median(rounds[way])
        decode = seconds if way == "forward" else max(0.0, seconds - prefill)
        report["ways"][way] = {
            "round_s": seconds,
            "ms_per_step": 1e3 * decode / steps,
            "tokens_per_s": args.prompts * args.new_tokens / (seconds + (prefill if way == "forward" else 0)),
        }
    report["weights_read_ms_per_step"] = 1e3 * weights / (gbps * 1e9) if gbps else None
    print(
        f"{args.model} on {name} ({report['dtype']}), {args.prompts} completions of {args.new_tokens} tokens after "
        f"{args.prompt_length}-token prompts; prefill {1e3 * prefill:.1f} ms"
    )
    print("| way | ms per decoding step | tokens/s |")
    print("| --- | --- | --- |")
    for way in WAYS:
        r = report["ways"][way]
        print(
            f"| {way} | {r['ms_per_step']:.2f} | {r['tokens_per_s']:,.0f} |"
            if "skipped" not in r
            else f"| {way} | - ({r['skipped']}) | - |"
        )
    if gbps:
        print(f"reading the weights once at {gbps:.0f} GB/s: {report['weights_read_ms_per_step']:.2f} ms per step")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
