"""The catalogue of popular models: their shapes built offline count the parameters their model pages publish, the
plan answers for each with no download, names a change that fits when nothing does, and the table in docs/models.md is the
command's output."""

from __future__ import annotations

import contextlib
import io
import re

import pytest
import torch
from conftest import ROOT
from transformers import AutoModelForCausalLM

from fsdp_opt import plan
from fsdp_opt.checkpoint.names import checkpoint_name, parse_name
from fsdp_opt.model.catalog import SHAPES, catalog_config, catalog_id
from fsdp_opt.model.shapes import Shape, model_config
from fsdp_opt.model.sources import model_tag, resolve_model
from fsdp_opt.planner.inputs import Inputs
from fsdp_opt.planner.search import Limits, change_line, cheapest_change, recommend

# Parameter counts as the models' safetensors hold them, tied embeddings counted once (Qwen3-1.7B's files store
# its tied head a second time: 2,031,739,904 there). Gemma-3-4B: its text model (the published 4.3B adds the vision
# tower).
PUBLISHED = {
    "meta-llama/Llama-3.2-1B": 1_235_814_400,
    "meta-llama/Llama-3.2-3B": 3_212_749_824,
    "Qwen/Qwen2.5-0.5B": 494_032_768,
    "Qwen/Qwen2.5-1.5B": 1_543_714_304,
    "Qwen/Qwen2.5-3B": 3_085_938_688,
    "Qwen/Qwen2.5-7B": 7_615_616_512,
    "Qwen/Qwen3-0.6B": 596_049_920,
    "Qwen/Qwen3-1.7B": 2_031_739_904 - 151936 * 2048,
    "Qwen/Qwen3-4B": 4_022_468_096,
    "Qwen/Qwen3-8B": 8_190_735_360,
    "google/gemma-2-2b": 2_614_341_888,
    "google/gemma-3-1b-pt": 999_885_952,
    "HuggingFaceTB/SmolLM2-1.7B": 1_711_376_384,
    "microsoft/Phi-3.5-mini-instruct": 3_821_079_552,
    "mistralai/Mistral-7B-v0.3": 7_248_023_552,
}
T4S = dict(gpus=2, gpu_memory=int(14.5 * 2**30), batch_size=4, max_length=512, accum_steps=16, precision="fp16")
HOST = 31 * 10**9  # Kaggle's RAM: what --cpu_offload must fit in too


@pytest.mark.parametrize("name", [n for n in SHAPES if n in PUBLISHED])
def test_the_built_in_shapes_count_the_published_parameters(name):
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(catalog_config(name))
    assert sum(p.numel() for p in {id(p): p for p in model.parameters()}.values()) == PUBLISHED[name]


def test_ids_variants_names_and_random_weights():
    assert catalog_id("Qwen/Qwen2.5-1.5B-Instruct") == "Qwen/Qwen2.5-1.5B"
    assert catalog_id("google/gemma-3-1b-it") == "google/gemma-3-1b-pt"
    assert catalog_id("qwen/qwen3-1.7b") == "Qwen/Qwen3-1.7B" and catalog_id("someone/model") is None
    assert checkpoint_name(model_tag("Qwen/Qwen3-1.7B"), 0, 5000, 1) == "Qwen3_1.7B_0-5000-epoch-1.pt"
    assert model_tag("meta-llama/Llama-3.2-1B") == "Llama_3.2_1B" and model_tag("google/gemma-2-2b") == "gemma_2_2b"
    for name in SHAPES:  # the chain and the Hub's index read every catalogued model's names back
        for sharded, step in ((False, None), (True, 40)):
            saved = checkpoint_name(model_tag(name), 5000, 10000, 2, step=step, sharded=sharded)
            parsed = parse_name(saved)
            assert (parsed["tag"], parsed["start"], parsed["end"], parsed["epoch"]) == (model_tag(name), 5000, 10000, 2)
    assert resolve_model("random:Qwen/Qwen3-0.6B").kind == "random"
    # Gemma 3's local:global pattern and Gemma 2's soft-caps come with the shape
    gemma3 = catalog_config("google/gemma-3-1b-pt")
    assert gemma3.layer_types[:6] == ["sliding_attention"] * 5 + ["full_attention"] and gemma3.sliding_window == 512
    gemma2 = catalog_config("google/gemma-2-2b")
    assert (gemma2.attn_logit_softcapping, gemma2.final_logit_softcapping, gemma2.sliding_window) == (50.0, 30.0, 4096)


