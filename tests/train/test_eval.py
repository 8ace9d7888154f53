"""--eval_rows: the held-out loss of a sharded 2-rank run equals Hugging Face's own loss of the exported model."""

from __future__ import annotations

import math

import pytest
from conftest import read_jsonl, run_cli


def test_eval_rows_match_reference(tmp_path, det_model):
    proc = run_cli(
        [
            "--model",
            str(det_model),
            "--dataset",
            "python-docs",
            "--start_idx",
            "0",
            "--end_idx",
            "24",
            "--eval_rows",
            "13",
            "--max_length",
            "64",
            "--batch_size",
            "3",
            "--lr",
            "3e-3",
            "--num_epochs",
            "1",
            "--precision",
            "fp32",
            "--output_dir",
            "out",
            "--export_hf",
            "out/export",
            "--export_dtype",
            "fp32",
        ],
        tmp_path,
        nproc=2,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (record,) = read_jsonl(tmp_path / "out" / "eval.jsonl")
    assert record["rows"] == "[24, 37)" and record["step"] == len(read_jsonl(tmp_path / "out" / "metrics.jsonl"))

    # Reference: one process, no FSDP, the model's own loss (mean over shifted labels) on each held-out row alone,
    # cut into 64-token pieces as --packing docs cuts it.
    from conftest import loss_alone, row_pieces
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fsdp_opt.data.formats import held_out_texts
    from fsdp_opt.data.sources import load_rows

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "export").eval()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out" / "export")
    total, tokens = loss_alone(
        model, row_pieces(tokenizer, held_out_texts(load_rows("python-docs"), "text", 24, 13)[0], 64)
    )
    assert record["tokens"] == tokens
    assert record["loss"] == pytest.approx(total / tokens, rel=1e-5)
    assert record["perplexity"] == pytest.approx(math.exp(total / tokens), rel=1e-5)
    assert f"eval at step {record['step']}: loss {record['loss']:.4f}" in proc.stdout


def test_eval_rows_past_the_end(tmp_path):
    from conftest import assert_clean_failure

    proc = run_cli(
        ["--model", "tiny-opt", "--dataset", "python-docs", "--start_idx", "0", "--eval_rows", "5"], tmp_path
    )
    assert_clean_failure(proc, "--eval_rows 5", "no rows after --end_idx")
