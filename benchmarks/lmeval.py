"""lm-eval's scoring: the project's interface (engine/lmeval.py, on the model gathered once) against lm-eval's own
HFLM, requests per second, side by side in one run.

    python benchmarks/lmeval.py --model random:facebook/opt-125m --limit 40 --batch_size 8 --json lmeval.json

The model (a built-in shape with random weights, a tiny-opt, or a local folder) is first written as a Hugging Face
folder, as `fsdp-opt export` writes one; both sides read that folder. The tasks are the three docs/tasks ships (a
multiple-choice task, a generate_until task and a perplexity task), `--limit` documents each. Three runs, one after
another, each at `--threads` threads per process and the same `--batch_size` per process:

  hflm      lm-eval's HFLM(pretrained=folder), one process (its own loading and batching);
  ours x1   fsdp-opt's ModelLM on one rank (the folder loaded and sharded as `evaluate --tasks` loads it);
  ours x2   the same on two ranks (torchrun, gloo): each rank its share of the documents.

Each reports the seconds its model calls took (loglikelihood, loglikelihood_rolling, generate_until: the slowest
rank's), the requests they answered (all ranks: lm-eval repeats a rank's last ones to even out the ranks' counts),
the documents' requests a second (HFLM's count over the seconds), and the ratio to HFLM's; and whether the scores are
HFLM's (every metric within 1e-4, relative). The three runs take turns, `--repeat` rounds, and each figure is the
median round's. A loaded machine slows every process by what the others take of its cores: beside the wall clock,
each run reports the CPU seconds its calls took (the slowest rank's; one thread a process), whose ratio is what a
quiet machine's clock would show when the ranks wait for nothing (no collective runs while they score). The machine
and its load (the 1-minute load average before and after) go in the report.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fsdp_opt.runtime.exits import end_process  # noqa: E402 - after the repository is on the path

TASKS = ("pydocs_choice", "pydocs_complete", "pydocs_perplexity")
CALLS = ("loglikelihood", "loglikelihood_rolling", "generate_until")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="random:facebook/opt-125m", help="random:<shape>, tiny-opt, or a model folder")
    p.add_argument("--limit", type=int, default=40, help="documents of each task")
    p.add_argument("--batch_size", type=int, default=8, help="requests a forward, per process (both sides)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (both sides)")
    p.add_argument("--ranks", default="1,2", help="rank counts of the project's runs")
    p.add_argument("--repeat", type=int, default=1, help="rounds of the runs, taking turns (the median is reported)")
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--folder", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def task_files(folder: Path) -> list[str]:
    """docs/tasks' YAMLs with their data files by absolute path (lm-eval reads a relative one from the cwd)."""
    out = []
    for name in TASKS:
        text = (ROOT / "docs" / "tasks" / f"{name}.yaml").read_text()
        (folder / f"{name}.yaml").write_text(text.replace("docs/tasks/", f"{ROOT}/docs/tasks/"))
        out.append(str(folder / f"{name}.yaml"))
    return out


