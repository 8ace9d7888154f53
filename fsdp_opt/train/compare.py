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

from fsdp_opt.base import ConfigError
from fsdp_opt.checkpoint.atomic import atomic_save_text
from fsdp_opt.checkpoint.loading import load_into
from fsdp_opt.checkpoint.read import check_compatible, read_checkpoint
from fsdp_opt.config.choices import shard_count
from fsdp_opt.config.layout import LoraConfig
from fsdp_opt.config.method import MethodConfig
from fsdp_opt.config.parse import Config
from fsdp_opt.config.specs import DEFAULT_METHOD
from fsdp_opt.config.training import DataConfig, ModelConfig
from fsdp_opt.data.formats import held_out_rows, held_out_split, select_rows
from fsdp_opt.data.mixture import MixtureTable
from fsdp_opt.data.pin import PIN_KEY, pinned_revision
from fsdp_opt.data.resolve import DataSource
from fsdp_opt.data.sources import held_out_mixture, open_source
from fsdp_opt.data.tokens import end_of_turn, generation_prompt, read_template
from fsdp_opt.engine.evaluation import generate
from fsdp_opt.hub.store import find_resume
from fsdp_opt.model.adapters import Adapters, check_resume
from fsdp_opt.model.families import mask_pattern
from fsdp_opt.model.parallelize import DTYPES, initialize, resolve_precision, shard_model, tie_and_check
from fsdp_opt.model.sources import build_meta_model, load_model_config, load_tokenizer, resolve_model
from fsdp_opt.runtime.distributed import DistEnv, all_ranks_ok, broadcast_object, print0, rank0_first
from fsdp_opt.train.inputs import data_spec
from fsdp_opt.train.methods import REGISTRY, method_for
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
    method = REGISTRY[flags.get("method") or DEFAULT_METHOD]
    flags["reference"] = (payload.get(method.state_key) or {}).get("ref_model") if method.state_key else None
    return flags, payload.get("slice") or {}


