"""GRPO's generation: tokens/s with the model gathered once against FSDP2 gathering it layer by layer, side by side.

    python benchmarks/generation.py --model random:facebook/opt-350m --nproc 2 --json generation.json

The model (a built-in shape with random weights, or a local folder) is loaded as the trainer loads a model of its
own: sharded with FULL_SHARD over the ranks, frozen in the compute dtype (fp16 on a GPU, fp32 on CPU). Every rank
then samples completions of the same length for its own prompts (random token ids, the same for both ways), two ways
in turn, `--repeat` times each:

  gathered        engine/generation.py `gathered`: every FSDP unit unsharded once, resharding after forward off,
                  transformers' generate with its KV cache, then resharded (what --method grpo does);
  layer_by_layer  the shards as they are: every forward, so every decoded token, all-gathers every block
                  (transformers' synced_gpus keeps the ranks' steps together, as on the shards in a run).

Both draw each token with the run's counter-based sampler (engine/generation.py), so both must make the same
completions: the report says whether they did. Reported per way: generated tokens/s per rank (the median round), the
seconds of a round, the all-gathers FSDP2 issued in a round (counted where this torch exposes its all-gather), and the
ratio. The planner's prediction for the same sizes (planner/generation.py, at the T4 rates of the plan) is printed
beside it for a T4; on CPU the link is shared memory, so the ratio here understates a PCIe link's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fsdp_opt.runtime.exits import end_process  # noqa: E402 - after the repository is on the path

WAYS = ("gathered", "layer_by_layer")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model",
        default="random:facebook/opt-125m",
        help="random:<built-in shape> (random weights, offline), tiny-opt, or a local model folder",
    )
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--prompts", type=int, default=8, help="completions each rank generates at once")
    p.add_argument("--prompt_length", type=int, default=64)
    p.add_argument("--new_tokens", type=int, default=32, help="tokens of each completion (no end-of-text: all run)")
    p.add_argument("--repeat", type=int, default=3, help="rounds of each way, in turn (the median is reported)")
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---------------------------------------------------------------- inside torchrun


class GatherCounter:
    """Counts FSDP2's all-gathers (its default all-gather object's calls) while on; None where this torch has no
    such object."""

    def __init__(self) -> None:
        try:
            from torch.distributed.fsdp._fully_shard import _fsdp_collectives as c

            self.target = c.DefaultAllGather
        except (ImportError, AttributeError):
            self.target = None
        self.calls = 0
        if self.target is not None:
            original = self.target.__call__
            counter = self

            def counted(obj, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
                counter.calls += 1
                return original(obj, *args, **kwargs)

            self.target.__call__ = counted

    def take(self) -> int | None:
        n, self.calls = self.calls, 0
        return n if self.target is not None else None


def worker(args: argparse.Namespace) -> int:
    import torch

    from fsdp_opt.engine.generation import Sampling, completion_keys, gathered, generate
    from fsdp_opt.model.sources import load_tokenizer, resolve_model
    from fsdp_opt.runtime.distributed import barrier, init_distributed
    from fsdp_opt.train.reference import Frozen, load_frozen

    counter = GatherCounter()
    env = init_distributed()
    precision = "fp16" if env.device.type == "cuda" else "fp32"
    tokenizer = load_tokenizer(resolve_model(args.model))
    model = load_frozen(Frozen(env, precision, "FULL_SHARD", tokenizer, args.model, seed=0), args.model, "--model")
    vocab = model.get_input_embeddings().num_embeddings
    g = torch.Generator().manual_seed(1234 + env.rank)  # each rank its own prompts, the same for both ways
    prompts = torch.randint(3, min(vocab, len(tokenizer)), (args.prompts, args.prompt_length), generator=g).tolist()
    rows = [env.rank * args.prompts + i for i in range(args.prompts)]
    keys = completion_keys(0, 1, rows, [0] * len(rows))
    sampling = Sampling(args.new_tokens)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def run(way: str) -> tuple[float, list[list[int]], int | None]:
        barrier()
        counter.take()
        start = time.perf_counter()
        with gathered(model, gather=way == "gathered"):
            made = generate(
                model, prompts, keys, sampling, eos_ids=[], pad_id=pad, device=env.device, synced=way != "gathered"
            )
        if env.device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        return seconds, made.ids, counter.take()

    run("gathered")  # warm-up: kernels, allocator
    rounds: dict[str, list[float]] = {w: [] for w in WAYS}
    made: dict[str, list[list[int]]] = {}
    gathers: dict[str, int | None] = {}
    for _ in range(max(1, args.repeat)):
        for way in WAYS:
            seconds, ids, calls = run(way)
            rounds[way].append(seconds)
            made[way], gathers[way] = ids, calls
    tokens = sum(len(c) for c in made["gathered"])
    result = {
        way: {
            "seconds": statistics.median(rounds[way]),
            "rounds_s": rounds[way],
            "tokens_per_second_per_rank": tokens / statistics.median(rounds[way]),
            "all_gathers_per_round": gathers[way],
        }
        for way in WAYS
    }
    result["tokens_per_rank"] = tokens
    same = torch.tensor([int(made["gathered"] == made["layer_by_layer"])], device=env.device)
    torch.distributed.all_reduce(same, op=torch.distributed.ReduceOp.MIN)
    result["same_completions"] = bool(same.item())
    result["device"] = torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else "cpu"
    result["precision"] = precision
    if env.rank == 0 and args.out:
        Path(args.out).write_text(json.dumps(result))
    barrier()
    return 0


# ---------------------------------------------------------------- the launcher


def predicted(args: argparse.Namespace) -> dict[str, float] | None:
    """The planner's seconds for the same sizes on a T4 (its rates), gathered once and layer by layer."""
    from fsdp_opt.model.shapes import Shape, model_config
    from fsdp_opt.model.sources import RANDOM_PREFIX
    from fsdp_opt.planner.generation import generation_time
    from fsdp_opt.planner.inputs import Inputs

    name = args.model.removeprefix(RANDOM_PREFIX)
    try:
        shape = Shape.of(model_config(name))
    except Exception:  # noqa: BLE001 - a folder the planner cannot read: no prediction
        return None
    inputs = Inputs(gpus=args.nproc, max_length=args.prompt_length + args.new_tokens, precision="fp16")
    once = generation_time(shape, "FULL_SHARD", inputs, args.prompts, args.new_tokens, gathered=True)
    layered = generation_time(shape, "FULL_SHARD", inputs, args.prompts, args.new_tokens, gathered=False)
    return {
        "gathered_s": once["seconds"],
        "layer_by_layer_s": layered["seconds"],
        "gathered_over_layer_by_layer_tokens_per_s": layered["seconds"] / once["seconds"],
    }


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.worker:
        return worker(args)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        forwarded = [a for a in (argv if argv is not None else sys.argv[1:])]
        skip = {"--json", "--nproc"}
        kept, i = [], 0
        while i < len(forwarded):
            if forwarded[i] in skip:
                i += 2
                continue
            kept.append(forwarded[i])
            i += 1
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={args.nproc}",
            __file__,
            *kept,
            "--worker",
            "--out",
            str(out),
        ]
        env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONPATH": str(ROOT)}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if not out.exists():
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            print(f"error: the benchmark's workers failed (exit {proc.returncode}): {tail}", file=sys.stderr)
            return 1
        result = json.loads(out.read_text())
    a, b = result["gathered"], result["layer_by_layer"]
    ratio = a["tokens_per_second_per_rank"] / b["tokens_per_second_per_rank"]
    report = {
        "model": args.model,
        "nproc": args.nproc,
        "prompts_per_rank": args.prompts,
        "prompt_length": args.prompt_length,
        "new_tokens": args.new_tokens,
        **result,
        "gathered_over_layer_by_layer_tokens_per_s": ratio,
        "t4_prediction": predicted(args),
        "machine": {
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "command": " ".join(["python", "benchmarks/generation.py", *(argv or sys.argv[1:])]),
        },
    }
    print(
        f"{args.model}, {args.nproc} ranks ({result['device']}, {result['precision']}), {args.prompts} completions "
        f"of {args.new_tokens} tokens per rank after {args.prompt_length}-token prompts"
    )
    print("| way | tokens/s per rank | seconds per round | all-gathers per round |")
    print("| --- | --- | --- | --- |")
    for way in WAYS:
        r = result[way]
        calls = "-" if r["all_gathers_per_round"] is None else str(r["all_gathers_per_round"])
        print(f"| {way} | {r['tokens_per_second_per_rank']:.1f} | {r['seconds']:.3f} | {calls} |")
    print(f"gathered_over_layer_by_layer_tokens_per_s: {ratio:.2f}; same completions: {result['same_completions']}")
    if report["t4_prediction"]:
        t4 = report["t4_prediction"]
        print(
            f"the plan for 2 x T4 at these sizes: gathered {t4['gathered_s']:.3f} s, layer by layer "
            f"{t4['layer_by_layer_s']:.3f} s ({t4['gathered_over_layer_by_layer_tokens_per_s']:.1f}x)"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0 if result["same_completions"] else 1


if __name__ == "__main__":
    end_process(main)
