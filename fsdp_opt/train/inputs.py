"""What a session reads before it builds anything: the model's config and tokenizer, and the slice's blocks (with
the held-out rows of --eval_rows). Rank 0 reads first (downloads), the other ranks then hit the cache."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import PretrainedConfig, PreTrainedTokenizerBase

from fsdp_opt.base import ConfigError, DataError, picked
from fsdp_opt.config.choices import AUTO
from fsdp_opt.config.methods import METHOD_SPECS, MethodSpec
from fsdp_opt.config.parse import Config
from fsdp_opt.config.training import DataConfig
from fsdp_opt.data.formats import Rows, RowSpec, held_out_rows, held_out_split, mixed, resolve_spec, select_rows
from fsdp_opt.data.mixture import MixtureTable
from fsdp_opt.data.pin import described, mixture_changed, rows_digest, tokens_digest
from fsdp_opt.data.resolve import DataSource
from fsdp_opt.data.sequences import Packing
from fsdp_opt.data.sources import held_out_mixture, mixture_definition, open_source
from fsdp_opt.data.table import Table
from fsdp_opt.data.tokens import read_template
from fsdp_opt.engine.fp16watch import trained_in_bf16
from fsdp_opt.hub.store import resume_pin
from fsdp_opt.model.families import bos_note, mask_pattern, untested_note
from fsdp_opt.model.loader import set_head
from fsdp_opt.model.sources import ModelSource, load_model_config, load_tokenizer, max_positions, without_dropout
from fsdp_opt.runtime.distributed import all_ranks_ok, broadcast_object, env_rank, print0, rank0_first
from fsdp_opt.train.methods.base import Method, SequenceInput


@dataclass
class SliceData:
    """The rows [start_idx, end_idx) as blocks, and the held-out blocks after them."""

    blocks: Any  # what the method makes of the rows (method.sequences): blocks, preference pairs, prompts
    end_idx: int  # --end_idx, or the end of the data
    eval_blocks: Any
    rows: int  # of the whole dataset
    spec: RowSpec  # the rows' format, resolved from the columns under --data_format auto
    train_on: str  # completion | all, resolved
    eval_rows: Rows | None = None  # the held-out rows themselves (their prompts, for generation)
    rows_digest: str = ""  # fingerprints of the slice's rows and of their tokens (data/pin.py)
    tokens_digest: str = ""
    source: dict[str, Any] | None = None  # what the rows come from, as the pin records it (data/sources.py)
    table: Table | None = None  # rank 0's open split, to read other ranges of (the pin's checks)
    eval_label: str = ""  # which rows the held-out ones are: [a, b) after the slice, or [0, n) of split S


@dataclass
class Inputs:
    """The model's config and tokenizer and the slice, read once."""

    model_config: PretrainedConfig
    tokenizer: PreTrainedTokenizerBase
    data: SliceData
    bf16_pretrained: bool  # as the model's files say (building the model sets the config's dtype to the engine's)


def read_inputs(
    config: Config, source: ModelSource, method: Method, revision: str | None = None, pin: dict[str, Any] | None = None
) -> Inputs:
    mc, dc = config.model, config.data
    model_config, tokenizer = rank0_first(
        lambda: (load_model_config(source, mc.attn_implementation), load_tokenizer(source))
    )
    if mc.attn_implementation == "auto" and model_config._attn_implementation != "sdpa":
        print0(f"attention: {model_config._attn_implementation} ({model_config.model_type} has no SDPA path)")
    untested = untested_note(model_config)
    if untested:
        print0(untested)
    bf16_pretrained = trained_in_bf16(model_config)
    without_dropout_where(method.spec, model_config)
    set_head(model_config, method.spec.head, tokenizer.pad_token_id)
    positions = max_positions(model_config)
    if positions is not None and dc.max_length > positions:
        raise ConfigError(f"--max_length {dc.max_length}: {mc.model} has only {positions} positions")
    data = read_slice(config, tokenizer, model_config, method, revision, pin)
    # The BOS note is about text rows, which the tokenizer's own special tokens begin: rows a chat template renders
    # (conversations, prompts: an exported chat model's too) begin as the template writes them. The built-in model and
    # random: shapes read text with the built-in tokenizer, which adds no BOS by design.
    if source.kind in ("local", "hub") and any(p.format == "text" for p in data.spec.parts or (data.spec,)):
        bos = bos_note(model_config, tokenizer)
        if bos:
            print0(bos)
    return Inputs(model_config, tokenizer, data, bf16_pretrained)


