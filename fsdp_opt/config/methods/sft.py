"""--method sft: the next-token loss on the targets of --train_on. No flags of its own."""

from __future__ import annotations

from fsdp_opt.config.methods.base import Flags, MethodSpec

SFT = MethodSpec(
    name="sft",
    flags=Flags,
    rows=("text", "prompt_completion", "messages"),
    what="text, prompt/completion or chat rows",
    summary="sft: next-token loss on the targets of --train_on.",
    sequences_per_row=1,
    dropout=True,
    concat=True,
    answers_only=False,
)
