"""Sharding must not change the math: per-step loss and grad norm of the CLI against a plain PyTorch loop.

The reference runs each row of the global batch through an unsharded model by itself (the default --packing docs
gives every row its own positions and attention), takes the token mean with torch's cross_entropy, and clips with torch.nn.utils.clip_grad_norm_. The CLI runs FSDP2 with
micro-batches, gradient accumulation and a per-step global token count. In fp32 they must agree.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT, built_once, launch, read_jsonl, run_cli
from transformers import AutoModelForCausalLM, AutoTokenizer

from fsdp_opt.data.blocks import StepPlan, build_blocks
from fsdp_opt.data.formats import select_texts
from fsdp_opt.data.sources import load_rows

END_IDX, MAX_LEN, LR, CLIP, SEED, GLOBAL_BATCH = 100, 64, 1e-3, 0.5, 3, 8
COMMON = [
    "--dataset",
    "python-docs",
    "--end_idx",
    str(END_IDX),
    "--max_length",
    str(MAX_LEN),
    "--lr",
    str(LR),
    "--max_grad_norm",
    str(CLIP),
    "--seed",
    str(SEED),
    "--num_epochs",
    "1",
    "--precision",
    "fp32",
]


@pytest.fixture(scope="module")
def reference(det_model, tmp_path_factory):
    """Per-step (loss, grad_norm) of an unsharded, un-accumulated fp32 training loop (computed once per session)."""

    def build(folder) -> None:
        (folder / "reference.json").write_text(json.dumps(_reference(det_model)))

    return [
        tuple(r)
        for r in json.loads((built_once(tmp_path_factory, "math_reference", build) / "reference.json").read_text())
    ]


def _reference(det_model) -> list[tuple[float, float]]:
    tokenizer = AutoTokenizer.from_pretrained(det_model)
    texts, _ = select_texts(load_rows("python-docs"), "text", 0, END_IDX)
    blocks = build_blocks(texts, tokenizer, MAX_LEN, packing="docs")
    order = StepPlan(blocks, batch_size=GLOBAL_BATCH, accum_steps=1, rank=0, world_size=1, seed=SEED).epoch_order(0)
    model = AutoModelForCausalLM.from_pretrained(det_model, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    out = []
    for begin in range(0, len(order), GLOBAL_BATCH):
        # Each row (or piece of a long row) of the step's blocks runs through the model as a sequence of its own:
        # one batch of them, right-padded, no mask (a causal model's real tokens never see the padding after them).
        pieces = []
        for i in order[begin : begin + GLOBAL_BATCH].tolist():
            n = int(blocks.lengths[i])
            starts = (blocks.positions[i, :n] == 0).nonzero().flatten().tolist() + [n]
            pieces += [blocks.input_ids[i, a:b].long() for a, b in zip(starts, starts[1:])]
        batch = torch.nn.utils.rnn.pad_sequence(pieces, batch_first=True, padding_value=tokenizer.pad_token_id)
        logits = model(input_ids=batch).logits
        loss_sum = sum(F.cross_entropy(logits[k, : len(p) - 1], p[1:], reduction="sum") for k, p in enumerate(pieces))
        loss = loss_sum / sum(len(p) - 1 for p in pieces)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        out.append((loss.item(), norm.item()))
    return out


@pytest.mark.parametrize(
    "nproc,batch,accum,strategy,extra",
    [
        # reduce-scatter after each micro-batch; explicit prefetch of two blocks in forward and backward
        (2, 2, 2, "FULL_SHARD", ["--reduce_every_microbatch", "--prefetch", "2"]),
        # accumulation derived from the total; the loss 100 tokens at a time (chunks end mid-row)
        (2, 2, 2, "SHARD_GRAD_OP", ["--total_batch_size", "8", "--loss_chunk_tokens", "100"]),
        (2, 1, 4, "NO_SHARD", ["--compile"]),  # torch.compile of each block's forward
        (0, 8, 1, "FULL_SHARD", []),  # plain `python fsdp_finetune.py`: a world of one, whole batch at once
        (1, 4, 2, "FULL_SHARD", ["--loss_chunk_tokens", "64"]),
    ],
)
def test_sharded_run_matches_unsharded_reference(tmp_path, det_model, reference, nproc, batch, accum, strategy, extra):
    assert max(nproc, 1) * batch * accum == GLOBAL_BATCH
    accumulation = [] if "--total_batch_size" in extra else ["--accum_steps", str(accum)]
    args = (
        COMMON
        + accumulation
        + extra
        + [
            "--model",
            str(det_model),
            "--batch_size",
            str(batch),
            "--sharding_strategy",
            strategy,
            "--output_dir",
            str(tmp_path / "out"),
        ]
    )
    proc = run_cli(args, tmp_path, nproc=nproc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"x {accum} accum = {GLOBAL_BATCH} sequences per step" in proc.stdout
    sync = (
        "every micro-batch" if "--reduce_every_microbatch" in extra or accum == 1 else "last micro-batch of each step"
    )
    assert any(l.split(":")[0].strip() == "gradient sync" and l.endswith(f": {sync}") for l in proc.stdout.splitlines())
    chunk = (
        ", " + extra[extra.index("--loss_chunk_tokens") + 1] + " tokens at a time"
        if "--loss_chunk_tokens" in extra
        else ""
    )
    chunk = "the output layer at the target tokens only" + chunk  # OPT's head is a bias-free Linear
    assert any(l.split(":")[0].strip() == "loss" and l.endswith(f": {chunk}") for l in proc.stdout.splitlines())
    rows = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, len(reference) + 1))
    # Inductor's fused kernels sum in another order: compiled runs agree to 1e-3, eager ones to 1e-4.
    tol = 1e-3 if "--compile" in extra else 1e-4
    for r, (ref_loss, ref_norm) in zip(rows, reference):
        assert r["loss"] == pytest.approx(ref_loss, rel=tol), (r["step"], r["loss"], ref_loss)
        assert r["grad_norm"] == pytest.approx(ref_norm, rel=tol), (r["step"], r["grad_norm"], ref_norm)
    # The clip must have been active on some step for this to test clipping at all.
    assert any(norm > CLIP for _, norm in reference)
    # Every target token of the slice is counted exactly once per epoch.
    assert sum(r["tokens"] for r in rows) == _expected_targets(det_model)


def _expected_targets(model_dir) -> int:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts, _ = select_texts(load_rows("python-docs"), "text", 0, END_IDX)
    lengths = [len(tokenizer(t, add_special_tokens=False)["input_ids"]) + 1 for t in texts]
    # Every token of a row but its first, and but the first of each further MAX_LEN piece of a long row.
    return sum(n - -(-n // MAX_LEN) for n in lengths)


def test_hybrid_shard_across_two_nodes_matches_reference(tmp_path, det_model, reference):
    """HYBRID_SHARD as 2 nodes x 1 process on localhost, through a c10d rendezvous."""
    import subprocess

    from conftest import free_port, sandbox_env, torchrun_cmd

    port = free_port()
    args = COMMON + [
        "--model",
        str(det_model),
        "--batch_size",
        "2",
        "--accum_steps",
        "2",
        "--sharding_strategy",
        "HYBRID_SHARD",
        "--output_dir",
        str(tmp_path / "out"),
    ]
    env = sandbox_env(tmp_path)
    procs = [
        subprocess.Popen(
            torchrun_cmd(1, nnodes=2, node_rank=r, port=port) + args,
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    assert "HYBRID_SHARD" in outs[0][0] and "2 node(s)" in outs[0][0]
    rows = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    assert len(rows) == len(reference)
    for r, (ref_loss, ref_norm) in zip(rows, reference):
        assert r["loss"] == pytest.approx(ref_loss, rel=1e-4)
        assert r["grad_norm"] == pytest.approx(ref_norm, rel=1e-4)


def test_the_optimizer_steps_the_shards_as_torchs_adamw_steps_the_dtensors(tmp_path):
    """The engine's AdamW updates each rank's local shards; torch's updates the DTensors. Same weights, moments and
    state dicts bit for bit (foreach and fused; uneven shards, two decay groups, frozen and unused weights)."""

    proc = launch([str(ROOT / "tests" / "workers" / "shard_adamw.py")], [], tmp_path, nproc=2)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    for kind in ("foreach", "fused"):
        assert r[kind] and r[f"{kind}_state_dict"] and r[f"{kind}_local"], r
        assert r[f"{kind}_state_dtensor"] and r[f"{kind}_states"] == 5, (
            r
        )  # 2 linears and the norm bias; none frozen or unused
