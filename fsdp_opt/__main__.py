"""`python -m fsdp_opt` (and `torchrun ... -m fsdp_opt`): the training command of an installed package."""

from .cli import entry

entry()
