"""The bottom layer, which every module may import: the errors a user can cause (the entry points print them as
one line and exit 2), sizes and their parsing, GiB formatting, and the one-line forms of exceptions and specs."""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

VERSION = "0.6.0"  # the package's version: pyproject.toml reads it; checkpoints and model cards record it; CHANGELOG.md

GIB = 2**30
MIB = 2**20


class ConfigError(Exception):
    """A flag, file or input the user supplied is unusable. The message names it and says what to do."""


class DataError(ConfigError):
    """The dataset or the requested row range is unusable."""


class ModelError(ConfigError):
    """The model cannot be found, fetched or sharded."""


class RewardError(ConfigError):
    """A reward function failed on a completion (raised, or gave no number): the session saves its last whole step
    before it ends."""


class CheckpointError(ConfigError):
    """A checkpoint file is missing, damaged or does not belong to this run."""


# The training command's exit codes: 0 done; 1 out of GPU memory, a package missing, or a bug (with its traceback);
# 2 a user error (one line); 3 the session trained and saved, but its newest checkpoint did not reach the Hub repo;
# 130 interrupted.
EXIT_NOT_PUSHED = 3


class NotPushedError(Exception):
    """The session's newest checkpoint is not on the Hub after --hub_wait (it is kept locally): exit EXIT_NOT_PUSHED."""


def parse_size(text: str | int | float, flag: str) -> int:
    """'15GiB', '20GB', '31G', '512MiB' or a byte count -> bytes (GB = 1e9, GiB = 2**30; bare G means GiB)."""
    if isinstance(text, (int, float)):
        return int(text)
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)(b?)\s*", text.lower())
    if not m:
        raise ConfigError(f"{flag} {text!r}: use a size such as 15GiB, 20GB or 512MiB")
    value, unit, binary, b = m.groups()
    power = "_kmgt".index(unit) if unit else 0
    base = 1024 if (binary or (unit and not b)) else 1000
    return int(float(value) * base**power)


def gib(n: float | None, unit: bool = True) -> str:
    """Bytes as GiB with two decimals ('-' for None); `unit=False` leaves off the ' GiB'."""
    if n is None:
        return "-"
    return f"{n / GIB:,.2f}" + (" GiB" if unit else "")


def size_text(n: float) -> str:
    """Bytes as GiB from 1 GiB up, MiB below."""
    return gib(n) if n >= GIB else f"{n / MIB:.1f} MiB"


def first_line(exc: BaseException) -> str:
    """An exception as one short line: its message's first line (at most 200 characters), or its type's name."""
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:200]


def looks_like_path(spec: str, suffixes: tuple[str, ...] = ()) -> bool:
    """Does a --model or --dataset value name a local path rather than a Hub id? Hub ids are `name` or
    `owner/name`; anything starting like a path, with more than one slash, a backslash, one of `suffixes`, or that
    exists here is a path."""
    return (
        spec.startswith((".", "/", "~"))
        or spec.count("/") > 1
        or "\\" in spec
        or Path(spec).suffix.lower() in suffixes
        or Path(spec).exists()
    )


@contextlib.contextmanager
def quiet_hub_logs() -> Iterator[None]:
    """Hide the Hub client's per-retry warnings: a failure ends in one error line of ours instead."""
    loggers = [logging.getLogger(n) for n in ("huggingface_hub", "transformers", "datasets")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def in_words(items: list[str], last: str = "or") -> str:
    """'a', 'a or b', 'a, b or c'."""
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} {last} {items[-1]}"


def picked(source: object, *names: str) -> dict[str, Any]:
    """`source`'s attributes `names` by name: settings handed on under the names they already have."""
    return {name: getattr(source, name) for name in names}
