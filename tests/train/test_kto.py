"""--method kto against TRL 1.16's KTOTrainer: one step's loss and every gradient on the same rows, in the same
micro-batches (2 ranks x 2 micro-batches of 3 items, --packing pad), for the kto loss (its KL estimate from each
micro-batch's mismatched completions, reduced over the ranks) and apo_zero_unpaired; the items' tokens are TRL's;
preference rows unpair as TRL unpairs them. Then the chain (a session resumed mid-range trains what one straight run
trains, the reference read from the checkpoint), the held-out evaluation, the plan, and the bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import (
    ROOT,
    assert_clean_failure,
    assert_same_step,
    hub_sessions,
    launch,
    make_chat_llama,
    read_jsonl,
    run_cli,
    saved_names,
)
from hubdata import PARAGRAPHS
from transformers import AutoModelForCausalLM, AutoTokenizer

WORKER = str(ROOT / "tests" / "workers" / "kto_step.py")
BETA = 0.1
ROWS = 12  # one step of 2 ranks x 2 micro-batches x 3 items
LABELS = [True, False, True, True, False, True, False, True]


def unpaired_rows(n: int = 8) -> list[dict]:
    # prompts end on a newline: the completion's tokens start on a boundary, in TRL's tokenization and ours
    return [
        {
            "prompt": f'Question {k}: what follows "{PARAGRAPHS[k][:24]}"?\n',
            "completion": PARAGRAPHS[k + 1][: 12 + 7 * (k % 4)],
            "label": LABELS[k % len(LABELS)],
        }
        for k in range(n)
    ]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("kto")
    data = root / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in unpaired_rows(24)))
    return {
        "root": root,
        "policy": make_chat_llama(root / "policy", seed=0),
        "ref": make_chat_llama(root / "reference", seed=1),
        "data": data,
    }


def common(f: dict[str, Path], out: Path) -> list[str]:
    return [
        "--model",
        str(f["policy"]),
        "--dataset",
        str(f["data"]),
        "--method",
        "kto",
        "--ref_model",
        str(f["ref"]),
        "--beta",
        str(BETA),
        "--max_length",
        "64",
        "--precision",
        "fp32",
        "--output_dir",
        str(out),
        "--wandb_mode",
        "disabled",
        "--seed",
        "7",
    ]


def trl_step(f: dict[str, Path], report: dict, loss_type: str, weights: tuple[float, float]) -> tuple[float, dict]:
    """TRL's KTOTrainer on the same rows, batched as our ranks' micro-batches were (TRL's collator, its KL
    completions rotated within each micro-batch as its dataset map rotates them within a batch): its loss of each
    rank's micro-batch m, with the KL estimate gathered over the ranks' micro-batch m as accelerate gathers it, averaged
    over micro-batches and ranks (gradient accumulation, then DDP's mean); the loss and each parameter's gradient."""
    from datasets import Dataset
    from trl import KTOConfig, KTOTrainer

    tok = AutoTokenizer.from_pretrained(f["policy"])
    rows = unpaired_rows(ROWS)
    args = KTOConfig(
        output_dir=str(f["root"] / "trl"),
        per_device_train_batch_size=3,
        beta=BETA,
        loss_type=loss_type,
        desirable_weight=weights[0],
        undesirable_weight=weights[1],
        max_length=64,
        report_to=[],
        use_cpu=True,
        bf16=False,
        precompute_ref_log_probs=False,
    )
    trainer = KTOTrainer(
        model=AutoModelForCausalLM.from_pretrained(f["policy"], dtype=torch.float32),
        ref_model=AutoModelForCausalLM.from_pretrained(f["ref"], dtype=torch.float32),
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tok,
    )
    model = trainer.model
    tokenized = trainer.train_dataset

    def batch(members: list[list[int]]) -> dict:
        examples = [{k: tokenized[row][k] for k in ("prompt_ids", "completion_ids", "label")} for row, part in members]
        assert all(part == 0 for _, part in members)
        for j, e in enumerate(examples):  # item j's prompt with item j-1's completion (the first: the last's)
            e["KL_completion_ids"] = examples[j - 1]["completion_ids"]
        return trainer.data_collator(examples)

    ranks, rounds = len(report["micro"]), len(report["micro"][0])
    model.train()
    total = 0.0
    for m in range(rounds):
        batches = [batch(report["micro"][r][m]) for r in range(ranks)]
        if loss_type == "kto":  # each rank's mean of its micro-batch m, as accelerate's gather_for_metrics returns them
            with torch.no_grad():
                kls = torch.stack(
                    [
                        (trainer._compute_kl_logps(model, b) - trainer._compute_kl_logps(trainer.ref_model, b)).mean()
                        for b in batches
                    ]
                )
        for b in batches:
            if loss_type == "kto":
                calls = iter([kls])
                trainer.accelerator.gather_for_metrics = lambda x, calls=calls: next(calls, x)
            loss = trainer._compute_loss(model, b, return_outputs=False)
            (loss / (ranks * rounds)).backward()
            total += float(loss) / (ranks * rounds)
    return total, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    "loss_type,weights", [("kto", (1.0, 1.0)), ("kto", (1.3, 0.7)), ("apo_zero_unpaired", (1.0, 1.0))]
)
def test_a_step_is_trls_kto_loss_and_gradient(tmp_path, files, loss_type, weights):
    f = files
    flags = common(f, tmp_path / "out") + [
        "--loss_type",
        loss_type,
        "--desirable_weight",
        str(weights[0]),
        "--undesirable_weight",
        str(weights[1]),
        "--packing",
        "pad",
        "--batch_size",
        "3",
        "--accum_steps",
        "2",
        "--end_idx",
        str(ROWS),
    ]
    out = tmp_path / "report.json"
    proc = launch([WORKER], [str(out), *flags], tmp_path, nproc=2)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    ours = json.loads(out.read_text())
    # 2 ranks x 2 micro-batches x 3 items: a rotation by one and its reverse are two different KL estimates
    assert [len(m) for rank in ours["micro"] for m in rank] == [3, 3, 3, 3]
    loss, grads = trl_step(f, ours, loss_type, weights)
    print(f"{loss_type} {weights}: ours {ours['loss']:.8f}, TRL {loss:.8f}; record {ours['record']}")
    assert_same_step(ours, loss, grads)
    record = ours["record"]
    assert (record["desirable"], record["undesirable"]) == (8, 4)
    if loss_type == "kto":
        assert record["kl"] > 0  # the reference is another model: the estimate is not clamped to 0 everywhere
    else:
        assert record["kl"] == 0.0


def test_items_are_trls_tokens_and_preference_rows_unpair_as_trl_unpairs_them(files):
    """Our items' tokens and completion targets are TRL's (prompt_ids + completion_ids, the EOS appended); a
    preference row gives its chosen answer as a desirable item and its rejected one as an undesirable one, as TRL's
    unpair_preference_dataset does."""
    from datasets import Dataset
    from trl.data_utils import unpair_preference_dataset

    from fsdp_opt.data.formats import resolve_spec, select_rows
    from fsdp_opt.data.sequences import Packing
    from fsdp_opt.data.unpaired import items_from_rows

    tok = AutoTokenizer.from_pretrained(files["policy"])
    rows = unpaired_rows(8)
    ds = Dataset.from_list(rows)
    spec = resolve_spec(ds.column_names, "auto", prefer=("unpaired", "preference"))
    assert spec.format == "unpaired"
    items = items_from_rows(select_rows(ds, spec, 0, None), spec, tok, Packing(tok.pad_token_id, 64, "pad"))
    for k, row in enumerate(rows):
        prompt = tok(row["prompt"])["input_ids"]
        completion = tok(row["prompt"] + row["completion"])["input_ids"][len(prompt) :] + [tok.eos_token_id]
        assert items.ids[k] == prompt + completion
        assert [i for i, m in zip(items.ids[k], items.targets[k]) if m] == completion
    assert items.labels.tolist() == [r["label"] for r in rows]
    pairs = [
        {"prompt": r["prompt"], "chosen": r["completion"], "rejected": rows[(k + 1) % 8]["completion"]}
        for k, r in enumerate(rows)
    ]
    pref = Dataset.from_list(pairs)
    spec = resolve_spec(pref.column_names, "auto", prefer=("unpaired", "preference"))
    mine = items_from_rows(select_rows(pref, spec, 0, None), spec, tok, Packing(tok.pad_token_id, 64, "pad"))
    theirs = unpair_preference_dataset(pref)
    want = sorted((r["prompt"], r["completion"], r["label"]) for r in theirs)
    got = sorted(
        (pairs[int(i)]["prompt"], pairs[int(i)]["chosen" if p == 0 else "rejected"], bool(lab))
        for i, p, lab in zip(mine.index, mine.parts, mine.labels)
    )
    assert got == want and len(got) == 16


def test_a_session_resumed_mid_range_trains_what_one_straight_run_trains(tmp_path, files):
    """Rows [0, 8), two epochs, a checkpoint after each step: a session resumed from the one after step 1 trains
    the steps after it as the straight run did, bit for bit (CPU, fp32), and reads the reference's log-probabilities
    (the items' own and the mismatched ones of both epochs) from the checkpoint: no reference model is loaded."""
    f = files
    flags = common(f, tmp_path / "x") + [
        "--batch_size",
        "2",
        "--accum_steps",
        "1",
        "--end_idx",
        "8",
        "--packing",
        "pad",
    ]
    flags += ["--num_epochs", "2", "--lr", "1e-2", "--eval_rows", "4", "--save_every_steps", "1", "--keep_last", "0"]
    straight = run_cli(flags + ["--output_dir", str(tmp_path / "a")], tmp_path, nproc=2)
    assert straight.returncode == 0, straight.stdout[-2000:] + straight.stderr[-3000:]
    assert "kto: reference " + str(f["ref"]) + ": loaded sharded in fp32, scoring the items" in straight.stdout
    (tmp_path / "b").mkdir()
    (mid,) = (tmp_path / "a").glob("*-step-1.pt")
    (tmp_path / "b" / mid.name).write_bytes(mid.read_bytes())
    resumed = run_cli(flags + ["--resume_file", mid.name, "--output_dir", str(tmp_path / "b")], tmp_path, nproc=2)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    assert "read from the checkpoint" in resumed.stdout and "scoring the items" not in resumed.stdout
    keys = ("step", "loss", "grad_norm", "desirable", "undesirable", "rewards_chosen", "rewards_rejected", "kl")
    one = [tuple(r[k] for k in keys) for r in read_jsonl(tmp_path / "a" / "metrics.jsonl")]
    two = [tuple(r[k] for k in keys) for r in read_jsonl(tmp_path / "b" / "metrics.jsonl")]
    assert two == [s for s in one if s[0] > 1] and len(one) == 4
    assert one[-1][1] < one[0][1]  # it learns: the loss of the last step below the first's
    evals = read_jsonl(tmp_path / "a" / "eval.jsonl")
    assert evals and all(e["items"] == 4 for e in evals)
    # python -m fsdp_opt.evaluate on the last checkpoint, micro-batched as training evaluated: the same figures
    report_path = tmp_path / "report.json"
    proc = launch(
        ["-m", "fsdp_opt.evaluate"],
        [
            "--checkpoints",
            "latest",
            "--output_dir",
            str(tmp_path / "a"),
            "--eval_rows",
            "4",
            "--batch_size",
            "2",
            "--packing",
            "pad",
            "--num_prompts",
            "0",
            "--device",
            "cpu",
            "--json",
            str(report_path),
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    base_row, tuned_row = json.loads(report_path.read_text())["models"]
    print(f"held-out KTO loss: training {evals[-1]['loss']}, evaluate {tuned_row['loss']} (base {base_row['loss']})")
    for key in ("loss", "kl", "margin"):
        assert abs(tuned_row[key] - evals[-1][key]) <= 1e-5, (key, tuned_row, evals[-1])
    assert "KTO loss" in proc.stdout and base_row["loss"] != tuned_row["loss"]


def test_bad_kto_input_is_one_line(tmp_path, files):
    f = files
    bad = tmp_path / "bad.jsonl"
    rows = unpaired_rows(6)
    rows[3]["label"] = 1
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = tmp_path / "text.jsonl"
    text.write_text("".join(json.dumps({"text": r["completion"]}) + "\n" for r in rows))
    cases = [
        (["--dataset", str(bad)], "row 3, column label: expected true or false"),
        (["--dataset", str(text)], "--method kto: the rows are text"),
        (["--loss_type", "dapo"], "--loss_type dapo: not for --method kto"),
        (["--desirable_weight", "0"], "--desirable_weight 0.0: must be greater than 0"),
    ]
    for extra, line in cases:
        flags = common(f, tmp_path / "out") + ["--batch_size", "2"] + extra
        proc = run_cli(flags, tmp_path, nproc=2)
        assert_clean_failure(proc, line)
    sft = run_cli(["--model", str(f["policy"]), "--dataset", str(f["data"]), "--undesirable_weight", "2"], tmp_path)
    assert_clean_failure(sft, "--undesirable_weight: only with --method kto")


def test_lora_kto_through_the_hub_equals_one_session_of_three_ranges(tmp_path):
    """LoRA KTO on the built-in preference pairs, unpaired (its reference: the base, adapters off), --start_idx auto
    through the loopback Hub on three empty machines: the names and the steps of one session that trains the three
    ranges (each further range scored against the base with the trained adapters off), bit for bit."""
    auto = [
        "--model",
        "tiny-opt",
        "--dataset",
        "python-docs-prefs",
        "--method",
        "kto",
        "--chat_template",
        "chatml",
        "--lora_rank",
        "8",
        "--max_length",
        "128",
        "--batch_size",
        "4",
        "--lr",
        "3e-3",
        "--precision",
        "fp32",
        "--start_idx",
        "auto",
        "--range_size",
        "8",
        "--wandb_mode",
        "disabled",
        "--seed",
        "5",
    ]
    procs = hub_sessions(auto, tmp_path, "me/kto")
    assert all("kto: reference: the base with the adapters switched off" in proc.stdout for proc in procs)
    assert "16 items (8 desirable, 8 undesirable" in procs[0].stdout  # 8 preference rows, each two items
    saved = [name for proc in procs for name in saved_names(proc.stdout)]
    one = run_cli(auto + ["--session_ranges", "3", "--output_dir", str(tmp_path / "one")], tmp_path, nproc=2)
    assert one.returncode == 0, one.stdout[-2000:] + one.stderr[-3000:]
    assert saved == saved_names(one.stdout) == [f"tiny_opt_{a}-{a + 8}-epoch-1.pt" for a in (0, 8, 16)]
    fields = ("step", "loss", "slice", "rewards_chosen", "rewards_rejected", "kl")
    got = [tuple(r[k] for k in fields) for r in read_jsonl(tmp_path / "m2" / "out" / "metrics.jsonl")]
    want = [tuple(r[k] for k in fields) for r in read_jsonl(tmp_path / "one" / "metrics.jsonl")]
    assert got == want and len(want) >= 3


def test_a_changed_kto_setting_is_drift_the_chain_refuses(tmp_path, files):
    """--desirable_weight changed on resume changes the loss mid-chain: one line naming it, no training."""
    f = files
    flags = common(f, tmp_path / "out") + ["--batch_size", "2", "--end_idx", "8", "--packing", "pad"]
    first = run_cli(flags, tmp_path, nproc=2)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    (saved,) = saved_names(first.stdout)
    again = run_cli(
        flags + ["--start_idx", "8", "--end_idx", "16", "--resume_file", saved, "--desirable_weight", "2"],
        tmp_path,
        nproc=2,
    )
    assert_clean_failure(again, "--desirable_weight")
    assert "settings: --desirable_weight 1.0 -> 2.0 (breaks exactness: another loss trains)" in again.stdout
