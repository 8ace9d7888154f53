"""Errors a user can cause. The entry points print them as one line and exit 2.
"""

from __future__ import annotations

import contextlib
import logging
import re
from typing import Iterator


class ConfigError(Exception):
    """A flag, file or input the user supplied is unusable. The message names it and says what to do."""


class DataError(ConfigError):
    """The dataset or the requested row range is unusable."""


class ModelError(ConfigError):
    """The model cannot be found, fetched or sharded."""


class CheckpointError(ConfigError):
    """A checkpoint file is missing, damaged or does not belong to this run."""


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

GIB = 2**30


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
