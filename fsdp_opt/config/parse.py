"""The whole configuration (`Config`: one section per concern), the command line generated from the sections'
fields, and parsing into a validated Config."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from fsdp_opt.base import VERSION, ConfigError
from fsdp_opt.config.benchmarks import BenchmarkConfig
from fsdp_opt.config.choices import AUTO
from fsdp_opt.config.flags import OneLineParser, parse_bool
from fsdp_opt.config.layout import LoraConfig, ParallelConfig
from fsdp_opt.config.method import MethodConfig, add_method_flags
from fsdp_opt.config.methods import METHOD_SPECS, spec
from fsdp_opt.config.methods.sft import SFT
from fsdp_opt.config.storage import CheckpointConfig, HubConfig, WandbConfig
from fsdp_opt.config.training import DataConfig, ModelConfig, TrainConfig

SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "method": MethodConfig,
    "lora": LoraConfig,
    "parallel": ParallelConfig,
    "checkpoint": CheckpointConfig,
    "hub": HubConfig,
    "wandb": WandbConfig,
    "benchmark": BenchmarkConfig,
}


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    method: MethodConfig = field(default_factory=MethodConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    hub: HubConfig = field(default_factory=HubConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    benchmark: BenchmarkConfig = field(default_factory=BenchmarkConfig)

    def flat(self) -> dict[str, Any]:
        """Every flag and its value: what is printed and stored in checkpoints."""
        out: dict[str, Any] = {}
        for section in SECTIONS:
            value = getattr(self, section)
            out.update(value.flat() if isinstance(value, MethodConfig) else dataclasses.asdict(value))
        return out

    @classmethod
    def from_flat(cls, values: dict[str, Any], strict: bool = True) -> Config:
        """The flags as values (the command line's, or a checkpoint's stored ones: `strict` False drops another
        method's flags there instead of refusing them)."""
        sections = {}
        for name, section_cls in SECTIONS.items():
            if section_cls is MethodConfig:
                sections[name] = MethodConfig.from_flags(values.get("method"), values, strict)
                continue
            names = {f.name for f in dataclasses.fields(section_cls)}
            sections[name] = section_cls(**{k: v for k, v in values.items() if k in names})
        return cls(**sections)


def _field_type(f: dataclasses.Field) -> Any:
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    if "bool" in kind:
        return parse_bool
    if "int" in kind:
        return int
    if "float" in kind:
        return float
    return str


KEEP = object()  # add_flag: the field's own default or help


def add_flag(parser: Any, f: dataclasses.Field, *, default: Any = KEEP, help: Any = KEEP) -> None:  # noqa: A002
    """The training command's flag of config field `f` on `parser` (or a group): its type, choices and other
    keywords as the field declares them; another command that takes the same flag (plan, evaluate) may give its own
    default and help, never another type or other choices."""
    meta = dict(f.metadata)
    own_help = meta.pop("help")
    meta.pop("drift", None)  # a method flag's drift class (config/methods/base.py), not argparse's
    aliases = meta.pop("aliases", ())
    kind = meta.pop("type", None) or _field_type(f)
    kwargs: dict[str, Any] = {
        "default": f.default if default is KEEP else default,
        "help": own_help if help is KEEP else help,
        "type": kind,
    }
    if kind is parse_bool:
        kwargs.update(nargs="?", const=True, metavar="BOOL")
    kwargs.update(meta)
    parser.add_argument(f"--{f.name}", *aliases, dest=f.name, **kwargs)


def config_field(section_cls: type, name: str) -> dataclasses.Field:
    return next(f for f in dataclasses.fields(section_cls) if f.name == name)


def build_parser(prog: str = "fsdp_finetune.py", description: str | None = None) -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog=prog,
        description=description,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,
    )
    for section, section_cls in SECTIONS.items():
        group = parser.add_argument_group(section)
        if section_cls is MethodConfig:
            add_method_flags(group, add_flag)
            continue
        for f in dataclasses.fields(section_cls):
            add_flag(group, f)
    parser.add_argument("--version", action="version", version=f"fsdp-opt {VERSION}", help="print the version and exit")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> Config:
    namespace = build_parser().parse_args(argv)
    config = Config.from_flat(vars(namespace))
    check_chain_flags(config)
    check_method_flags(config)
    check_auto_flags(config)
    return config


def check_auto_flags(config: Config) -> None:
    """--batch_size auto and --reduce_dtype auto against the flags they decide."""
    if config.train.batch_size == AUTO:
        if config.parallel.cpu_offload:
            raise ConfigError(
                "--cpu_offload: not with --batch_size auto (it turns offload on where nothing fits "
                "without it; give --batch_size N to set it yourself)"
            )
    elif config.parallel.reduce_dtype == AUTO:
        raise ConfigError("--reduce_dtype auto: only with --batch_size auto (give fp32 or fp16)")


def check_method_flags(config: Config) -> None:
    """--method against the data flags, as typed (the format found from the columns is checked with the data)."""
    dc, name, t = config.data, config.method.method, config.method.spec
    if dc.data_format != "auto" and dc.data_format not in t.rows:
        owner = next(
            (m for m, other in METHOD_SPECS.items() if dc.data_format in other.rows and other.rows != SFT.rows), None
        )
        if owner is not None and t.rows == SFT.rows:
            raise ConfigError(
                f"--data_format {dc.data_format}: {spec(owner).what.split(' (')[0]} train with --method {owner}"
            )
        raise ConfigError(f"--method {name}: trains on {t.what}, not --data_format {dc.data_format}")
    if t.answers_only and dc.train_on == "all":
        raise ConfigError(f"--train_on all: not with --method {name} (its loss reads the answers' tokens only)")
    if not t.concat and dc.packing == "concat":
        raise ConfigError(
            f"--packing concat: not with --method {name} (each sequence must stay one document; use docs or pad)"
        )
    if t.generates and config.method.settings.max_completion_length >= dc.max_length:
        raise ConfigError(
            f"--max_completion_length {config.method.settings.max_completion_length}: must be below --max_length "
            f"{dc.max_length} (a prompt and its completion share a sequence)"
        )


def check_chain_flags(config: Config) -> None:
    """The flags of --start_idx auto against the rest, as typed (a chain's resolved config has both kinds)."""
    dc = config.data
    if dc.start_idx != AUTO:
        if dc.range_size is not None:
            raise ConfigError(f"--range_size {dc.range_size}: only with --start_idx auto")
        if dc.session_ranges != 1:
            raise ConfigError(f"--session_ranges {dc.session_ranges}: only with --start_idx auto")
        return
    if config.checkpoint.overwrite:
        raise ConfigError(
            "--overwrite: not with --start_idx auto (it trains the range after the chain's newest checkpoint, never "
            "one the chain has); to train a range again, name it: --start_idx S --end_idx E --overwrite"
        )
    if config.checkpoint.resume_file not in (None, "latest"):
        raise ConfigError(
            f"--resume_file {config.checkpoint.resume_file}: not with --start_idx auto (it resumes "
            "from the newest checkpoint in --output_dir and --hf_repo)"
        )
    if config.train.initial_epoch != 0:
        raise ConfigError(
            f"--initial_epoch {config.train.initial_epoch}: not with --start_idx auto (the chain "
            "counts its passes from the checkpoints' names)"
        )
