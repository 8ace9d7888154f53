"""--method and its own flags: the run's method by name and its settings, an instance of the flags class its spec
names (config/methods/). The command line takes the union of every method's flags, each declared once with the
meaning each method gives it; a flag the run's method does not take is refused in one line naming the methods that
do (the trainer, plan and evaluate alike: `MethodConfig.from_flags`)."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from fsdp_opt.base import ConfigError, in_words
from fsdp_opt.config.flags import flag
from fsdp_opt.config.methods import DEFAULT_METHOD, METHOD_SPECS, METHODS, owners, spec
from fsdp_opt.config.methods.base import Flags, MethodSpec


@dataclass
class MethodConfig:
    """The run's method and its settings (its flags class, filled from the flags given and the class's defaults)."""

    method: str = flag(
        DEFAULT_METHOD,
        "What a step trains. " + " ".join(s.summary for s in METHOD_SPECS.values()),
        choices=METHODS,
    )
    settings: Flags = field(default=None)  # type: ignore[assignment] - made from the spec when not given

    def __post_init__(self) -> None:
        if self.method not in METHOD_SPECS:
            raise ConfigError(f"--method {self.method}: one of {', '.join(METHODS)}")
        if self.settings is None:
            self.settings = self.spec.flags()

    @classmethod
    def from_flags(cls, method: str | None, values: dict[str, Any], strict: bool = True) -> MethodConfig:
        """The method's settings from flag values (None: not given, the method's default). `strict`: a value given
        for another method's flag is refused in one line (the command line); else it is dropped (a checkpoint's
        stored flags, written when every method's flags were one class)."""
        method = method or DEFAULT_METHOD
        if method not in METHOD_SPECS:
            raise ConfigError(f"--method {method}: one of {', '.join(METHODS)}")
        own = spec(method).own_flags()
        if strict:
            refuse_foreign(method, values)
        given = {k: v for k, v in values.items() if k in own and v is not None}
        return cls(method, spec(method).flags(**given))

    @property
    def spec(self) -> MethodSpec:
        return spec(self.method)

    def flat(self) -> dict[str, Any]:
        """--method and its own flags with their values: what is printed, stored and compared along the chain."""
        return {"method": self.method, **dataclasses.asdict(self.settings)}

    @property
    def uses_reference(self) -> bool:
        return self.settings.uses_reference

    @property
    def completions_per_prompt(self) -> int:
        return self.settings.completions_per_prompt


def refuse_foreign(method: str, values: dict[str, Any]) -> None:
    """A value given (not None) for a method flag that `method` does not take: one line naming the methods that do."""
    own = spec(method).own_flags()
    for name in union_flags():
        if name not in own and values.get(name) is not None:
            raise ConfigError(f"--{name}: only with --method {in_words(owners(name))}")


def union_flags() -> dict[str, list[tuple[str, dataclasses.Field]]]:
    """Every method flag by name, with the methods that take it and each one's field, in the registry's order."""
    out: dict[str, list[tuple[str, dataclasses.Field]]] = {}
    for name, s in METHOD_SPECS.items():
        for flag_name, f in s.own_flags().items():
            out.setdefault(flag_name, []).append((name, f))
    return out


def union_field(name: str) -> dataclasses.Field:
    """One flag of the union as a field: the first method's type, the choices of all (each method checks its own)."""
    taken = union_flags()[name]
    first = taken[0][1]
    choices = [c for _, f in taken for c in f.metadata.get("choices", ())]
    meta = {k: v for k, v in first.metadata.items() if k != "drift"}
    if choices:
        meta["choices"] = tuple(dict.fromkeys(choices))
    meta["help"] = union_help(taken)
    made = field(default=None, metadata=meta)
    made.name, made.type = name, first.type
    return made


def method_field(name: str) -> dataclasses.Field:
    """--method, or one flag of the methods' union, as a field another command declares its flag from (plan,
    evaluate): the trainer's type and choices."""
    if name == "method":
        return next(f for f in dataclasses.fields(MethodConfig) if f.name == "method")
    return union_field(name)


def union_help(taken: list[tuple[str, dataclasses.Field]]) -> str:
    """Each method's meaning of a flag, with its default: one sentence for the methods that share both."""
    by_text: dict[tuple[str, Any], list[str]] = {}
    for method, f in taken:
        by_text.setdefault((f.metadata["help"], f.default), []).append(method)
    several = len({default for _, default in by_text}) > 1  # then each method's sentence says its default
    return " ".join(
        f"--method {in_words(methods, 'and')}: {text[0].lower()}{text[1:]}"
        if not several
        else f"--method {in_words(methods, 'and')}: {text[0].lower()}{text[1:].rstrip('.')}{with_default(default)}."
        for (text, default), methods in by_text.items()
    )


def with_default(value: Any) -> str:  # noqa: ANN401
    """' (default: X).' for a sentence that differs by method in its default alone."""
    shown = "none" if value is None else str(value).lower() if isinstance(value, bool) else value
    return f" (default: {shown})"


def add_method_flags(parser: argparse.ArgumentParser | Any, add_flag) -> None:  # noqa: ANN001
    """--method and the union of the methods' flags on `parser` (`add_flag`: config/parse.py's), each not given by
    default (then the run's method takes its own default)."""
    add_flag(parser, method_field("method"))
    for name in union_flags():
        add_flag(parser, union_field(name), default=argparse.SUPPRESS)
