"""The training methods behind --method, one object each (base.py says what such an object answers), by name: the
registry. The run and the step call the object; nothing outside this package and config/specs.py names a method."""

from __future__ import annotations

from fsdp_opt.config.parse import Config
from fsdp_opt.config.specs import METHOD_SPECS
from fsdp_opt.train.methods.base import Method
from fsdp_opt.train.methods.distill import Distill
from fsdp_opt.train.methods.dpo import Dpo
from fsdp_opt.train.methods.grpo import Grpo
from fsdp_opt.train.methods.kto import Kto
from fsdp_opt.train.methods.sft import Sft

REGISTRY: dict[str, type[Method]] = {"sft": Sft, "dpo": Dpo, "grpo": Grpo, "kto": Kto, "distill": Distill}
assert set(REGISTRY) <= set(METHOD_SPECS)


def method_for(config: Config) -> Method:
    """The method object of a run (or of an evaluation: a Config with its method section)."""
    return REGISTRY[config.method.method](config)
