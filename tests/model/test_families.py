"""Each architecture's own attention pattern inside docs packing: a row packed with others has, token for token, the
losses it has alone, for models with sliding windows shorter than the block (Mistral, Qwen2/3 with sliding layers,
Gemma 2 and 3 with local and global layers, Phi-3) under every attention kernel each has. The reference is the model
run on the row alone, through transformers' own masks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import ASSETS, make_chat_llama
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma2Config,
    Gemma3Config,
    Gemma3TextConfig,
    GPT2Config,
    GPTNeoXConfig,
    LlamaConfig,
    MistralConfig,
    OPTConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)
from transformers.pytorch_utils import Conv1D

from fsdp_opt.base import ModelError
from fsdp_opt.data.blocks import build_blocks, model_inputs, tokenize
from fsdp_opt.data.builtins import python_docs_texts
from fsdp_opt.data.packing import MaskPattern
from fsdp_opt.model.families import (
    FAMILIES,
    bos_note,
    families_markdown,
    family_of,
    mask_pattern,
    resolve_attention,
    untested_note,
)
from fsdp_opt.model.parallelize import find_block_classes, find_blocks

WINDOW, LENGTH = 32, 128
SMALL = dict(
    vocab_size=4104,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=2,
    eos_token_id=2,
    pad_token_id=1,
)

CONFIGS = {
    "llama": lambda: LlamaConfig(**SMALL),
    "mistral": lambda: MistralConfig(**SMALL, sliding_window=WINDOW),
    "qwen2": lambda: Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    "qwen3": lambda: Qwen3Config(
        **SMALL, head_dim=16, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
    ),
    "gemma2": lambda: Gemma2Config(**SMALL, head_dim=16, sliding_window=WINDOW),
    "gemma3_text": lambda: Gemma3TextConfig(
        **SMALL, head_dim=16, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]
    ),
    "phi3": lambda: Phi3Config(**SMALL, sliding_window=WINDOW),
}
CASES = [(f, a) for f in CONFIGS for a in ("sdpa", "eager") if not (f == "gemma2" and a == "sdpa")]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(ASSETS)


def _model(family: str, attention: str):
    config = CONFIGS[family]()
    config._attn_implementation = attention
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def worst_gap(model, blocks, rows) -> float:
    """The largest |packed - alone| next-token loss over every token of every row."""
    pieces = [r[i : i + LENGTH] for r in rows for i in range(0, len(r), LENGTH)]
    with torch.no_grad():
        logits = model(**model_inputs(blocks.batch(torch.arange(len(blocks)), torch.device("cpu")))).logits
        worst = 0.0
        for k in range(len(blocks)):
            n, pos, ids = int(blocks.lengths[k]), blocks.positions[k].tolist(), blocks.input_ids[k].tolist()
            starts = [i for i in range(n) if pos[i] == 0] + [n]
            for a, b in zip(starts, starts[1:]):
                piece = ids[a:b]
                assert piece in pieces
                if len(piece) < 2:
                    continue
                t = torch.tensor([piece])
                alone = F.cross_entropy(model(input_ids=t).logits[0, :-1], t[0, 1:], reduction="none")
                packed = F.cross_entropy(logits[k, a : b - 1], t[0, 1:], reduction="none")
                worst = max(worst, (packed - alone).abs().max().item())
    return worst


@pytest.mark.parametrize("family,attention", CASES, ids=[f"{f}-{a}" for f, a in CASES])
def test_packed_rows_have_their_losses_alone_with_the_models_own_windows(tokenizer, family, attention):
    model = _model(family, attention)
    texts = python_docs_texts()[:12]
    rows = tokenize(texts, tokenizer)
    assert max(map(len, rows)) > WINDOW  # rows longer than the window: the window shapes their losses
    pattern = mask_pattern(model.config)
    blocks = build_blocks(texts, tokenizer, LENGTH, "docs", attention, pattern)
    assert worst_gap(model, blocks, rows) <= 1e-5
    if pattern is not None:  # the block mask without the window is not the model's attention: the test can tell
        assert pattern.window == WINDOW
        plain = build_blocks(texts, tokenizer, LENGTH, "docs", attention, None)
        assert worst_gap(model, plain, rows) > 1e-3


def test_the_patterns_each_family_has():
    assert mask_pattern(CONFIGS["llama"]()) is None
    assert mask_pattern(CONFIGS["mistral"]()) == MaskPattern(WINDOW, by_layer_type=False)
    assert mask_pattern(CONFIGS["phi3"]()) == MaskPattern(WINDOW, by_layer_type=False)
    for family in ("qwen2", "qwen3", "gemma2", "gemma3_text"):
        assert mask_pattern(CONFIGS[family]()) == MaskPattern(WINDOW, by_layer_type=True), family
    assert mask_pattern(Qwen2Config(**SMALL)) is None  # Qwen2.5 as released: no sliding layers


def test_attention_auto_and_a_kernel_the_model_lacks():
    assert resolve_attention(CONFIGS["llama"](), "auto") == ("sdpa", None)
    assert resolve_attention(CONFIGS["gemma2"](), "auto") == ("eager", "attention: eager (gemma2 has no SDPA path)")
    assert resolve_attention(CONFIGS["gemma2"](), "eager") == ("eager", None)
    with pytest.raises(ModelError, match=r"--attn_implementation sdpa: gemma2 does not have it \(it has: eager"):
        resolve_attention(CONFIGS["gemma2"](), "sdpa")


TINY_OTHERS = {
    "opt": lambda: OPTConfig(
        num_hidden_layers=2, hidden_size=32, ffn_dim=64, num_attention_heads=2, vocab_size=100, word_embed_proj_dim=32
    ),
    "gpt2": lambda: GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64),
}


@pytest.mark.parametrize("family", FAMILIES, ids=[f.model_types[0] for f in FAMILIES])
def test_each_familys_entry_is_what_transformers_builds(family):
    """The registry against the models themselves: the block is a class the model has, and the one its
    _no_split_modules names; the LoRA targets are exactly the block's linear layers; the kernels are the ones
    transformers' model class supports."""
    (model_type,) = family.model_types
    config = (CONFIGS.get(model_type) or TINY_OTHERS[model_type])()
    assert family_of(config) is family and untested_note(config) is None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert family.block in model._no_split_modules
    (block_class,) = find_block_classes(model)
    assert block_class.__name__ == family.block
    block = find_blocks(model, {block_class})[0]
    leaves = {n.rsplit(".", 1)[-1] for n, m in block.named_modules() if isinstance(m, (torch.nn.Linear, Conv1D))}
    assert leaves == set(family.lora_targets)
    assert ("sdpa" in family.attention) == bool(type(model)._supports_sdpa)
    assert bool(config.tie_word_embeddings) == (
        model.get_output_embeddings().weight is model.get_input_embeddings().weight
    )


