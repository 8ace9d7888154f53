"""fp16 at real width for architectures trained in bf16: Gemma 2 and 3 (their embeddings scaled by sqrt(hidden), their
soft-caps) and Qwen2.5 (biased attention projections), at their published hidden, head and MLP sizes with random
weights, two layers and a small vocabulary. What this can show: the architecture's own fixed scalings do not overflow
fp16 at that width, and fp16 tracks fp32. What it cannot: a trained checkpoint's outlier activations (Qwen's are
known to be large), which random weights do not have; the fp16 probe at the start of a run watches for those."""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from fsdp_opt.model.catalog import SHAPES, catalog_config


@pytest.mark.parametrize("name", ["google/gemma-2-2b", "google/gemma-3-1b-pt", "Qwen/Qwen2.5-1.5B"])
def test_fp16_stays_finite_and_tracks_fp32_at_real_width(name):
    config = catalog_config(name)
    config.num_hidden_layers, config.vocab_size = 2, 4104
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[4:6] if "gemma-3" in name else config.layer_types[:2]
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(4, 4104, (1, 32))
    with torch.no_grad():
        full = model(input_ids=ids).logits.float()
        half = model.half()(input_ids=ids).logits.float()
    assert torch.isfinite(half).all()
    loss32 = F.cross_entropy(full[0, :-1], ids[0, 1:]).item()
    loss16 = F.cross_entropy(half[0, :-1], ids[0, 1:]).item()
    assert abs(loss16 - loss32) < 0.02 * loss32, (loss16, loss32)
    assert SHAPES[name][1]["hidden_size"] == config.hidden_size  # the real width, not a toy one
