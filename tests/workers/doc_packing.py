"""Run by torchrun from the tests with training flags (--packing docs): the engine's own forward/backward over one
step of document-aware blocks against the same rows padded one per row (the original recipe), under FSDP.

Reports, from rank 0: the largest gradient difference over every parameter (whole-logits loss, then the chunked
loss), both steps' token-mean losses and target counts, and each row's per-token losses inside a packed block
against the same row run alone (no padding, no mask) through the same sharded model.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import torch
import torch.nn.functional as F

from fsdp_opt.config.parse import parse_args
from fsdp_opt.data.blocks import StepPlan, build_blocks, model_inputs, tokenize
from fsdp_opt.data.formats import select_texts
from fsdp_opt.data.sources import load_rows
from fsdp_opt.engine.loss import HeadLoss, TokenLoss
from fsdp_opt.engine.step import accumulate
from fsdp_opt.runtime.distributed import init_distributed, teardown
from fsdp_opt.runtime.exits import end_process
from fsdp_opt.train.build import setup


def one_step(blocks, s, batch_size: int):
    """The whole of `blocks` as one optimizer step (accumulation covers every block)."""
    micro_global = batch_size * s.env.world_size
    accum = -(-len(blocks) // micro_global)
    plan = StepPlan(
        blocks, batch_size=batch_size, accum_steps=accum, rank=s.env.rank, world_size=s.env.world_size, seed=3
    )
    return next(plan.steps(0))


def gradients(s, blocks, batch_size: int, head) -> tuple[dict[str, torch.Tensor], float, int]:
    s = dataclasses.replace(s, blocks=blocks, head_loss=head, loss=TokenLoss(blocks, head, s.env.device))
    step = one_step(blocks, s, batch_size)
    s.optimizer.zero_grad(set_to_none=True)
    loss_sum, _ = accumulate(s, step)
    torch.distributed.all_reduce(loss_sum)
    grads = {n: p.grad.full_tensor().clone() for n, p in s.model.named_parameters() if p.grad is not None}
    return grads, loss_sum.item() / step.target_tokens, step.target_tokens


def largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys() and a
    return max((a[k] - b[k]).abs().max().item() for k in a)


def main() -> None:
    config = parse_args(sys.argv[1:])
    env = init_distributed("cpu")
    s = setup(config, env)
    dc = config.data
    texts, _ = select_texts(load_rows(dc.dataset), dc.text_column, dc.start_idx, dc.end_idx)
    rows = tokenize(texts, s.tokenizer)
    docs = s.blocks
    padded = build_blocks(texts, s.tokenizer, dc.max_length, "pad")
    b = config.train.batch_size
    report = {
        "rows": len(rows),
        "longest_row": max(map(len, rows)),
        "docs_blocks": len(docs),
        "padded_rows": len(padded),
        "rows_per_block": max(int((docs.positions[k] == 0).sum()) for k in range(len(docs))),
    }
    for name, chunked in (("whole", None), ("chunked", HeadLoss(s.model, 48))):
        g_docs, loss_docs, tokens_docs = gradients(s, docs, b, chunked)
        g_pad, loss_pad, tokens_pad = gradients(s, padded, b, chunked)
        report[name] = {
            "grad_diff": largest_difference(g_docs, g_pad),
            "grad_max": max(g.abs().max().item() for g in g_pad.values()),
            "loss_docs": loss_docs,
            "loss_pad": loss_pad,
            "tokens_docs": tokens_docs,
            "tokens_pad": tokens_pad,
        }
    s.optimizer.zero_grad(set_to_none=True)
    # Per-token losses inside the packed blocks against each row alone: every rank runs the same forwards.
    s.model.eval()
    worst, found = 0.0, 0
    with torch.no_grad():
        batch = docs.batch(torch.arange(len(docs)), env.device)
        logits = s.model(**model_inputs(batch)).logits
        for row in rows:
            ids = torch.tensor([row])
            alone = F.cross_entropy(s.model(input_ids=ids).logits[0, :-1].float(), ids[0, 1:], reduction="none")
            k, at = locate(docs, row)
            packed = F.cross_entropy(logits[k, at : at + len(row) - 1].float(), ids[0, 1:], reduction="none")
            worst, found = max(worst, (packed - alone).abs().max().item()), found + 1
    report["per_row"] = {"rows_found": found, "largest_difference": worst}
    if env.is_main:
        s.out_dir.mkdir(parents=True, exist_ok=True)
        (s.out_dir / "doc_packing.json").write_text(json.dumps(report))
    teardown()


def locate(blocks, row: list[int]) -> tuple[int, int]:
    """(block, offset) of the document `row` inside the packed blocks."""
    for k in range(len(blocks)):
        starts = (blocks.positions[k] == 0).nonzero().flatten().tolist()
        for at in starts:
            if at + len(row) <= int(blocks.lengths[k]) and blocks.input_ids[k, at : at + len(row)].tolist() == row:
                return k, at
    raise AssertionError("a row is missing from the packed blocks")


if __name__ == "__main__":
    end_process(main)