def test_other_architectures_run_the_generic_path_with_one_line():
    config = GPTNeoXConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2, vocab_size=100
    )
    assert family_of(config) is None
    note = untested_note(config)
    assert note.startswith("note: gpt_neox is not one of the tested families (OPT, GPT-2, Llama") and "\n" not in note
    assert resolve_attention(config, "auto") == ("sdpa", None)  # from transformers' own model class
    assert mask_pattern(config) is None
    # a windowed model outside the families: docs packing is refused, never run inexact
    with pytest.raises(ModelError, match="--packing docs: gemma3 has sliding-window attention"):
        mask_pattern(
            Gemma3Config(
                text_config=dict(sliding_window=WINDOW, layer_types=["sliding_attention"] * 2, num_hidden_layers=2)
            )
        )


def test_a_family_whose_tokenizer_adds_no_bos_gets_one_line(tokenizer, tmp_path):
    llama = CONFIGS["llama"]()
    with_bos = AutoTokenizer.from_pretrained(make_chat_llama(tmp_path / "llama", template=None))
    assert with_bos("a")["input_ids"][0] == with_bos.bos_token_id
    assert bos_note(llama, with_bos) is None
    assert tokenizer("a")["input_ids"][0] != tokenizer.bos_token_id  # the built-in tokenizer adds no BOS
    note = bos_note(llama, tokenizer)
    assert (
        note.startswith("note: Llama 3.x / SmolLM2 models saw a BOS (</s>) first in pretraining") and "\n" not in note
    )
    assert bos_note(CONFIGS["qwen3"](), tokenizer) is None  # Qwen's tokenizer adds none, as its pretraining had none


def test_the_docs_table_of_families_is_the_registry():
    readme = (Path(__file__).resolve().parents[2] / "docs" / "models.md").read_text()
    table = readme.split("<!-- families-table -->\n", 1)[1].split("\n<!-- /families-table -->", 1)[0]
    assert table == families_markdown()
