"""Held-out comparison of checkpoints against the base model they were trained from: each is loaded into the same
sharded model on every rank, evaluated on the same rows, and optionally asked to continue the same prompts. The
command `python -m fsdp_opt.evaluate` is its front end; train/report.py renders what it returns."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fsdp_opt.base import ConfigError, picked
from fsdp_opt.checkpoint.atomic import atomic_save_text
from fsdp_opt.checkpoint.loading import load_into
from fsdp_opt.checkpoint.read import check_compatible, read_checkpoint
from fsdp_opt.config.layout import LoraConfig
from fsdp_opt.config.method import MethodConfig, refuse_foreign
from fsdp_opt.config.methods import DEFAULT_METHOD
from fsdp_opt.config.training import DataConfig, ModelConfig
from fsdp_opt.data.formats import held_out_rows, held_out_split, select_rows
from fsdp_opt.data.mixture import MixtureTable
from fsdp_opt.data.pin import PIN_KEY, pinned_revision
from fsdp_opt.data.resolve import DataSource
from fsdp_opt.data.sequences import Packing
from fsdp_opt.data.sources import held_out_mixture, open_source
from fsdp_opt.data.tokens import end_of_turn, generation_prompt, read_template
from fsdp_opt.engine.evaluation import generate
from fsdp_opt.hub.store import find_resume
from fsdp_opt.model.adapters import Adapters, check_resume
from fsdp_opt.model.families import mask_pattern
from fsdp_opt.model.loader import Build, load_model, set_head
from fsdp_opt.model.parallelize import DTYPES, resolve_precision
from fsdp_opt.model.sources import ModelSource, load_model_config, load_tokenizer, resolve_model
from fsdp_opt.runtime.distributed import DistEnv, all_ranks_ok, broadcast_object, print0, rank0_first
from fsdp_opt.train.components import Setup, for_evaluation
from fsdp_opt.train.inputs import data_spec, without_dropout_where
from fsdp_opt.train.methods import method_for
from fsdp_opt.train.methods.base import RunParts, SequenceInput
from fsdp_opt.train.reference import Frozen
from fsdp_opt.train.report import report_markdown

DEFAULT_EVAL_ROWS = 200


def _held_out_split(src: DataSource) -> str | None:
    """A held-out split the dataset has (test, else validation), or None."""
    for split in FALLBACK_SPLITS:
        if split == src.split:
            continue
        try:
            open_source(src.with_split(split))
            return split
        except ConfigError:
            continue
    return None


def _trained_from(entries: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The flags and the slice the first checkpoint was trained with (rank 0); the flags carry the chat template the
    run used (`chat_template_text`)."""

    first = next((e for e in entries if e["kind"] == "ckpt"), None)
    if first is None:
        return {}, {}
    payload = read_checkpoint(Path(first["path"]), "--checkpoints")
    flags = dict(payload.get("config") or {})
    flags["chat_template_text"] = payload.get("chat_template")
    flags[PIN_KEY] = payload.get(PIN_KEY)
    flags["reference"] = (payload.get(flags.get("method") or DEFAULT_METHOD) or {}).get("ref_model")
    return flags, payload.get("slice") or {}


