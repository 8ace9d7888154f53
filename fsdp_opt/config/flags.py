"""The parts command-line flags are built from: dataclass fields that carry their flag's help, the value parsers,
and an argument parser whose errors are one line (`ConfigError`), like every other user error.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import field
from typing import Any

from fsdp_opt.base import ConfigError


def flag(default: Any, help: str, **argparse_kwargs: Any) -> Any:
    """A config field whose flag is `--<field name>`, with this help (and any other `add_argument` keywords)."""
    return field(default=default, metadata={"help": help, **argparse_kwargs})


def tri_state(help: str) -> Any:
    """A flag of auto | true | false (default auto: the run decides); a bare `--flag` means true."""
    return flag("auto", help, type=str.lower, choices=["auto", "true", "false"], nargs="?", const="true")


def parse_bool(text: str | bool) -> bool:
    if isinstance(text, bool):
        return text
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def int_or_auto(what: str):  # noqa: ANN201
    """An argparse type: an integer, or 'auto' (the run decides)."""

    def parse(text: str | int) -> int | str:
        if isinstance(text, int) or text == "auto":
            return text
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what} or 'auto', got {text!r}") from None

    return parse


parse_start = int_or_auto("a row index")  # --start_idx
parse_batch = int_or_auto("a number of sequences")  # --batch_size


def parse_duration(text: str | None, name: str = "--time_limit") -> float | None:
    """'11h30m', '90m', '45s', '2h' or plain seconds -> seconds."""
    if text is None or text == "":
        return None
    m = re.fullmatch(r"\s*(?:(\d+(?:\.\d+)?)h)?\s*(?:(\d+(?:\.\d+)?)m)?\s*(?:(\d+(?:\.\d+)?)s?)?\s*", text)
    if not m or not any(m.groups()):
        raise ConfigError(f"{name} {text!r}: use a duration such as 11h30m, 90m or 3600")
    h, mnt, s = (float(g) if g else 0.0 for g in m.groups())
    return h * 3600 + mnt * 60 + s


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        # NOTE: one line instead of argparse's usage dump, like every other user error.
        raise ConfigError(message)
