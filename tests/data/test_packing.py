"""Document-aware packing (--packing docs): placement, positions, masks, and losses equal to each row run alone.

The references here never go through the packing code: each row (or piece of a long row) runs through the model
by itself, with no padding and no mask, and its per-token losses are what the packed block must reproduce.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import ASSETS, ROOT, launch
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, LlamaConfig

from fsdp_opt.data.blocks import IGNORE_INDEX, build_blocks, model_inputs, tokenize
from fsdp_opt.data.builtins import python_docs_texts
from fsdp_opt.data.packing import document_mask, place
from fsdp_opt.engine.evaluation import evaluate_loss
from fsdp_opt.runtime.distributed import DistEnv

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(ASSETS)


def test_best_fit_decreasing_by_hand():
    # longest first: 5 -> new block A (3 left); 4 -> new block B (4 left); 3 -> the tightest fit is A (3 left);
    # 3 -> B (1 left); 1 -> B (0 left)
    assert place([5, 4, 3, 3, 1], 8) == [[0, 2], [1, 3, 4]]
    assert place([8, 8, 2], 8) == [[0], [1], [2]]
    assert place([], 8) == []


def test_rows_stay_whole_and_long_rows_split_into_pieces_from_position_0(tokenizer):
    texts = python_docs_texts()[:40]
    rows = tokenize(texts, tokenizer)
    length = 96
    blocks = build_blocks(texts, tokenizer, length, "docs")
    assert any(len(r) > length for r in rows) and any(len(r) < length for r in rows)
    expected = sorted(tuple(r[i : i + length]) for r in rows for i in range(0, len(r), length))
    found = []
    for k in range(len(blocks)):
        n, pos, ids = int(blocks.lengths[k]), blocks.positions[k].tolist(), blocks.input_ids[k].tolist()
        starts = [i for i in range(n) if pos[i] == 0] + [n]
        assert starts[0] == 0
        for a, b in zip(starts, starts[1:]):
            assert pos[a:b] == list(range(b - a))  # positions count from 0 inside each piece
            found.append(tuple(ids[a:b]))
        assert pos[n:] == list(range(length - n))  # the padding is a segment of its own
    assert sorted(found) == expected  # every piece once, nothing lost, short rows never cut
    smallest = sorted(blocks.lengths.tolist())[:2]
    assert sum(smallest) > length  # no two blocks could have been one
    # targets: every token of a piece but its first
    assert int(blocks.target_counts().sum()) == sum(len(p) - 1 for p in expected)


def test_labels_mask_and_positions_of_a_batch(tokenizer):
    blocks = build_blocks(python_docs_texts()[:12], tokenizer, 128, "docs")
    k = max(range(len(blocks)), key=lambda i: int((blocks.positions[i] == 0).sum()))  # the block with most rows
    batch = blocks.batch(torch.tensor([k, -1]), CPU)
    pos, labels, mask = batch["position_ids"], batch["labels"], batch["attention_mask"]
    assert mask.shape == (2, 1, 128, 128) and mask.dtype == torch.bool
    n = int(blocks.lengths[k])
    segment, current = [], -1
    for p in pos[0].tolist():
        current += p == 0
        segment.append(current)
    assert max(segment) >= 2  # several rows in the block, then the padding
    expected = [[k <= q and segment[k] == segment[q] for k in range(128)] for q in range(128)]
    assert mask[0, 0].tolist() == expected
    assert (labels[0, pos[0] == 0] == IGNORE_INDEX).all()  # no row's first token is predicted from another row
    assert (labels[0, n:] == IGNORE_INDEX).all() and (labels[0, :n][pos[0, :n] != 0] != IGNORE_INDEX).all()
    assert (labels[1] == IGNORE_INDEX).all() and pos[1].tolist() == list(range(128))  # a filler row
    eager = document_mask(pos, "eager")
    assert eager.dtype == torch.float32 and torch.equal(eager == 0, mask)


def test_one_full_row_per_block_needs_no_mask(tokenizer):
    long_text = " ".join(python_docs_texts()[:6])
    blocks = build_blocks([long_text], tokenizer, 32, "docs")
    full = torch.nonzero(blocks.lengths == 32).flatten()[:2]
    batch = blocks.batch(full, CPU)
    assert set(batch) == {"input_ids", "labels"}  # plain causal attention: SDPA's causal fast path


def _model(arch: str, attention: str = "sdpa"):
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(ASSETS)
    ids = dict(
        vocab_size=tokenizer.vocab_size + 8, bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id
    )
    if arch == "opt":
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(ASSETS)
        config.dropout = 0.0
    elif arch == "gpt2":
        config = GPT2Config(
            n_layer=2, n_embd=64, n_head=2, n_positions=512, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **ids
        )
    else:
        config = LlamaConfig(
            num_hidden_layers=2,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=512,
            **ids,
        )
    config._attn_implementation = attention
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("arch,attention", [("opt", "sdpa"), ("opt", "eager"), ("gpt2", "sdpa"), ("llama", "sdpa")])
def test_each_row_in_a_packed_block_has_the_losses_it_has_alone(tokenizer, arch, attention):
    """GPT-2 and Llama take the restarted positions through position_ids as OPT does (learned or rotary)."""
    model = _model(arch, attention)
    texts = python_docs_texts()[:14]
    length = 128
    blocks = build_blocks(texts, tokenizer, length, "docs", attention)
    rows = tokenize(texts, tokenizer)
    pieces = [r[i : i + length] for r in rows for i in range(0, len(r), length)]
    assert len(pieces) > len(rows)  # a long row is split: its later pieces start again at position 0
    with torch.no_grad():
        batch = blocks.batch(torch.arange(len(blocks)), CPU)
        logits = model(**model_inputs(batch)).logits
        worst = 0.0
        for piece in pieces:
            ids = torch.tensor([piece])
            alone = F.cross_entropy(model(input_ids=ids).logits[0, :-1], ids[0, 1:], reduction="none")
            k, at = _locate(blocks, piece)
            packed = F.cross_entropy(logits[k, at : at + len(piece) - 1], ids[0, 1:], reduction="none")
            worst = max(worst, (packed - alone).abs().max().item() if len(piece) > 1 else 0.0)
    assert worst <= 1e-5
    # concat packing (rows attending across their ends) does not give those losses: the test can tell
    concat = build_blocks(texts, tokenizer, 512, "concat")
    at = next(c for c in (sum(map(len, rows[: i + 1])) for i in range(len(rows))) if c < 480)  # a row's end
    nxt = concat.input_ids[0, at : at + 20].long()
    with torch.no_grad():
        alone = F.cross_entropy(model(input_ids=nxt[None]).logits[0, :-1], nxt[1:], reduction="none")
        joined = model(input_ids=concat.input_ids[:1].long()).logits[0, at : at + 19]
    assert (F.cross_entropy(joined, nxt[1:], reduction="none") - alone).abs().max().item() > 1e-3


def _locate(blocks, piece: list[int]) -> tuple[int, int]:
    for k in range(len(blocks)):
        for at in (blocks.positions[k] == 0).nonzero().flatten().tolist():
            end = at + len(piece)
            if blocks.input_ids[k, at:end].tolist() == piece and (
                end >= blocks.max_length or blocks.positions[k, end] == 0
            ):
                return k, at
    raise AssertionError("piece not found")


def test_held_out_loss_is_the_same_however_the_rows_are_batched(tokenizer):
    """Evaluation packs as training does: docs gives the padded recipe's loss and token count, at any block length
    and batch size."""
    model = _model("opt")
    texts = python_docs_texts()[100:130]
    longest = max(len(r) for r in tokenize(texts, tokenizer))
    env = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, device=CPU)
    padded = evaluate_loss(model, build_blocks(texts, tokenizer, longest, "pad"), 3, env)
    for length, batch_size in ((longest, 2), (256, 4), (512, 1)):
        docs = evaluate_loss(model, build_blocks(texts, tokenizer, length, "docs"), batch_size, env)
        assert docs["tokens"] == padded["tokens"]
        assert abs(docs["loss"] - padded["loss"]) <= 1e-5


def test_two_ranks_full_shard_gradients_equal_the_padded_recipe(tmp_path, det_model):
    """Under torchrun, 2 ranks, FULL_SHARD, activation checkpointing: one step over document-aware blocks and one
    over the same rows padded give the same gradients for every parameter, with the whole-logits loss and with
    --loss_chunk_tokens; the token counts (the metrics' tokens) are equal; every row's per-token losses in its block
    equal its losses alone."""
    out = tmp_path / "out"
    worker = str(ROOT / "tests" / "workers" / "doc_packing.py")
    args = [
        "--model",
        str(det_model),
        "--dataset",
        "python-docs",
        "--end_idx",
        "24",
        "--max_length",
        "256",
        "--batch_size",
        "2",
        "--precision",
        "fp32",
        "--output_dir",
        str(out),
        "--wandb_mode",
        "disabled",
        "--sharding_strategy",
        "FULL_SHARD",
        "--activation_checkpointing",
        "true",
        "--packing",
        "docs",
    ]
    proc = launch([worker], args, tmp_path, nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "doc_packing.json").read_text())
    assert report["longest_row"] <= 256  # nothing truncated by the padded recipe: the same tokens both ways
    assert report["docs_blocks"] < report["padded_rows"] and report["rows_per_block"] > 1
    for name in ("whole", "chunked"):
        r = report[name]
        assert r["grad_max"] > 1e-2 and r["grad_diff"] <= 1e-5, r
        assert r["tokens_docs"] == r["tokens_pad"] and abs(r["loss_docs"] - r["loss_pad"]) <= 1e-5, r
    assert report["per_row"]["rows_found"] == 24 and report["per_row"]["largest_difference"] <= 1e-5
