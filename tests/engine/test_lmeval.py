"""lm-eval's interface over the project's model (engine/lmeval.py, `fsdp-opt evaluate --tasks`): on an exported
checkpoint of a small model, in fp32, on 2 ranks (FSDP2 over gloo, 2 processes), with 7 documents a task (2 does not
divide them), every metric and every sample equal to lm-eval's own HFLM on the same folder in one process: a
multiple-choice task, a generate_until task and a loglikelihood_rolling (perplexity) task, from task YAMLs over local
files (the ones docs/ ships), and lm-eval's own arc_easy read from a copy of its dataset on the loopback Hub."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import HF_TOK, ROOT, assert_clean_failure, built_once, hub_env, launch, read_jsonl, run_cli, wandb_records
from hubdata import PARAGRAPHS, card, repo_files
from hubserver import HubServer

from benchmarks.lmeval import TASKS as TASK_YAMLS
from benchmarks.lmeval import task_files
from fsdp_opt.commands.notebook import plot_benchmarks
from fsdp_opt.tracking.scoretable import series

LIMIT = "7"  # documents of each task: 4 on rank 0, 3 on rank 1
TOLERANCE = 1e-5  # a log-likelihood's, relative to its size (at least 1): fp32 sums over a batch laid out otherwise


def arc_rows(split: str, n: int) -> list[dict]:
    """ARC's columns (id, question, choices {text, label}, answerKey), the questions made from Python's docs."""
    rows = []
    for i in range(n):
        words = [PARAGRAPHS[(5 * i + k * 11) % len(PARAGRAPHS)].split(" ") for k in range(4)]
        rows.append(
            {
                "id": f"{split}-{i}",
                "question": f"Which words follow '{' '.join(words[0][:6])}'?",
                "choices": {"text": [" ".join(w[6:9]) for w in words], "label": ["A", "B", "C", "D"]},
                "answerKey": "ABCD"[i % 4],
            }
        )
    return rows


def arc_repo(root: Path) -> dict:
    """allenai/ai2_arc as the Hub lays it: a folder of parquet files a config, a card naming them."""
    configs = {}
    for config in ("ARC-Easy", "ARC-Challenge"):
        (root / config).mkdir(parents=True)
        for split, n in (("train", 6), ("validation", 4), ("test", 9)):
            pq.write_table(pa.Table.from_pylist(arc_rows(split, n)), root / config / f"{split}-00000-of-00001.parquet")
        configs[config] = {s: f"{config}/{s}-*" for s in ("train", "validation", "test")}
    (root / "README.md").write_text(card(configs))
    return repo_files(root)


@pytest.fixture(scope="module")
def exported(tmp_path_factory, det_model) -> Path:
    """A 2-rank training run of a small OPT, exported in fp32 (`--export_hf`): a Hugging Face folder."""

    def build(folder: Path) -> None:
        proc = run_cli(
            [
                *("--model", str(det_model), "--dataset", "python-docs", "--start_idx", "0", "--end_idx", "40"),
                *("--max_length", "64", "--batch_size", "2", "--lr", "3e-3", "--precision", "fp32"),
                *("--output_dir", "out", "--export_hf", "out/export", "--export_dtype", "fp32"),
            ],
            folder,
            nproc=2,
        )
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]

    return built_once(tmp_path_factory, "lmeval-export", build) / "out" / "export"


def read_output(folder: Path) -> tuple[dict, dict[str, list[dict]]]:
    """lm-eval's results JSON and samples (by task, in document order) under one model's --output_path folder."""
    (results,) = folder.glob("results_*.json")
    samples = {}
    for path in folder.glob("samples_*.jsonl"):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        samples[path.name[len("samples_") :].rsplit("_", 1)[0]] = sorted(rows, key=lambda r: r["doc_id"])
    return json.loads(results.read_text()), samples


def close(a: float, b: float) -> bool:
    return abs(a - b) <= TOLERANCE * max(1.0, abs(b))


def assert_same(mine: Path, reference: Path, tasks: list[str]) -> dict[str, int]:
    """Every metric of every task, and each sample's responses: log-likelihoods within TOLERANCE with their is-greedy
    flags, generated strings equal. Returns the samples compared a task."""
    ours, our_samples = read_output(mine)
    theirs, their_samples = read_output(reference)
    compared = {}
    for task in tasks:
        a, b = ours["results"][task], theirs["results"][task]
        metrics = [k for k, v in b.items() if "," in k and isinstance(v, (int, float))]
        assert metrics, b
        for key in metrics:
            assert math.isclose(a[key], b[key], rel_tol=1e-6, abs_tol=1e-9), (task, key, a[key], b[key])
        kind = theirs["configs"][task]["output_type"]
        samples_a = {s["doc_id"]: s for s in our_samples[task]}
        samples_b = {s["doc_id"]: s for s in their_samples[task]}
        assert sorted(samples_a) == sorted(samples_b) == list(range(int(LIMIT))), task
        for doc, theirs_doc in samples_b.items():
            for resp_a, resp_b in zip(samples_a[doc]["resps"], theirs_doc["resps"], strict=True):
                # a request lm-eval repeated to even out the ranks' counts holds a response each time it ran
                assert resp_a == [resp_a[0]] * len(resp_a), (task, doc, resp_a)
                x, (y,) = resp_a[0], resp_b
                if kind == "generate_until":  # the text itself
                    assert x == y, (task, doc, x, y)
                elif kind == "loglikelihood_rolling":  # the document's log-likelihood
                    assert close(float(x), float(y)), (task, doc, x, y)
                else:  # (log-probability, is greedy)
                    assert close(float(x[0]), float(y[0])) and x[1] == y[1], (task, doc, x, y)
        compared[task] = len(samples_b)
    return compared


def evaluate(args: list[str], cwd: Path, env=None, nproc: int = 2):  # noqa: ANN001
    return launch(["-m", "fsdp_opt.evaluate"], args, cwd, nproc, timeout=600, env=env)


def reference(exported: Path, out: Path, tasks: str, cwd: Path, env=None, adapter: Path | None = None):  # noqa: ANN001
    """lm-eval's HFLM on the folder (with peft's adapters from `adapter`), one process: lm-eval's output under out."""
    args = [str(exported), str(out), tasks, LIMIT, "3"] + ([str(adapter)] if adapter else [])
    proc = launch([str(ROOT / "tests" / "workers" / "hflm_reference.py")], args, cwd, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def test_two_ranks_score_what_lm_evals_hflm_scores_on_the_exported_folder(tmp_path, exported):
    tasks = ",".join(task_files(tmp_path))
    args = ["--checkpoints", str(exported), "--no_base", "--tasks", tasks, "--limit", LIMIT, "--batch_size", "3"]
    args += ["--log_samples", "--output_path", "ours", "--precision", "fp32", "--json", "report.json"]
    proc = evaluate(args, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "on the model gathered once" in proc.stdout
    reference(exported, tmp_path / "theirs", tasks, tmp_path)
    compared = assert_same(tmp_path / "ours" / "export", tmp_path / "theirs" / "reference", list(TASK_YAMLS))
    assert compared == dict.fromkeys(TASK_YAMLS, int(LIMIT))
    report = json.loads((tmp_path / "report.json").read_text())
    (row,) = report["models"]
    results, _ = read_output(tmp_path / "ours" / "export")
    assert row["benchmarks"]["pydocs_choice"]["acc,none"] == results["results"]["pydocs_choice"]["acc,none"]
    assert "acc_stderr,none" in row["benchmarks"]["pydocs_choice"]
    assert "| export | " in proc.stdout  # the report's row


def test_arc_easy_from_the_loopback_hub_on_the_shards_equals_hflm(tmp_path, exported):
    """lm-eval's own arc_easy (its task file, its dataset's layout) on the model's shards (each forward a collective,
    the ranks in lockstep)."""
    with HubServer() as server:
        server.commit_dataset("allenai/ai2_arc", arc_repo(tmp_path / "arc"))
        env = hub_env(tmp_path, server, "ours")
        args = ["--checkpoints", str(exported), "--no_base", "--tasks", "arc_easy", "--limit", LIMIT]
        args += ["--gather_model", "false"]
        args += ["--batch_size", "3", "--log_samples", "--output_path", "ours", "--precision", "fp32"]
        proc = evaluate(args, tmp_path, env=env)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "on the shards" in proc.stdout
        reference(exported, tmp_path / "theirs", "arc_easy", tmp_path, env=hub_env(tmp_path, server, "theirs"))
        assert server.count("dataset-resolve") > 0
    assert assert_same(tmp_path / "ours" / "export", tmp_path / "theirs" / "reference", ["arc_easy"]) == {
        "arc_easy": int(LIMIT)
    }


def unsafe_task(folder: Path) -> str:
    text = (ROOT / "docs" / "tasks" / "pydocs_complete.yaml").read_text()
    text = text.replace("task: pydocs_complete", "task: runs_code\nunsafe_code: true")
    (folder / "runs_code.yaml").write_text(text.replace("docs/tasks/", f"{ROOT}/docs/tasks/"))
    return str(folder / "runs_code.yaml")


def test_unknown_unreadable_and_unsafe_tasks_stop_before_training_in_one_line(tmp_path):
    train = ["--model", "tiny-opt", "--dataset", "python-docs", "--end_idx", "16", "--max_length", "32"]
    train += ["--output_dir", "out", "--hf_repo", "user/never"]  # a lease would be taken at the Hub (dead here)
    missing = tmp_path / "missing.yaml"
    missing.write_text((ROOT / "docs/tasks/pydocs_choice.yaml").read_text().replace("docs/tasks/", "/nowhere/"))
    cases = [
        (["--eval_tasks", "no_such_task"], 0, ("--eval_tasks no_such_task", "no such lm-eval task")),
        (["--eval_tasks", str(missing)], 2, ("--eval_tasks", "missing.yaml", "its data could not be read")),
        (["--eval_tasks", unsafe_task(tmp_path)], 0, ("runs_code", "--eval_confirm_run_unsafe_code")),
    ]
    for flags, nproc, needles in cases:
        proc = run_cli(train + flags, tmp_path, nproc=nproc)
        assert_clean_failure(proc, *needles)
        assert not (tmp_path / "out").exists()  # nothing trained, nothing written
    # evaluate: lm-eval's flags without --tasks; a task that does not exist, on 2 ranks (no rank left waiting)
    assert_clean_failure(evaluate(["--limit", "3"], tmp_path, nproc=0), "--limit", "only with --tasks")
    proc = evaluate(["--model", "tiny-opt", "--checkpoints", "--tasks", "no_such_task"], tmp_path)
    assert_clean_failure(proc, "--tasks no_such_task", "no such lm-eval task")


def test_two_chained_sessions_score_each_save_in_wandb_eval_jsonl_and_the_card_as_evaluate_does(tmp_path):
    """--eval_tasks along a chain of two sessions (2 ranks, the loopback Hub, W&B offline for real): the scores of
    every save in W&B's history at its step beside eval/loss (one run across the sessions), in eval.jsonl, in the
    checkpoint's index entry and on the card; each equal to `evaluate --tasks` on the same checkpoint afterwards."""
    tasks = ",".join(task_files(tmp_path)[0::2])  # a multiple-choice task and a perplexity one
    common = [*("--model", "tiny-opt", "--dataset", "python-docs", "--max_length", "64", "--batch_size", "2"), "--lr"]
    common += ["3e-3", "--save_every_steps", "3", "--keep_last", "0", "--eval_rows", "8", "--eval_tasks", tasks]
    common += ["--eval_limit", LIMIT, "--hf_repo", "me/scored", "--hub_keep_full", "0"]
    sessions = [
        ["--start_idx", "0", "--end_idx", "16"],
        ["--start_idx", "16", "--end_idx", "32", "--resume_file", "latest"],
    ]
    with HubServer(token=HF_TOK) as server:
        for flags in sessions:
            proc = run_cli(
                common + flags + ["--output_dir", "out"], tmp_path, nproc=2, env=hub_env(tmp_path, server, "s")
            )
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
            assert "lm-eval at each save:" in proc.stdout and "predicted" in proc.stdout  # the plan's line
        index = json.loads(server.files("me/scored")["fsdp_opt_index.json"])
        card = server.files("me/scored")["README.md"].decode()
    # the scoring leaves training as it was: dropout's random stream (seeded per rank) goes on as without it
    plain = common[: common.index("--eval_tasks")] + ["--output_dir", "plain", *sessions[0]]
    proc = run_cli(plain, tmp_path, nproc=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    alone = read_jsonl(tmp_path / "plain" / "metrics.jsonl")
    assert [r["loss"] for r in alone] == [r["loss"] for r in read_jsonl(tmp_path / "out" / "metrics.jsonl")][
        : len(alone)
    ]
    scored = [r for r in read_jsonl(tmp_path / "out" / "eval.jsonl") if "benchmarks" in r]
    held = {r["step"]: r for r in read_jsonl(tmp_path / "out" / "eval.jsonl") if "loss" in r}
    names = sorted(index["checkpoints"], key=lambda n: index["checkpoints"][n]["global_step"])
    steps = [index["checkpoints"][n]["global_step"] for n in names]
    assert [r["step"] for r in scored] == steps and len(steps) >= 4  # every save scored once, both sessions
    # W&B: one run across the sessions, each save's scores at its step beside the held-out loss
    runs = sorted((tmp_path / "out" / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and len({r.name.rsplit("-", 1)[-1] for r in runs}) == 1
    history = {}
    for run in runs:
        for r in wandb_records(run):
            if r["type"] == "history":
                history.setdefault(r["history"]["step"]["num"], {}).update(r["history"]["item"])
    # the reference: `evaluate --tasks` on the same checkpoints, afterwards, on 2 ranks
    args = ["--checkpoints", *names, "--output_dir", "out", "--no_base", "--tasks", tasks, "--limit", LIMIT]
    proc = evaluate(args + ["--batch_size", "2", "--json", "after.json"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    after = {m["name"]: m["benchmarks"] for m in json.loads((tmp_path / "after.json").read_text())["models"]}
    checked = 0
    for name, record in zip(names, scored):
        step, expected = index["checkpoints"][name]["global_step"], after[name]
        assert history[step]["eval/loss"] == pytest.approx(held[step]["loss"], rel=1e-12)
        for table in (record["benchmarks"], index["checkpoints"][name]["benchmarks"]):
            assert table.keys() == expected.keys()
            for task, values in expected.items():
                assert values.keys() == table[task].keys()
                for key, value in values.items():
                    assert table[task][key] == pytest.approx(value, rel=1e-5, abs=1e-9), (name, task, key)
                    wandb_key = f"{task}/{key.replace(',none', '')}"
                    assert history[step][wandb_key] == pytest.approx(value, rel=1e-5, abs=1e-9), wandb_key
                    checked += 1
    assert checked >= 2 * 4 * len(names)
    # the card: a row a range, each with its newest checkpoint's scores
    rows = card.split("## Benchmarks (lm-evaluation-harness)")[1].split("\n## ")[0]
    last = {index["checkpoints"][n]["end_idx"]: index["checkpoints"][n]["benchmarks"] for n in names}
    for end, start in ((16, 0), (32, 16)):
        acc = last[end]["pydocs_choice"]["acc,none"]
        assert f"| [{start}, {end}) | {acc:.4f} ± " in rows, rows
    # notebooks/02_evaluate: each metric against the range
    assert plot_benchmarks(tmp_path / "out", tmp_path / "b.png") is not None
    assert (tmp_path / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    points = series(scored)[("pydocs_choice", "acc,none")]
    assert {x for x, _ in points} == {16, 32} and len(points) == len(steps)


def test_the_plan_counts_the_scorings_memory_and_time(tmp_path, capsys):
    """planner/benchmarks.py: the scoring at a save holds the training state, the gathered model, a batch's forward
    and KV cache at the longest request (less on the shards); its time grows with the tokens and the generations.
    `fsdp-opt plan --eval_tasks` counts the requests lm-eval builds from the tasks and prints the line."""
    from fsdp_opt.commands.plan import main as plan
    from fsdp_opt.model.shapes import Shape, model_config
    from fsdp_opt.planner.benchmarks import scoring_plan
    from fsdp_opt.planner.inputs import Inputs

    shape, inputs = Shape.of(model_config("facebook/opt-1.3b")), Inputs()
    counts = {"requests": 300, "tokens": 5000, "generations": 0, "max_gen_toks": 0, "longest": 100}
    gathered = scoring_plan(shape, "FULL_SHARD", inputs, counts, 8)
    shards = scoring_plan(shape, "FULL_SHARD", inputs, counts, 8, gathered=False)
    more = scoring_plan(shape, "FULL_SHARD", inputs, {**counts, "generations": 60, "max_gen_toks": 32}, 8)
    memory = gathered["memory"]
    assert memory["gathered_weights"] == 2 * shape.params and memory["training_state"] == 12 * -(-shape.params // 2)
    assert gathered["peak_bytes"] == sum(memory.values()) > shards["peak_bytes"]
    assert more["time"]["seconds"] > gathered["time"]["seconds"] > 0 and more["time"]["decode_s"] > 0
    twice = scoring_plan(shape, "FULL_SHARD", inputs, {**counts, "tokens": 10000}, 8)
    assert twice["time"]["forward_s"] == pytest.approx(2 * gathered["time"]["forward_s"])
    tasks = ",".join(task_files(tmp_path)[:2])
    assert plan(["--model", "tiny-opt", "--cpu", "--eval_tasks", tasks, "--eval_limit", LIMIT, "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)["lm_eval"]
    # 7 documents of 4 choices, and 7 generations of up to 12 tokens (docs/tasks/pydocs_complete.yaml)
    assert planned["counts"]["requests"] == 7 * 4 + 7 and planned["counts"]["generations"] == 7
    assert planned["counts"]["max_gen_toks"] == 12 and planned["tasks"] == ["pydocs_choice", "pydocs_complete"]


def test_a_lora_checkpoint_scores_as_hflm_with_its_peft_adapters(tmp_path, det_model):
    """A LoRA checkpoint (2 ranks, its adapters merged into the gathered copies of the base for the scoring, as GRPO's
    generation merges them) scores what HFLM scores with peft's adapters on the same base (`peft=`, the exported
    adapter folder): the multiple-choice and generate_until tasks, every metric and sample."""
    train = run_cli(
        [
            *("--model", str(det_model), "--dataset", "python-docs", "--start_idx", "0", "--end_idx", "24"),
            *("--max_length", "64", "--batch_size", "2", "--lr", "1e-2", "--precision", "fp32", "--lora_rank", "4"),
            *("--output_dir", "out", "--export_hf", "out/adapter", "--export_dtype", "fp32"),
        ],
        tmp_path,
        nproc=2,
    )
    assert train.returncode == 0, train.stdout[-2000:] + train.stderr[-3000:]
    tasks = ",".join(task_files(tmp_path)[:2])
    args = ["--checkpoints", "latest", "--output_dir", "out", "--no_base", "--tasks", tasks, "--limit", LIMIT]
    proc = evaluate(args + ["--batch_size", "3", "--log_samples", "--output_path", "ours"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    reference(det_model, tmp_path / "theirs", tasks, tmp_path, adapter=tmp_path / "out" / "adapter")
    (ours,) = (tmp_path / "ours").iterdir()
    compared = assert_same(ours, tmp_path / "theirs" / "reference", list(TASK_YAMLS[:2]))
    assert compared == dict.fromkeys(TASK_YAMLS[:2], int(LIMIT))


def test_the_benchmark_sets_requests_per_second_beside_hflms(tmp_path):
    """benchmarks/lmeval.py in one run: HFLM, this interface on one rank and on two, the same batch and threads, the
    same scores; its report's rows (the figures themselves are docs/evaluation.md's, measured apart)."""
    out = tmp_path / "bench.json"
    proc = launch(
        [str(ROOT / "benchmarks" / "lmeval.py")],
        ["--model", "tiny-opt", "--limit", "3", "--batch_size", "4", "--json", str(out)],
        tmp_path,
        real=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [(r["way"], r["ranks"]) for r in report["runs"]] == [("hflm", 1), ("ours", 1), ("ours", 2)]
    assert all(r["same_scores"] for r in report["runs"])
    # 3 documents of 4 choices, 1 generation and 1 perplexity each; on 2 ranks lm-eval repeats requests to even them
    assert [r["requests"] for r in report["runs"][:2]] == [18, 18] and report["runs"][2]["requests"] >= 18
    assert all(r["requests_per_second"] == pytest.approx(18 / r["seconds"]) for r in report["runs"])
    assert report["threads_per_process"] == 1 and report["batch_size"] == 4
    assert "| fsdp-opt ModelLM | 2 | " in proc.stdout
