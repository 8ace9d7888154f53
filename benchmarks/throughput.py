"""Side-by-side throughput and memory, one invocation: every configuration on the same machine, data and global batch.

    python benchmarks/throughput.py --model tiny-opt --dataset python-docs --nproc 2 --json bench.json
    python benchmarks/throughput.py --memory-only --nproc 2            # one row per sharding strategy

Configurations (throughput mode):
  packed      rows joined end to end and cut into max_length blocks (--packing concat), FULL_SHARD, activation
              checkpointing: the fastest layout, where a row attends to the rows before it in its block
  packed_docs fsdp-opt's default, --packing docs: whole rows share a block, each attending only to itself, positions
              from 0 (a block-diagonal causal mask and position_ids); the padded recipe's losses, packed
  padded      every row padded to max_length, as the original recipe did (same engine otherwise)
  hf_trainer  transformers' Trainer with FSDP2 on the same packed blocks, same precision, wrap and global batch
              (on CPU accelerate would use DDP instead; the benchmark switches its FSDP2 plugin on there)
  packed_compiled   packed, with --compile (torch.compile of each block's forward)
  packed_prefetch2  packed, with --prefetch 2 (FSDP2 gathers two blocks ahead in forward and backward)
  packed_lora packed, with --lora_rank 16: peft adapters on every linear layer of the blocks, the base frozen (stored
              in the compute dtype); its state per rank against packed's is the point
  packed_chunked_loss  packed, with --loss_chunk_tokens 256 (the logits 256 tokens at a time); its memory
              effect shows with a large vocabulary: --vocab 50272 (opt-1.3b's) trains a copy of the model
              with that many token embeddings
  chat_docs   python-docs-chat (conversations in the chatml template), --packing docs, loss on the answers only:
              useful tokens are answer tokens
  chat_padded the same rows, one per block, padded (--packing pad)
  chat_all    the same rows and blocks as chat_docs with --train_on all: text rows of exactly the same lengths, every
              token a target; its step time against chat_docs' is what the answer mask costs
Each runs under torchrun in its own processes (--one_launch: all but hf_trainer in one launch, one after another):
warm-up steps, then timed steps. Reported per configuration:
useful (non-pad target) tokens/s, the median step time, MFU (PaLM's 6N + 12·L·H·Q·T FLOPs per token against the
GPU's datasheet peak, or on CPU against a large-matmul peak measured in the same processes), the training state
each rank holds (summed from its local shards) next to the planner's prediction, and peak memory per rank
(CUDA max allocated, or RSS on CPU).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fsdp_opt.runtime.exits import end_process  # noqa: E402 - after the repository is on the path

THROUGHPUT = (
    "packed",
    "packed_docs",
    "padded",
    "hf_trainer",
    "packed_compiled",
    "packed_prefetch2",
    "packed_chunked_loss",
    "packed_lora",
    "chat_docs",
    "chat_padded",
    "chat_all",
)
CHAT = ["--dataset", "python-docs-chat", "--chat_template", "chatml"]  # the chat configurations' rows
MEMORY = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-opt")
    p.add_argument("--dataset", default="python-docs")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--max_length", type=int, default=512)
    p.add_argument("--batch_size", type=int, default=4, help="micro-batch per rank")
    p.add_argument("--accum_steps", type=int, default=1)
    p.add_argument("--precision", default="auto")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run the configurations this many times, round robin, and report each one's median run: "
        "on a shared or throttling machine every configuration then sees the same conditions",
    )
    p.add_argument(
        "--one_launch",
        action="store_true",
        help="run the configurations one after another in one torchrun launch (hf_trainer keeps its own): "
        "the imports and process group are paid once; each peak memory restarts at its configuration "
        "but includes what the ones before left resident",
    )
    p.add_argument("--memory-only", dest="memory_only", action="store_true", help="compare sharding strategies instead")
    p.add_argument("--configs", nargs="*", default=None, help="a subset of the configurations")
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument(
        "--vocab",
        type=int,
        default=None,
        help="train a randomly initialised copy of --model with this vocabulary size (the tokenizer is unchanged)",
    )
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---------------------------------------------------------------- inside torchrun


def cpu_matmul_peak(seconds: float = 1.0) -> float:
    """FLOP/s of a large fp32 matmul in this process, with its thread settings: the CPU's practical peak."""
    import torch

    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    a @ b
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        n += 1
    return 2 * 1024**3 * n / (time.perf_counter() - t0)


class GcClock:
    """Seconds Python's cyclic garbage collector ran between start() and stop(), from gc.callbacks."""

    def __init__(self) -> None:
        self.total, self.t0 = 0.0, None

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.t0 = time.perf_counter()
        elif self.t0 is not None:
            self.total += time.perf_counter() - self.t0

    def start(self) -> None:
        gc.callbacks.append(self._callback)

    def stop(self) -> float:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
        return self.total


