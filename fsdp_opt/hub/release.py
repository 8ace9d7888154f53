"""The end of a chain: a checkpoint (or an exported model folder) as a model someone runs. The Hugging Face folder
(safetensors in the dtype asked, sharded as transformers shards; LoRA merged, or the adapter folder), GGUF files with
their Modelfiles, and with --push_to_hub the model repo with its card. Everything is checked before anything is
written, built in a temporary folder beside the destination, and renamed (or pushed) whole."""

from __future__ import annotations

import shlex
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import AutoConfig, AutoTokenizer

from fsdp_opt.base import ConfigError
from fsdp_opt.checkpoint.export import export_lora, export_model_folder, tokenizer_with
from fsdp_opt.checkpoint.gguf import SafetensorsFolder, check_room, plan_exports, write_ggufs
from fsdp_opt.checkpoint.loading import load_full_payload
from fsdp_opt.checkpoint.names import MODEL_KEY
from fsdp_opt.config.methods import DEFAULT_METHOD, spec
from fsdp_opt.hub.modelcard import record_from_checkpoint, render_model_card
from fsdp_opt.hub.modelrepo import push_folder, read_chain_index
from fsdp_opt.model.loader import meta_model
from fsdp_opt.model.sources import load_model_config, resolve_model


@dataclass
class Release:
    checkpoint: Path
    dest: Path | None
    dtype: str = "fp16"
    model: str | None = None
    adapter: bool = False
    gguf: list[str] = field(default_factory=list)
    push_to_hub: str | None = None
    private: bool = True
    hub_retries: int = 5


def _source(release: Release) -> tuple[dict[str, Any] | None, Any, str]:
    """(the checkpoint's payload or None for a model folder, the model's config, its name)."""
    path = release.checkpoint
    if path.is_dir() and (path / "config.json").is_file():
        if release.adapter:
            raise ConfigError(f"--adapter: {path} is a model folder, not a LoRA checkpoint")
        return None, AutoConfig.from_pretrained(path), str(path)
    payload = load_full_payload(path, "checkpoint")
    info = payload.get("lora")
    if info is None and release.adapter:
        raise ConfigError(
            f"--adapter: {path} is a full fine-tuning checkpoint (it has no adapter); leave --adapter out"
        )
    name = info["base"] if info is not None else release.model or (payload.get("config") or {}).get("model")
    if not name:
        raise ConfigError(f"checkpoint {path}: it does not record its model; pass --model NAME")
    return payload, load_model_config(resolve_model(name)), name


def run_release(release: Release, command: list[str], log=print) -> Path | None:  # noqa: ANN001
    """Returns the folder written (None when it was only pushed)."""
    if release.dest is None and release.push_to_hub is None:
        raise ConfigError("export: give a destination folder, --push_to_hub user/name, or both")
    if release.gguf and release.adapter:
        raise ConfigError("--gguf: llama.cpp runs a whole model, not an adapter; leave --adapter out (LoRA is merged)")
    payload, config, name = _source(release)
    final = release.dest or Path(tempfile.gettempdir()) / release.push_to_hub.replace("/", "--")
    plans = []
    if release.gguf:
        shapes = {k: tuple(v.shape) for k, v in meta_model(config).state_dict().items()}
        plans = plan_exports(config, shapes, release.gguf, final)
        for p in plans:
            log(p.line())
        check_room(plans, final.parent)
    parent = final.parent if release.dest else Path(tempfile.gettempdir())
    parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{final.name}.", dir=parent) as staging:
        folder = Path(staging) / final.name
        tokenizer = _write_folder(release, payload, name, folder)
        if plans:
            shapes = SafetensorsFolder(folder).shapes()
            plans = plan_exports(config, shapes, release.gguf, folder)
            write_ggufs(folder, AutoConfig.from_pretrained(folder), tokenizer, plans, log)
        if release.push_to_hub:
            card = model_card(release, payload, [p.path.name for p in plans], command, log)
            push_folder(
                release.push_to_hub, folder, card, private=release.private, retries=release.hub_retries, log=log
            )
            (folder / "README.md").write_text(card)
        if release.dest is None:
            return None
        if final.exists():
            shutil.rmtree(final)
        folder.rename(final)
    return final


def _write_folder(release: Release, payload: dict[str, Any] | None, name: str, folder: Path) -> Any:
    """The Hugging Face folder (or the adapter folder) into `folder`; returns the tokenizer it holds."""
    if payload is None:
        shutil.copytree(release.checkpoint, folder)
        return AutoTokenizer.from_pretrained(folder)
    info = payload.get("lora")
    template = payload.get("chat_template")
    if info is not None:
        seed = int((payload.get("config") or {}).get("seed", 0))
        export_lora(
            payload[MODEL_KEY],
            info,
            folder,
            release.dtype,
            merge=not release.adapter,
            seed=seed,
            chat_template=template,
        )
        return tokenizer_with(resolve_model(info["base"]), template)
    source = resolve_model(name)
    tokenizer = tokenizer_with(source, template)
    head = spec((payload.get("config") or {}).get("method") or DEFAULT_METHOD).head
    export_model_folder(payload[MODEL_KEY], load_model_config(source), tokenizer, folder, release.dtype, head)
    return tokenizer


def model_card(
    release: Release, payload: dict[str, Any] | None, ggufs: list[str], command: list[str], log=print
) -> str:  # noqa: ANN001
    payload = payload or {}
    flags = payload.get("config") or {}
    index = read_chain_index(flags.get("hf_repo"), log=log) or record_from_checkpoint(payload, release.checkpoint.name)
    run_id, project = payload.get("wandb_run_id"), flags.get("wandb_project")
    wandb = f"`{project}/{run_id}` (project/run id)" if run_id and project else (f"`{run_id}`" if run_id else None)
    shown = ["fsdp-opt export"] + [a for a in command if a]
    return render_model_card(
        release.push_to_hub,
        index,
        flags=flags,
        method=str(flags.get("method") or "sft"),
        export_command=" ".join(shlex.quote(a) for a in shown),
        wandb=wandb,
        adapter=release.adapter,
        dtype=release.dtype,
        ggufs=ggufs,
        chat_template=payload.get("chat_template"),
    )
