"""Errors a user can cause. The entry points print them as one line and exit 2."""

from __future__ import annotations


class ConfigError(Exception):
    """A flag, file or input the user supplied is unusable. The message names it and says what to do."""


class DataError(ConfigError):
    """The dataset or the requested row range is unusable."""


class ModelError(ConfigError):
    """The model cannot be found, fetched or sharded."""


class CheckpointError(ConfigError):
    """A checkpoint file is missing, damaged or does not belong to this run."""