def data_spec(dc: DataConfig, table: Table, method: Method) -> tuple[RowSpec, str]:
    """The row format (--data_format, or the one the columns fit; a mixture: each source's, from its own data_format
    and columns), checked against the method, and --train_on resolved for it."""
    if isinstance(table, MixtureTable):
        parts = []
        for n, (columns, fmt) in enumerate(zip(table.source_columns, table.formats), 1):
            try:
                parts.append(_row_spec(dc, columns, fmt or dc.data_format, method))
            except DataError as exc:
                raise DataError(f"--dataset {dc.dataset}: source {n} ({table.names[n - 1]}): {exc}") from None
        spec = mixed(parts)
    else:
        spec = _row_spec(dc, table.column_names, dc.data_format, method)
    check_rows(method.spec, spec)
    if dc.train_on == "completion" and not spec.has_answers:
        raise ConfigError(
            f"--train_on completion: the rows are text (column {spec.text_column}), with no completion; "
            "use --train_on all, or name the prompt and completion or messages columns"
        )
    train_on = dc.train_on if dc.train_on != "auto" else ("completion" if spec.has_answers else "all")
    return spec, train_on


def _row_spec(dc: DataConfig, column_names, data_format: str, method: Method) -> RowSpec:
    columns = ("text", "prompt", "completion", "messages", "chosen", "rejected")
    return resolve_spec(
        column_names, data_format, **picked(dc, *(f"{c}_column" for c in columns)), prefer=method.spec.rows
    )


def read_slice(
    config: Config,
    tokenizer: PreTrainedTokenizerBase,
    model_config: PretrainedConfig,
    method: Method,
    revision: str | None = None,
    pin: dict[str, Any] | None = None,
) -> SliceData:
    """The slice of config.data as blocks. A range of an auto chain that ends at the end of the data has no rows after
    it: it trains without --eval_rows, with a note, rather than stopping the chain. The chat template (--chat_template,
    else the tokenizer's own) is set on the tokenizer, which the export saves with the model. A Hub dataset is read
    at `revision` (the chain's pinned one, or --dataset_revision), from the chain's index of it where `pin` has one.

    Rank 0 reads the rows (only the slice's and the held-out ones, for data stored as parquet) and hands them to the
    other ranks: one download per run, whatever the nodes share."""
    dc = config.data
    template = all_ranks_ok(lambda: read_template(dc.chat_template, tokenizer))
    if template is not None:
        tokenizer.chat_template = template
    src = DataSource.of(dc, revision)
    box: list[Table] = []

    def read_data() -> tuple[RowSpec, str, Rows, Rows | None, int, dict[str, Any], str]:
        table = open_source(src, pin)
        box.append(table)
        spec, train_on = data_spec(dc, table, method)
        rows = select_rows(table, spec, dc.start_idx, dc.end_idx)
        if isinstance(table, MixtureTable):
            print0(table.given_line(dc.start_idx, rows.end_idx))
        held_out, label = None, ""
        if dc.eval_rows and dc.eval_split:
            held = open_source(src.with_split(dc.eval_split))
            missing = [c for c in spec.columns if c not in held.column_names]
            if missing:
                raise DataError(
                    f"--eval_split {dc.eval_split}: it has no column {missing[0]} (its columns: "
                    f"{', '.join(held.column_names)})"
                )
            held_out = held_out_split(held, spec, dc.eval_rows, dc.eval_split)
        elif dc.eval_rows and isinstance(table, MixtureTable) and any(table.held):
            held = held_out_mixture(src, table, rows.end_idx)
            if not len(held):
                raise DataError(
                    f"--eval_rows {dc.eval_rows}: the mixture's held-out rows (its sources' eval_split, and "
                    "the rows after the slice of the others) are used up at once: a source has none left"
                )
            held_out = select_rows(held, spec, 0, min(len(held), dc.eval_rows))
            others = "" if all(table.held) else " (a source with none: its rows after the slice's)"
            label = f"[0, {held_out.end_idx}) of the mixture of the sources' eval splits{others}"
        elif dc.eval_rows and dc.range_size is not None and rows.end_idx >= len(table):
            print0(
                f"note: no rows after [{dc.start_idx}, {rows.end_idx}), the end of the data, to evaluate on: this "
                "range trains without --eval_rows (--eval_split names a held-out split)"
            )
        elif dc.eval_rows:
            held_out = held_out_rows(table, spec, rows.end_idx, dc.eval_rows)
        if not label:
            label = held_label(held_out, dc.eval_split, rows.end_idx)
        return spec, train_on, rows, held_out, len(table), table.identity, label

    read = all_ranks_ok(lambda: read_data() if env_rank() == 0 else None)
    spec, train_on, rows, eval_rows, total, identity, label = broadcast_object(read)
    attention = model_config._attn_implementation
    pattern = all_ranks_ok(lambda: mask_pattern(model_config) if dc.packing == "docs" else None)

    def blocks_of(part: Rows, packing: str):  # noqa: ANN202
        laid = Packing(tokenizer.pad_token_id, dc.max_length, packing, attention, pattern)
        return method.sequences(SequenceInput(part, spec, tokenizer, train_on, laid))

    blocks = all_ranks_ok(lambda: blocks_of(rows, dc.packing))
    eval_blocks = None
    if eval_rows is not None:
        eval_blocks = all_ranks_ok(lambda: blocks_of(eval_rows, eval_packing(method.spec, dc.packing)))
    describe_rows(spec, train_on, rows, blocks)
    return SliceData(
        blocks,
        rows.end_idx,
        eval_blocks,
        total,
        spec,
        train_on,
        eval_rows,
        rows_digest(rows.rows, rows.indices),
        tokens_digest(blocks),
        identity,
        box[0] if box else None,
        label,
    )