def find_models(args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
    """Rank 0: each --checkpoints entry as a model folder or a checkpoint (fetched from the Hub if need be)."""

    entries = []
    for spec in args.checkpoints:
        folder = Path(spec).expanduser()
        if folder.is_dir() and (folder / "config.json").is_file():
            entries.append({"name": folder.name, "kind": "hf", "path": str(folder)})
        else:
            path = find_resume(spec, Path(args.output_dir), args.hf_repo, flag="--checkpoints")
            entries.append({"name": path.name, "kind": "ckpt", "path": str(path)})
    return (entries, *_trained_from(entries))


def _adapters(info: dict[str, Any] | None, precision: str, seed: int) -> Adapters | None:
    """A LoRA checkpoint's adapters, as its run had them (None for a full checkpoint)."""
    if info is None:
        return None
    settings = LoraConfig(
        lora_rank=info["rank"],
        lora_alpha=info["alpha"],
        lora_dropout=info["dropout"],
        lora_targets=",".join(info["targets"]),
        base_bits=info.get("base_bits", 16),
    )
    return Adapters(settings, info["base"], DTYPES[precision], seed, tuple(info.get("whole", ())))


def load_candidate(
    entry: dict[str, Any],
    source: ModelSource,
    model_config,  # noqa: ANN001
    head: str,
    precision: str,
    strategy: str,
    seed: int,
    env: DistEnv,
) -> nn.Module:
    """One model to score, built by the loader and filled: the base (its weights), a model folder (its own), a
    checkpoint (a full one: its state loaded into the shards; a LoRA one: the base from --model, checked against the
    base the adapters were trained on, then the adapters)."""
    if entry["kind"] != "ckpt":
        where = source if entry["kind"] == "base" else resolve_model(entry["path"])
        return load_model(Build(where, model_config, precision, strategy, seed, head=head), env).model
    path = Path(entry["path"])
    payload = all_ranks_ok(lambda: read_checkpoint(path, "--checkpoints") if env.is_main else None)
    # A LoRA checkpoint's base is built from its run's seed when the base is the built-in or a random: one.
    info, seed = broadcast_object(
        (payload.get("lora"), int((payload.get("config") or {}).get("seed", seed))) if env.is_main else None
    )
    adapters = _adapters(info, precision, seed)
    build = Build(
        source,
        model_config,
        precision,
        strategy,
        seed,
        head=head,
        adapters=adapters,
        weights=adapters is not None,
    )
    check = lambda model: all_ranks_ok(  # noqa: E731
        lambda: check_compatible(payload, model, path, "--checkpoints") if env.is_main else None
    )
    model = load_model(build, env, check).model
    if adapters is not None:
        all_ranks_ok(
            lambda: check_resume(payload["lora"], adapters.identity(), path, "--checkpoints") if env.is_main else None
        )
    sharded = broadcast_object(bool(payload.get("_sharded")) if env.is_main else None)
    load_into(model, None, payload, env, load_optimizer=False, sharded_path=path if sharded else None)
    return model


# The data flags evaluate takes, or else the first checkpoint's.
DATA_FLAGS = (
    "text_column",
    "data_format",
    "prompt_column",
    "completion_column",
    "messages_column",
    "train_on",
    "dataset_config",
    "dataset_split",
    "dataset_files",
    "eval_split",
    "chosen_column",
    "rejected_column",
)
FALLBACK_SPLITS = ("test", "validation")  # held-out splits looked for when no row is left after the range


def compare(args: argparse.Namespace, env: DistEnv) -> dict[str, Any]:
    """Evaluate the base model and each checkpoint in turn (one in memory at a time) on the same rows."""
    import gc

    found = all_ranks_ok(lambda: find_models(args) if env.is_main else None)
    entries, trained, trained_slice = broadcast_object(found)
    # the method's settings as the first checkpoint trained with them (its reward functions, ...), --method and its
    # flags given here aside (another method than the checkpoint's: its own defaults)
    name = args.method or trained.get("method") or DEFAULT_METHOD
    given = {k: getattr(args, k, None) for k in ("beta", "reward", "ref_model")}
    refuse_foreign(name, given)  # a flag given here that the method does not take: the trainer's one line
    model_name = args.model or trained.get("model") or ModelConfig.model
    dataset = args.dataset or trained.get("dataset") or DataConfig.dataset
    max_length = args.max_length or trained.get("max_length") or DataConfig.max_length
    start = args.start_idx if args.start_idx is not None else trained_slice.get("end_idx")
    data_flags = {k: getattr(args, k, None) or trained.get(k) for k in DATA_FLAGS}
    if args.dataset and args.dataset != trained.get("dataset"):  # another dataset: not the run's names of its parts
        data_flags.update({k: getattr(args, k, None) for k in ("dataset_config", "dataset_split", "dataset_files")})
    if args.start_idx is not None and not args.eval_split:
        data_flags["eval_split"] = None  # rows of the training split were asked for
    data_flags["eval_rows"] = args.eval_rows
    dc = DataConfig(dataset=dataset, **{k: v for k, v in data_flags.items() if v is not None})
    if start is None and dc.eval_split is None:
        raise ConfigError("--start_idx: needed when no checkpoint says which rows it was trained on (or --eval_split)")
    pin = trained.get(PIN_KEY) if dataset == trained.get("dataset") else None
    values = {**(trained if name == trained.get("method") else {}), **{k: v for k, v in given.items() if v is not None}}
    method = method_for(
        MethodConfig.from_flags(name, {k: v for k, v in values.items() if k != "ref_model"}, strict=False)
    )
    # a built-in or random: base is made from a seed: the run's, so the base evaluated is the one it trained from
    args.seed = args.seed if args.seed is not None else int(trained.get("seed", 42))
    src = DataSource.of(dc, pinned_revision(pin, DataSource.of(dc)))

    source = all_ranks_ok(lambda: resolve_model(model_name))
    precision = all_ranks_ok(lambda: resolve_precision(args.precision, env.device))
    model_config, tokenizer = rank0_first(lambda: (load_model_config(source), load_tokenizer(source)))
    # The template the run trained with (kept in its checkpoint), unless --chat_template names another.
    template = trained.get("chat_template_text") if args.chat_template is None else None
    template = template or all_ranks_ok(lambda: read_template(args.chat_template, tokenizer))
    if template is not None:
        tokenizer.chat_template = template

    def read_held_out() -> tuple[Any, str, Any, str, int]:
        table = open_source(src, pin)
        spec, train_on = data_spec(dc, table, method)
        split = dc.eval_split
        if split is None and isinstance(table, MixtureTable) and any(table.held):  # the sources' eval splits
            held = held_out_mixture(src, table, start or 0)
            return (
                spec,
                train_on,
                select_rows(held, spec, 0, min(len(held), args.eval_rows)),
                "the sources' eval splits",
                0,
            )
        if split is None and (start or 0) >= len(table):
            split = _held_out_split(src)
            if split is None:
                held_out_rows(table, spec, start, args.eval_rows)  # the error: no rows after the range
            print0(
                f"note: no rows after [.., {start}) of {src.describe()}, the end of it: evaluating on its {split} split"
            )
        if split is not None:
            held = open_source(src.with_split(split))
            return spec, train_on, held_out_split(held, spec, args.eval_rows, split), f"split {split}", 0
        return spec, train_on, held_out_rows(table, spec, start, args.eval_rows), f"split {src.split}", start

    spec, train_on, held_out, where, start = broadcast_object(
        all_ranks_ok(lambda: read_held_out() if env.is_main else None)
    )
    end = held_out.end_idx
    packing = args.packing or ("concat" if trained.get("packing") == "concat" else "docs")
    pattern = all_ranks_ok(lambda: mask_pattern(model_config) if packing == "docs" else None)
    without_dropout_where(method.spec, model_config)
    set_head(model_config, method.spec.head, tokenizer.pad_token_id)
    laid = Packing(tokenizer.pad_token_id, max_length, packing, model_config._attn_implementation, pattern)
    blocks = all_ranks_ok(lambda: method.sequences(SequenceInput(held_out, spec, tokenizer, train_on, laid)))
    made = Setup(
        env=env,
        model_name=model_name,
        model_config=model_config,
        tokenizer=tokenizer,
        lora=False,
        sequences=None,
        held_out=blocks,
        plan=None,
        epochs=range(0),
        batch_size=args.batch_size,
    )
    how = Frozen(env, precision, args.sharding_strategy, tokenizer, model_name, seed=args.seed)
    components = for_evaluation(method.spec, method.settings, how, made, args.ref_model or trained.get("reference"))
    scorer = method.scorer(RunParts(env, model_config, tokenizer, None, None, blocks, args.batch_size, components))
    asked = [generation_prompt(r, spec, tokenizer) for r in held_out.rows[: args.num_prompts]]
    if args.prompts:
        asked = [(p, False, "") for p in args.prompts]
    prompts = [p for p, _, _ in asked]
    rendered = bool(asked) and asked[0][1]
    stop = end_of_turn(tokenizer) if rendered else None
    candidates = ([] if args.no_base else [{"name": f"base ({model_name})", "kind": "base"}]) + entries
    print0(
        f"evaluating {len(candidates)} model(s) on rows [{start}, {end}) ({where}) of {dataset}: "
        f"{scorer.what()}, {env.world_size} rank(s), {precision}"
    )

    models, samples = [], [{"prompt": p, "answer": a, "outputs": {}} for p, _, a in asked]
    for entry in candidates:
        model = load_candidate(
            entry, source, model_config, method.spec.head, precision, args.sharding_strategy, args.seed, env
        )
        result = scorer.score(model)
        scored = result.pop("samples", None)  # completions the score was taken on (GRPO): those are shown
        if scored is not None and not args.prompts:
            by_row = {x["row"]: x["completion"] for x in scored}
            texts_out = [
                by_row.get(int(r), "(not scored: no room for a completion)") for r in held_out.indices[: len(prompts)]
            ]
        else:
            texts_out = generate(
                model,
                tokenizer,
                prompts,
                env,
                **picked(args, "max_new_tokens", "do_sample", "temperature", "top_p", "seed"),
                rendered=rendered,
                stop=stop,
            )
        print0(f"  {entry['name']}: {scorer.line(result)}")
        models.append({"name": entry["name"], "kind": entry["kind"], "path": entry.get("path"), **result})
        for sample, text in zip(samples, texts_out):
            sample["outputs"][entry["name"]] = text
        model = None
        gc.collect()
        if env.device.type == "cuda":
            torch.cuda.empty_cache()

    report = {
        "rows": f"[{start}, {end})",
        "start_idx": start,
        "end_idx": end,
        "split": where,
        "dataset": dataset,
        "method": method.name,
        "reference": components.reference.name if components.reference else None,
        "beta": getattr(method.settings, "beta", None),
        "settings": dataclasses.asdict(method.settings),
        "data_format": spec.format,
        "columns": list(spec.columns),
        "train_on": train_on,
        "end_of_turn": stop,
        "max_length": max_length,
        "world_size": env.world_size,
        "precision": precision,
        "models": models,
        "samples": samples,
        "generation": {
            "max_new_tokens": args.max_new_tokens,
            "do_sample": args.do_sample,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "seed": args.seed,
        },
    }
    report["table"] = scorer.table(report)
    if env.is_main:
        print(report_markdown(report))
        if args.json:
            atomic_save_text(json.dumps(report, indent=1), Path(args.json))
            print(f"wrote {args.json}")
    return report
