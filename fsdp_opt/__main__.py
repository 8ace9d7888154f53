"""`python -m fsdp_opt <command>` (and `torchrun ... -m fsdp_opt`): the `fsdp-opt` command of an installed package;
with no command, training."""

from __future__ import annotations

from fsdp_opt.cli import entry

entry()