def engine_flags(
    args: argparse.Namespace,
    out_dir: str,
    strategy: str = "FULL_SHARD",
    packing: str = "concat",
    extra: list[str] | None = None,
) -> list[str]:
    flags = [
        "--model",
        args.model,
        "--dataset",
        args.dataset,
        "--max_length",
        str(args.max_length),
        "--batch_size",
        str(args.batch_size),
        "--accum_steps",
        str(args.accum_steps),
        "--precision",
        args.precision,
        "--sharding_strategy",
        strategy,
        "--output_dir",
        out_dir,
        "--wandb_mode",
        "disabled",
        "--lr",
        "1e-4",
    ]
    return flags + ["--packing", packing] + (extra or [])


def run_engine(args: argparse.Namespace, name: str, env, out_dir: str) -> dict:
    import torch

    from fsdp_opt.config.parse import parse_args
    from fsdp_opt.engine.step import train_step
    from fsdp_opt.model.parallelize import local_state_bytes
    from fsdp_opt.model.shapes import Shape, model_config
    from fsdp_opt.planner.inputs import Inputs
    from fsdp_opt.planner.memory import memory
    from fsdp_opt.runtime.distributed import peak_memory_bytes
    from fsdp_opt.train.build import setup

    strategy = name if args.memory_only else "FULL_SHARD"
    extra = {
        "packed_compiled": ["--compile"],
        "packed_prefetch2": ["--prefetch", "2"],
        "packed_chunked_loss": ["--loss_chunk_tokens", "256"],
        "packed_lora": ["--lora_rank", "16"],
        "chat_docs": CHAT,
        "chat_padded": CHAT,
        "chat_all": CHAT + ["--train_on", "all"],
    }.get(name, [])
    packing = {
        "padded": "pad",
        "packed_docs": "docs",
        "chat_docs": "docs",
        "chat_all": "docs",
        "chat_padded": "pad",
    }.get(name, "concat")
    config = parse_args(engine_flags(args, out_dir, strategy, packing=packing, extra=extra))
    s = setup(config, env)
    times, tokens, seen = [], 0, 0
    epoch, last = 0, None
    gc_clock = GcClock()
    while len(times) < args.warmup + args.steps:
        for step in s.plan.steps(epoch):
            if len(times) == args.warmup:
                gc_clock.start()  # before the first timed step
            if env.device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            train_step(s, step)
            if env.device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            if len(times) > args.warmup:
                tokens += step.target_tokens
                seen += step.seen_tokens
            last = step
            if len(times) == args.warmup + args.steps:
                break
        epoch += 1
    gc_seconds = gc_clock.stop()
    # One more backward without a step, so gradients exist next to parameters and Adam state.
    s.model(**s.blocks.batch(last.micro_batches[0], env.device)).loss.backward()
    state = local_state_bytes(s.model, s.optimizer)
    shape = Shape.of(model_config(args.model))
    inputs = Inputs(
        gpus=env.world_size,
        nodes=env.num_nodes,
        precision=s.precision,
        cuda=env.device.type == "cuda",
        lora_rank=config.lora.lora_rank,
    )
    planned = memory(shape, strategy, inputs)
    timed = times[args.warmup :]
    return {
        "useful_tokens_per_s": tokens / sum(timed),
        "seen_tokens_per_s": seen / sum(timed),
        "step_time_s": statistics.median(timed),
        "flops_per_token": s.flops_per_token,
        "global_batch": s.plan.global_batch,
        "peak_state_bytes_per_rank": state["total"],
        "predicted_state_bytes_per_rank": planned["parameters"] + planned["gradients"] + planned["optimizer"],
        "peak_memory_bytes_per_rank": peak_memory_bytes(env.device),
        "gc_seconds": gc_seconds,
        "precision": s.precision,
        "strategy": strategy,
    }