def held_label(held: Rows | None, split: str | None, after: int) -> str:
    """The held-out rows as the eval line and eval.jsonl name them."""
    if held is None:
        return ""
    return f"[0, {held.end_idx}) of split {split}" if split else f"[{after}, {held.end_idx})"


def refuse_changed_mixture(dataset: str, pin: dict[str, Any] | None, source: dict[str, Any] | None) -> None:
    """A chain that trained ranges of a mixture, resumed with another definition of it (its weights, its sources):
    one line. Asked before the lease is taken (with the definition the file gives), and again with the data read."""
    if not (pin or {}).get("ranges"):  # nothing trained yet: nothing to hold the mixture to
        return
    changed = mixture_changed(pin.get("source"), source)
    if changed:
        raise DataError(
            f"--dataset {dataset}: the mixture is not the one this chain trained on: {changed}, which "
            "moves rows from one source to another. Restore the mixture file, or start a new chain"
        )


def refuse_changed_mixture_now(config: Config) -> None:
    """Rank 0, before the chain's lease is taken or the data described: a session that resumes a mixture by name
    (--resume_file) against the pin its checkpoint records, with the definition the mixture file gives. (--start_idx
    auto asks the same where it reads the newest checkpoint.)"""
    dc, cc, hc = config.data, config.checkpoint, config.hub
    if not cc.resume_file or dc.start_idx == AUTO:
        return
    definition = mixture_definition(DataSource.of(dc))
    if definition is not None:
        pin = resume_pin(cc.resume_file, Path(cc.output_dir), hc.hf_repo, hc.hub_retries)
        refuse_changed_mixture(dc.dataset, pin, definition)


def check_pin(
    config: Config,
    method: Method,
    pin: dict[str, Any] | None,
    data: SliceData,
    tokenizer: PreTrainedTokenizerBase,
    model_config: PretrainedConfig,
    resumed: tuple[int, int] | None,
) -> dict[str, Any]:
    """Rank 0: the chain's data pin against the data as read now; returns the source as read now.

    The source as recorded: nothing more to read. Another one (a file edited or grown, another revision): every
    trained range is read again (those rows only), and one whose rows changed stops the run in one line. The range
    the checkpoint trained (`resumed`) is tokenized again when it is not this session's: other token ids mean another
    tokenizer."""
    dc = config.data
    source, table = data.source or {}, data.table
    if not pin:
        return source
    trained = pin.get("ranges", [])
    refuse_changed_mixture(dc.dataset, pin, source)
    if source != pin.get("source"):
        spec, _ = data_spec(dc, table, method)
        for r in trained:
            if r["end"] > len(table):
                raise DataError(
                    f"--dataset {dc.dataset}: rows [{r['start']}, {r['end']}), trained by this chain, are "
                    f"gone: it has {len(table):,} rows now (it was {described(pin.get('source'))}, now "
                    f"{described(source)}). Restore the data the chain trained on, or start a new chain"
                )
            rows = select_rows(table, spec, r["start"], r["end"])
            if rows_digest(rows.rows, rows.indices) != r["rows"]:
                raise DataError(
                    f"--dataset {dc.dataset}: rows [{r['start']}, {r['end']}), trained by this chain, "
                    f"changed since (it was {described(pin.get('source'))}, now {described(source)}): the "
                    "chain would skip rows and train others twice. Restore the data the chain trained on, "
                    "or start a new chain"
                )
        print0(
            f"data: {dc.dataset} is not what the chain recorded (it was {described(pin.get('source'))}, now "
            f"{described(source)}), but the {len(trained)} range(s) it trained have the same rows: going on"
        )
    last = next((r for r in trained if resumed and (r["start"], r["end"]) == resumed), None)
    # the token fingerprint holds for the blocks as packed then: with --allow_changes to another packing or
    # max_length there is nothing to compare it with
    if last is not None and (last.get("packing"), last.get("max_length")) in (
        (dc.packing, dc.max_length),
        (None, None),
    ):
        if (dc.start_idx, data.end_idx) == resumed:
            tokens = data.tokens_digest
        else:
            rows = select_rows(table, data.spec, last["start"], last["end"])
            pattern = mask_pattern(model_config) if dc.packing == "docs" else None
            laid = Packing(
                tokenizer.pad_token_id, dc.max_length, dc.packing, model_config._attn_implementation, pattern
            )
            tokens = tokens_digest(method.sequences(SequenceInput(rows, data.spec, tokenizer, data.train_on, laid)))
        if tokens != last["tokens"]:
            raise DataError(
                f"--model {config.model.model}: its tokenizer makes other token ids of rows [{last['start']}, "
                f"{last['end']}) than the chain trained on (another tokenizer or its settings): use the "
                "tokenizer the chain trained with, or start a new chain"
            )
    return source