def _find(args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
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


def _read_checked(path: Path, model: nn.Module) -> dict[str, Any]:
    """Rank 0: a checkpoint, refused unless it fits the (meta) model."""

    payload = read_checkpoint(path, "--checkpoints")
    check_compatible(payload, model, path, "--checkpoints")
    return payload


def _adapters(info: dict[str, Any] | None, model: nn.Module, precision: str, env: DistEnv, strategy: str, seed: int):
    """A LoRA checkpoint's adapters (as its run had them) added to the meta model every rank shards; None otherwise."""
    if info is None:
        return None

    settings = LoraConfig(
        lora_rank=info["rank"],
        lora_alpha=info["alpha"],
        lora_dropout=info["dropout"],
        lora_targets=",".join(info["targets"]),
        base_bits=info.get("base_bits", 16),
    )
    adapters = Adapters(settings, info["base"], DTYPES[precision], seed)
    adapters.add_to(model, shard_count(strategy, env.world_size, env.local_world_size))
    return adapters


def _fill(
    model: nn.Module,
    entry: dict[str, Any],
    payload: dict[str, Any] | None,
    source,
    model_config,
    env: DistEnv,
    seed: int,
    adapters: Any = None,
) -> None:
    """Allocate the shards of a sharded meta model and load one candidate's weights into them (a LoRA checkpoint:
    the base from --model, checked against the base the adapters were trained on, then the adapters)."""

    if entry["kind"] != "ckpt":
        weights_from = source if entry["kind"] == "base" else resolve_model(entry["path"])
        initialize(model, env, weights_from, model_config, seed, weights=True)
        return
    sharded = broadcast_object(bool(payload.get("_sharded")) if env.is_main else None)
    path = Path(entry["path"])
    if adapters is not None:
        initialize(
            model,
            env,
            source,
            model_config,
            seed,
            weights=True,
            loader=adapters.load_weights,
            **adapters.load_options(),
        )
        adapters.share_fingerprint(env)
        all_ranks_ok(
            lambda: check_resume(payload["lora"], adapters.identity(), path, "--checkpoints") if env.is_main else None
        )
    else:
        initialize(model, env, source, model_config, seed, weights=False)
    load_into(model, None, payload, env, load_optimizer=False, sharded_path=path if sharded else None)


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

    found = all_ranks_ok(lambda: _find(args) if env.is_main else None)
    entries, trained, trained_slice = broadcast_object(found)
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
    # the method's settings as the first checkpoint trained with them (its reward functions, ...), --method and
    # --beta given here aside
    settings = {f.name: trained[f.name] for f in dataclasses.fields(MethodConfig) if f.name in trained}
    settings.update(
        method=args.method or trained.get("method") or DEFAULT_METHOD, beta=args.beta or trained.get("beta")
    )
    if settings["method"] != trained.get("method"):
        settings = {k: settings[k] for k in ("method", "beta")}
    if getattr(args, "reward", None):
        settings["reward"] = args.reward
    method = method_for(Config(method=MethodConfig(**settings)))
    # a built-in or random: base is made from a seed: the run's, so the base evaluated is the one it trained from
    args.seed = args.seed if args.seed is not None else int(trained.get("seed", 42))
    beta = method.config.method.beta
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
    method.model_config(model_config)
    blocks = all_ranks_ok(
        lambda: method.sequences(
            held_out,
            spec,
            tokenizer,
            train_on=train_on,
            max_length=max_length,
            packing=packing,
            attention=model_config._attn_implementation,
            pattern=pattern,
        )
    )
    ref_name = method.before_scoring(
        blocks,
        env,
        precision,
        tokenizer,
        args.batch_size,
        model_name,
        args.ref_model or trained.get("reference"),
        args.sharding_strategy,
        args.seed,
        model_config=model_config,
    )
    asked = [generation_prompt(r, spec, tokenizer) for r in held_out.rows[: args.num_prompts]]
    if args.prompts:
        asked = [(p, False, "") for p in args.prompts]
    prompts = [p for p, _, _ in asked]
    rendered = bool(asked) and asked[0][1]
    stop = end_of_turn(tokenizer) if rendered else None
    candidates = ([] if args.no_base else [{"name": f"base ({model_name})", "kind": "base"}]) + entries
    print0(
        f"evaluating {len(candidates)} model(s) on rows [{start}, {end}) ({where}) of {dataset}: "
        f"{method.scored_what(blocks, packing, max_length, train_on)}, {env.world_size} rank(s), {precision}"
    )

    models, samples = [], [{"prompt": p, "answer": a, "outputs": {}} for p, _, a in asked]
    for entry in candidates:
        model = build_meta_model(model_config)
        payload, adapters, seed = None, None, args.seed
        if entry["kind"] == "ckpt":
            payload = all_ranks_ok(
                lambda: read_checkpoint(Path(entry["path"]), "--checkpoints") if env.is_main else None
            )
            # A LoRA checkpoint's base is built from its run's seed when the base is the built-in or a random: one.
            info, seed = broadcast_object(
                (payload.get("lora"), int((payload.get("config") or {}).get("seed", args.seed)))
                if env.is_main
                else None
            )
            adapters = all_ranks_ok(lambda: _adapters(info, model, precision, env, args.sharding_strategy, seed))
            all_ranks_ok(lambda: _read_checked(Path(entry["path"]), model) if env.is_main else None)
        shard_model(
            model,
            env,
            strategy=args.sharding_strategy,
            precision=precision,
            activation_checkpointing=False,
            ignored=adapters.unsharded(model) if adapters else None,
        )
        _fill(model, entry, payload, source, model_config, env, seed, adapters)
        payload = None
        tie_and_check(model)
        result = method.score(model, blocks, args.batch_size, env)
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
                max_new_tokens=args.max_new_tokens,
                do_sample=args.do_sample,
                temperature=args.temperature,
                top_p=args.top_p,
                seed=args.seed,
                rendered=rendered,
                stop=stop,
            )
        print0(f"  {entry['name']}: {method.score_line(result)}")
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
        "reference": ref_name,
        "beta": beta,
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
    if env.is_main:
        print(report_markdown(report))
        if args.json:
            atomic_save_text(json.dumps(report, indent=1), Path(args.json))
            print(f"wrote {args.json}")
    return report
