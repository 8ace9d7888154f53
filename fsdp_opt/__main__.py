"""`python -m fsdp_opt` (and `torchrun ... -m fsdp_opt`): the training command of an installed package."""

from __future__ import annotations

from fsdp_opt.cli import entry

entry()