def describe_rows(spec: RowSpec, train_on: str, rows: Rows, blocks) -> None:  # noqa: ANN001
    """One line on what the rows are and which tokens train, and one on what --max_length cut."""
    kind = words(spec).split(" (")[0]
    if rows.conversational:
        kind += " of messages"
    loss = "every token" if train_on == "all" else "the answers only"
    empty = f"; {rows.empty} with nothing to train on dropped" if rows.empty else ""
    if rows.identical:
        empty += f"; {rows.identical} whose chosen answer is the rejected one dropped"
    print0(f"data: {len(rows.rows):,} rows of {kind} (column {', '.join(spec.columns)}), loss on {loss}{empty}")
    if blocks.fit is not None and (blocks.fit.cut or blocks.fit.dropped):
        print0(f"data: {blocks.fit.describe()}")
    totals = blocks.source_totals()
    if totals is not None:  # a mixture: what each source gives the range once tokenized, cut and packed
        tokens = totals.get("tokens", [None] * len(rows.source_names))
        print0(
            "data: by source, "
            + "; ".join(
                f"{name}: {n:,} rows" + (f", {t:,} tokens trained" if t is not None else "")
                for name, n, t in zip(rows.source_names, totals["rows"], tokens)
            )
        )


def eval_packing(spec: MethodSpec, packing: str) -> str:
    """How the held-out rows are packed: blocks of whole rows (docs and pad give the same per-row losses; docs in
    fewer blocks) unless the rows are joined; a method whose sequences stay whole packs them as training does."""
    if spec.concat:
        return "concat" if packing == "concat" else "docs"
    return packing


def without_dropout_where(spec: MethodSpec, model_config: PretrainedConfig) -> None:
    """The model's config before anything is built: dropout off where the method trains without it (its loss compares
    forwards of one model, or samples and scores on the same forward), in one line saying why."""
    off = [] if spec.dropout else without_dropout(model_config)
    if off:
        why = (
            "completions are sampled and scored on the same forward the loss takes"
            if spec.generates
            else ("the policy is compared with its reference on the same forward")
        )
        print0(f"{spec.name}: dropout off ({', '.join(off)}): {why}")


def check_rows(method: MethodSpec, spec: RowSpec) -> None:
    """The rows' format (found from the columns) against the formats the method trains on: one line if not. A
    mixture's sources may differ in format: each must be one of them."""
    if all(p.format in method.rows for p in spec.parts or (spec,)):
        return
    owner = next((m for m, t in METHOD_SPECS.items() if spec.format in t.rows), None)
    then = f": train them with --method {owner}" if owner else f"; it trains on {method.what}"
    hint = f" ({method.rows_hint})" if method.rows_hint else ""
    raise ConfigError(f"--method {method.name}: the rows are {words(spec)}{then}{hint}")


def words(spec: RowSpec) -> str:
    """A row format in words, with its columns."""
    if spec.format == "mixed":
        kinds = dict.fromkeys(words(p).split(" (")[0] for p in spec.parts)
        return f"a mixture of {' and '.join(kinds)} (column {', '.join(spec.columns)})"
    kind = {
        "text": "text",
        "messages": "conversations",
        "prompt_completion": "prompt/completion pairs",
        "preference": "preference pairs",
        "prompt": "prompts",
        "unpaired": "unpaired rows",
    }[spec.format]
    return f"{kind} (column {', '.join(spec.columns)})"