def timed(cls) -> dict[str, float]:  # noqa: ANN001
    """The class's model calls timed (seconds and requests by call), in place."""
    spent = {"seconds": 0.0, "cpu_seconds": 0.0, "requests": 0}
    for name in CALLS:
        inner = getattr(cls, name)

        def call(self, requests, *args, _inner=inner, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            started, cpu = time.perf_counter(), time.process_time()
            out = _inner(self, requests, *args, **kwargs)
            spent["seconds"] += time.perf_counter() - started
            spent["cpu_seconds"] += time.process_time() - cpu
            spent["requests"] += len(requests)
            return out

        setattr(cls, name, call)
    return spent


def worker(args: argparse.Namespace) -> int:
    import logging

    import torch

    torch.set_num_threads(args.threads)
    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    folder = Path(args.folder)
    tasks = task_files(folder.parent)
    if args.worker == "hflm":
        from lm_eval import simple_evaluate
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager

        spent = timed(HFLM)
        lm = HFLM(pretrained=str(folder), device="cpu", batch_size=args.batch_size, dtype="float32")
        results = simple_evaluate(model=lm, tasks=tasks, task_manager=TaskManager(), limit=args.limit)
        ranks, slowest, cpu = 1, spent["seconds"], spent["cpu_seconds"]
        requests = spent["requests"]
    else:
        import torch.distributed as dist

        from fsdp_opt.config.methods import CAUSAL_LM
        from fsdp_opt.engine.benchmarks import Scoring, TaskSettings, metric_table, score
        from fsdp_opt.engine.lmeval import ModelLM
        from fsdp_opt.model.sources import load_model_config, load_tokenizer, resolve_model
        from fsdp_opt.runtime.distributed import init_distributed, teardown
        from fsdp_opt.train.compare import load_candidate
        from fsdp_opt.train.scores import read_tasks

        env = init_distributed("cpu")
        spent = timed(ModelLM)
        loaded = read_tasks(TaskSettings(tasks=tasks, limit=args.limit))
        source = resolve_model(str(folder))
        entry = {"name": "export", "kind": "hf", "path": str(folder)}
        model = load_candidate(entry, source, load_model_config(source), CAUSAL_LM, "fp32", "FULL_SHARD", 0, env)
        results = score(model, load_tokenizer(source), env, loaded, Scoring(args.batch_size), "export")
        most = torch.tensor([spent["seconds"], spent["cpu_seconds"]], dtype=torch.float64)
        count = torch.tensor([float(spent["requests"])], dtype=torch.float64)
        if env.world_size > 1:
            dist.all_reduce(most, op=dist.ReduceOp.MAX)
            dist.all_reduce(count)
        ranks, slowest, cpu, requests = env.world_size, float(most[0]), float(most[1]), int(count[0])
        teardown()
        if env.rank:
            return 0
        results = {"results": {t: dict(v) for t, v in metric_table(results).items()}}
    scores = {t: {k: v for k, v in vals.items() if isinstance(v, float)} for t, vals in results["results"].items()}
    record = {"way": args.worker, "ranks": ranks, "seconds": slowest, "cpu_seconds": cpu, "requests": requests}
    record["scores"] = scores
    Path(args.out).write_text(json.dumps(record))
    return 0


def same(a: dict, b: dict) -> bool:
    return all(
        abs(a[t][k] - v) <= 1e-4 * max(1.0, abs(v)) for t, vals in b.items() for k, v in vals.items() if "," in k
    )


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.worker:
        return worker(args)
    from fsdp_opt.model.loader import cpu_model
    from fsdp_opt.model.sources import load_model_config, load_tokenizer, resolve_model

    tmp = Path(tempfile.mkdtemp(prefix="lmeval-bench-"))
    folder = tmp / "export"
    source = resolve_model(args.model)
    config = load_model_config(source)
    cpu_model(source, config, 0).save_pretrained(folder)
    load_tokenizer(source).save_pretrained(folder)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    common = ["--folder", str(folder), "--limit", str(args.limit), "--batch_size", str(args.batch_size)]
    common += ["--threads", str(args.threads)]
    load_before = os.getloadavg()[0]
    runs = [("hflm", 1)] + [("ours", int(n)) for n in args.ranks.split(",")]
    rounds: dict[tuple[str, int], list[dict]] = {run: [] for run in runs}
    for turn, (way, ranks) in [(t, run) for t in range(args.repeat) for run in runs]:
        out = tmp / f"{way}-{ranks}-{turn}.json"
        launch = [sys.executable] if way == "hflm" else [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        launch += [] if way == "hflm" else [f"--nproc_per_node={ranks}"]
        cmd = [*launch, str(Path(__file__).resolve()), "--worker", way, "--out", str(out), *common]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0:
            print(proc.stdout[-2000:] + proc.stderr[-4000:], file=sys.stderr)
            return 1
        rounds[(way, ranks)].append(json.loads(out.read_text()))
    rows = [sorted(done, key=lambda r: r["seconds"])[len(done) // 2] for done in rounds.values()]  # the median round
    base = rows[0]
    for row, done in zip(rows, rounds.values()):
        row["rounds_seconds"] = [round(r["seconds"], 2) for r in done]
        # the documents' requests (HFLM's count): the copies lm-eval adds to even out the ranks are this side's cost
        row["requests_per_second"] = base["requests"] / row["seconds"]
        row["ratio"] = base["seconds"] / row["seconds"]
        row["ratio_cpu"] = base["cpu_seconds"] / row["cpu_seconds"]
        row["same_scores"] = all(same(r["scores"], base["scores"]) for r in done)
    report = {
        "model": args.model,
        "limit": args.limit,
        "batch_size": args.batch_size,
        "threads_per_process": args.threads,
        "repeat": args.repeat,
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "runs": rows,
    }
    print(markdown(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


def markdown(report: dict) -> str:
    lines = [
        f"lm-eval scoring of {report['model']} ({', '.join(TASKS)}, {report['limit']} documents each), batch "
        f"{report['batch_size']}, {report['threads_per_process']} thread(s) per process, {report['machine']}, load "
        f"average {report['load_average'][0]} before, {report['load_average'][1]} after:",
        "",
        "| run | ranks | requests answered | seconds (rounds) | requests/s | against HFLM | CPU s (slowest rank) | against HFLM, "
        "by CPU time | scores as HFLM's |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in report["runs"]:
        name = "lm-eval HFLM" if r["way"] == "hflm" else "fsdp-opt ModelLM"
        lines.append(
            f"| {name} | {r['ranks']} | {r['requests']} | {r['seconds']:.2f} ({', '.join(map(str, r['rounds_seconds']))})"
            f" | {r['requests_per_second']:.2f} | {r['ratio']:.2f}x | {r['cpu_seconds']:.2f} | {r['ratio_cpu']:.2f}x | "
            f"{'yes' if r['same_scores'] else 'NO'} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    end_process(lambda: main())