def test_nothing_fits_names_the_cheapest_change_that_does():
    shape = Shape.of(model_config("Qwen/Qwen2.5-1.5B"))
    inputs = Inputs(**T4S)
    assert recommend(shape, inputs, 128, Limits(host_memory=HOST)) is None
    found = cheapest_change(shape, inputs, 128, Limits(host_memory=HOST))
    assert found["change"] == "--lora_rank 16" and found["max_length"] == 512
    # the change, planned as given, fits with that configuration
    again = recommend(shape, Inputs(**{**T4S, "lora_rank": 16}), 128, Limits(host_memory=HOST))
    assert again["predicted_step_time_s"] == found["predicted_step_time_s"] and again["peak_bytes"] <= inputs.gpu_memory
    line = change_line(True, inputs, found)
    assert line.startswith("full fine-tuning does not fit 2 x 14.50 GiB; --lora_rank 16 fits, ")
    # a model too large for LoRA on a 16-bit base is told to take the 4-bit base
    big = Shape.of(model_config("Qwen/Qwen2.5-7B"))
    assert cheapest_change(big, inputs, 128, Limits(host_memory=HOST))["change"] == "--lora_rank 16 --base_bits 4"
    # and where even that does not fit at full length, a shorter one
    tight = Inputs(**{**T4S, "gpu_memory": 10 * 2**30})
    assert (
        recommend(
            big,
            Inputs(**{**T4S, "gpu_memory": 10 * 2**30, "lora_rank": 16, "base_bits": 4}),
            128,
            Limits(host_memory=HOST),
        )
        is None
    )
    shorter = cheapest_change(big, tight, 128, Limits(host_memory=HOST))
    assert shorter["change"].startswith("--lora_rank 16 --base_bits 4 --max_length ") and shorter["max_length"] < 512


def _plan(*args: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert plan.main(list(args)) == 0
    return out.getvalue()


def test_the_plan_answers_offline_for_every_model_and_the_readme_table_is_its_output():
    text = _plan(
        "--model", "Qwen/Qwen2.5-1.5B", "--gpu_memory", "14.5GiB", "--host_memory", "31GB", "--global_batch", "128"
    )
    assert "full fine-tuning does not fit 2 x 14.50 GiB; --lora_rank 16 fits" in text
    table = _plan("--catalog", "--gpu_memory", "14.5GiB", "--host_memory", "31GB", "--global_batch", "128").strip()
    assert all(f"| {name} |" in table for name in SHAPES)
    page = (ROOT / "docs" / "models.md").read_text()
    block = re.search(r"<!-- models-table -->\n(.*?)\n<!-- /models-table -->", page, re.S)
    assert block, "docs/models.md has no models table"
    assert block.group(1).strip() == table, (
        "docs/models.md's models table is stale: run python -m fsdp_opt.plan --catalog "
        "--gpu_memory 14.5GiB --host_memory 31GB --global_batch 128"
    )


def test_when_nothing_fits_even_the_changes_the_line_says_so():
    big = Shape.of(model_config("Qwen/Qwen2.5-7B"))
    small = Inputs(**{**T4S, "gpu_memory": 6 * 2**30})
    assert cheapest_change(big, small, 128, Limits(host_memory=HOST)) is None
    assert change_line(True, small, None).endswith("nor does LoRA on a 4-bit base at 128 tokens")
