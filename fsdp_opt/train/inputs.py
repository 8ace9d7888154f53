"""What a session reads before it builds anything: the model's config and tokenizer, and the slice's blocks (with
the held-out rows of --eval_rows). Rank 0 reads first (downloads), the other ranks then hit the cache."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PretrainedConfig, PreTrainedTokenizerBase

from fsdp_opt.base import ConfigError
from fsdp_opt.config.parse import Config
from fsdp_opt.data.blocks import Blocks, build_blocks
from fsdp_opt.data.sources import held_out_texts, load_rows, select_texts
from fsdp_opt.engine.fp16watch import trained_in_bf16
from fsdp_opt.model.sources import ModelSource, load_model_config, load_tokenizer, max_positions
from fsdp_opt.runtime.distributed import all_ranks_ok, print0, rank0_first


@dataclass
class SliceData:
    """The rows [start_idx, end_idx) as blocks, and the held-out blocks after them."""

    blocks: Blocks
    end_idx: int  # --end_idx, or the end of the data
    eval_blocks: Blocks | None
    rows: int  # of the whole dataset


@dataclass
class Loaded:
    """The model's config and tokenizer and the slice, read once."""

    model_config: PretrainedConfig
    tokenizer: PreTrainedTokenizerBase
    data: SliceData
    bf16_pretrained: bool  # as the model's files say (building the model sets the config's dtype to the engine's)


def read_inputs(config: Config, source: ModelSource) -> Loaded:
    mc, dc = config.model, config.data
    model_config, tokenizer = rank0_first(
        lambda: (load_model_config(source, mc.attn_implementation), load_tokenizer(source))
    )
    bf16_pretrained = trained_in_bf16(model_config)
    positions = max_positions(model_config)
    if positions is not None and dc.max_length > positions:
        raise ConfigError(f"--max_length {dc.max_length}: {mc.model} has only {positions} positions")
    return Loaded(model_config, tokenizer, read_slice(config, tokenizer), bf16_pretrained)


def read_slice(config: Config, tokenizer: PreTrainedTokenizerBase) -> SliceData:
    """The slice of config.data as blocks. A range of an auto chain that ends at the end of the data has no rows after
    it: it trains without --eval_rows, with a note, rather than stopping the chain."""
    mc, dc = config.model, config.data

    def read_data() -> tuple[list[str], int, list[str] | None, int]:
        ds = load_rows(dc.dataset)
        texts, end = select_texts(ds, dc.text_column, dc.start_idx, dc.end_idx)
        held_out = None
        if dc.eval_rows and dc.range_size is not None and end >= len(ds):
            print0(f"note: no rows after [{dc.start_idx}, {end}), the end of the data, to evaluate on: this range "
                   "trains without --eval_rows")  # fmt: skip
        elif dc.eval_rows:
            held_out = held_out_texts(ds, dc.text_column, end, dc.eval_rows)[0]
        return texts, end, held_out, len(ds)

    texts, end_idx, eval_texts, rows = rank0_first(read_data)
    attention = mc.attn_implementation
    blocks = all_ranks_ok(lambda: build_blocks(texts, tokenizer, dc.max_length, dc.packing, attention))
    eval_blocks = None
    if eval_texts is not None:  # docs and pad give the same per-row losses; docs in fewer blocks
        eval_packing = "concat" if dc.packing == "concat" else "docs"
        eval_blocks = all_ranks_ok(lambda: build_blocks(eval_texts, tokenizer, dc.max_length, eval_packing, attention))
    return SliceData(blocks, end_idx, eval_blocks, rows)