def measure(args: argparse.Namespace, name: str, env, peak_per_rank: float) -> dict:
    """One configuration in this launch's processes; an error is its result (the others still run)."""
    import torch

    from fsdp_opt.runtime.hostmem import reset_peak

    out_dir = tempfile.mkdtemp(prefix="bench-")
    gc.collect()  # what a configuration before this one left
    if env.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(env.device)
    else:
        reset_peak()
    try:
        if name == "hf_trainer":
            from hf_trainer import run_hf_trainer  # benchmarks/, the script's own folder

            result = run_hf_trainer(args, env, out_dir)
        else:
            result = run_engine(args, name, env, out_dir)
    except Exception as exc:  # noqa: BLE001 - reported in the table, the other configurations still run
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
    result["peak_flops_per_rank"] = peak_per_rank
    if env.device.type == "cuda":
        result["peak_source"] = f"datasheet, {torch.cuda.get_device_name()}"
    else:
        result["peak_source"] = "measured fp32 1024x1024 matmul, all ranks at once"
    peak_total = peak_per_rank * env.world_size
    # The model computes every real token, trained on or not (a prompt's): utilisation counts the tokens seen.
    per_s = result.get("seen_tokens_per_s", result["useful_tokens_per_s"])
    result["mfu"] = per_s * result["flops_per_token"] / peak_total if peak_total else None
    return result


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from fsdp_opt.runtime.distributed import init_distributed, peak_flops, teardown

    env = init_distributed("auto")
    try:
        if env.device.type == "cuda":
            peak = peak_flops(env.device) or 0.0
        else:
            measured = torch.tensor(cpu_matmul_peak())
            if env.world_size > 1:  # the ranks share the CPU: measure at the same time, add up
                dist.all_reduce(measured)
            peak = float(measured) / env.world_size
        results = {name: measure(args, name, env, peak) for name in args.worker.split(",")}
        if env.rank == 0:
            Path(args.out).write_text(json.dumps(results))
    finally:
        teardown()


# ---------------------------------------------------------------- the driver


def machine() -> dict:
    import torch

    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
    }
    try:
        model_name = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
        info["cpu"] = model_name
    except (OSError, StopIteration):
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["gpu_count"] = torch.cuda.device_count()
    return info


def widened_model(model: str, vocab: int, folder: str) -> str:
    """A model folder: `model`'s config with `vocab` token embeddings, random weights, the same tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    from fsdp_opt.model.sources import load_model_config, load_tokenizer, resolve_model

    source = resolve_model(model)
    config = load_model_config(source)
    config.vocab_size = vocab
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    load_tokenizer(source).save_pretrained(folder)
    return folder


def launch(args: argparse.Namespace, names: list[str], argv: list[str]) -> dict[str, dict]:
    """The configurations `names`, one after another, in one torchrun launch: each one's result."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={args.nproc}",
            __file__,
            *argv,
            "--worker",
            ",".join(names),
            "--out",
            str(out),
        ]
        env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONPATH": str(ROOT)}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if out.exists():
            return json.loads(out.read_text())
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {name: {"error": f"exit {proc.returncode}: {tail}"} for name in names}


def launcher(args: argparse.Namespace, names: list[str], argv: list[str]) -> Callable[[str], dict]:
    """`run(name)` for rounds(): a launch per configuration, or with --one_launch the first configuration a round asks
    for launches all of that round's but hf_trainer (transformers' Trainer sets up its own state: a launch of its own)."""
    if not args.one_launch:
        return lambda name: launch(args, [name], argv)[name]
    together = [n for n in names if n not in ("hf_trainer", "HYBRID_SHARD")]
    done: dict[str, dict] = {}

    def run(name: str) -> dict:
        if name not in together:
            return launch(args, [name], argv)[name]
        if name not in done:
            done.update(launch(args, together, argv))
        return done.pop(name)

    return run


def rounds(names: list[str], repeat: int, run: Callable[[str], dict]) -> dict[str, dict]:
    """Each configuration `repeat` times, round robin (`run(name)` launches one), and per configuration its median run
    (the lower middle by useful tokens/s) with every run's tokens/s beside it; a configuration that never ran keeps
    its first error."""
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for round_ in range(max(1, repeat)):
        for name in names:
            if name == "HYBRID_SHARD":
                runs[name] = [{"error": "needs 2 or more nodes (it is NO_SHARD across nodes of one rank here)"}]
                continue
            print(f"running {name} ..." + (f" (round {round_ + 1} of {repeat})" if repeat > 1 else ""), flush=True)
            runs[name].append(run(name))
    picked = {}
    for name, results in runs.items():
        ok_runs = sorted((r for r in results if "error" not in r), key=lambda r: r["useful_tokens_per_s"])
        if not ok_runs:
            picked[name] = results[0]
            continue
        picked[name] = dict(ok_runs[(len(ok_runs) - 1) // 2])
        if len(results) > 1:
            picked[name]["runs_useful_tokens_per_s"] = [r.get("useful_tokens_per_s") for r in results]
    return picked


def table(report: dict) -> str:
    def mib(n):
        return "-" if n is None else f"{n / 2**20:,.1f} MiB"

    rows = [
        "| config | useful tokens/s | step time | MFU | state/rank (measured) | state/rank (planner) | peak memory/rank |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in report["configs"].items():
        if "error" in r:
            rows.append(f"| {name} | not run: {r['error']} | | | | | |")
            continue
        mfu = "-" if r.get("mfu") is None else f"{100 * r['mfu']:.2f}%"
        rows.append(
            f"| {name} | {r['useful_tokens_per_s']:,.0f} | {r['step_time_s'] * 1000:,.1f} ms | {mfu} | "
            f"{mib(r['peak_state_bytes_per_rank'])} | {mib(r['predicted_state_bytes_per_rank'])} | {mib(r['peak_memory_bytes_per_rank'])} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if args.worker:
        worker(args)
        return 0
    names = args.configs or list(MEMORY if args.memory_only else THROUGHPUT)
    workdir = tempfile.TemporaryDirectory(prefix="bench-model-") if args.vocab else None
    if workdir:
        args.model = widened_model(args.model, args.vocab, workdir.name)
    passthrough = [
        "--model",
        args.model,
        "--dataset",
        args.dataset,
        "--max_length",
        str(args.max_length),
        "--batch_size",
        str(args.batch_size),
        "--accum_steps",
        str(args.accum_steps),
        "--precision",
        args.precision,
        "--warmup",
        str(args.warmup),
        "--steps",
        str(args.steps),
    ]
    passthrough += ["--memory-only"] if args.memory_only else []
    report = {
        "configs": rounds(names, args.repeat, launcher(args, names, passthrough)),
        "machine": machine(),
        "settings": {k: v for k, v in vars(args).items() if k not in ("worker", "out", "json")},
    }
    ratios = {}
    c = report["configs"]
    ok = {k: v for k, v in c.items() if "error" not in v}
    if "packed_docs" in ok and "padded" in ok:
        ratios["packed_docs_over_padded_tokens_per_s"] = (
            ok["packed_docs"]["useful_tokens_per_s"] / ok["padded"]["useful_tokens_per_s"]
        )
    if "packed_docs" in ok and "packed" in ok:
        ratios["packed_docs_over_packed_tokens_per_s"] = (
            ok["packed_docs"]["useful_tokens_per_s"] / ok["packed"]["useful_tokens_per_s"]
        )
        ratios["packed_docs_over_packed_peak_memory"] = (
            ok["packed_docs"]["peak_memory_bytes_per_rank"] / ok["packed"]["peak_memory_bytes_per_rank"]
        )
    if "packed" in ok and "padded" in ok:
        ratios["packed_over_padded_tokens_per_s"] = (
            ok["packed"]["useful_tokens_per_s"] / ok["padded"]["useful_tokens_per_s"]
        )
    if "packed" in ok and "hf_trainer" in ok:
        ratios["packed_over_hf_trainer_tokens_per_s"] = (
            ok["packed"]["useful_tokens_per_s"] / ok["hf_trainer"]["useful_tokens_per_s"]
        )
    if "packed" in ok and "packed_chunked_loss" in ok:
        ratios["packed_chunked_loss_over_packed_peak_memory"] = (
            ok["packed_chunked_loss"]["peak_memory_bytes_per_rank"] / ok["packed"]["peak_memory_bytes_per_rank"]
        )
        ratios["packed_chunked_loss_over_packed_tokens_per_s"] = (
            ok["packed_chunked_loss"]["useful_tokens_per_s"] / ok["packed"]["useful_tokens_per_s"]
        )
    if "packed" in ok and "packed_lora" in ok:
        ratios["packed_lora_over_packed_state"] = (
            ok["packed_lora"]["peak_state_bytes_per_rank"] / ok["packed"]["peak_state_bytes_per_rank"]
        )
        ratios["packed_lora_over_packed_tokens_per_s"] = (
            ok["packed_lora"]["useful_tokens_per_s"] / ok["packed"]["useful_tokens_per_s"]
        )
    if "chat_docs" in ok and "chat_padded" in ok:
        ratios["chat_docs_over_chat_padded_answer_tokens_per_s"] = (
            ok["chat_docs"]["useful_tokens_per_s"] / ok["chat_padded"]["useful_tokens_per_s"]
        )
    if "chat_docs" in ok and "chat_all" in ok:
        ratios["chat_docs_over_chat_all_step_time"] = ok["chat_docs"]["step_time_s"] / ok["chat_all"]["step_time_s"]
    if "FULL_SHARD" in ok and "NO_SHARD" in ok:
        ratios["full_shard_over_no_shard_state"] = (
            ok["FULL_SHARD"]["peak_state_bytes_per_rank"] / ok["NO_SHARD"]["peak_state_bytes_per_rank"]
        )
    for name, r in ok.items():
        if r.get("predicted_state_bytes_per_rank"):
            ratios[f"{name}_planner_error"] = r["predicted_state_bytes_per_rank"] / r["peak_state_bytes_per_rank"] - 1
    report["ratios"] = ratios
    print(table(report))
    for k, v in ratios.items():
        print(f"{k}: {v:.3f}")
    for name, r in ok.items():
        if r.get("gc_seconds") is not None:
            share = r["gc_seconds"] / (r["step_time_s"] * args.steps)
            print(
                f"{name}: Python's garbage collector ran {r['gc_seconds'] * 1000:.1f} ms in the timed steps (~{100 * share:.2f}%)"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    end_process(main)
