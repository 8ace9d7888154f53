"""The registry of methods: each one's spec (its own flags class inside), by --method name. One line a method."""

from __future__ import annotations

from fsdp_opt.config.methods.base import (
    CAUSAL_LM,
    GENERATION,
    GENERATOR,
    LOSS,
    MACHINE,
    REFERENCE_BESIDE,
    REFERENCE_PASS,
    REWARDS,
    SECOND_FORWARD,
    SEQUENCE_SCORE,
    TEACHER,
    MethodSpec,
    drift_of,
)
from fsdp_opt.config.methods.distill import DISTILL
from fsdp_opt.config.methods.dpo import DPO
from fsdp_opt.config.methods.grpo import GRPO
from fsdp_opt.config.methods.kto import KTO
from fsdp_opt.config.methods.reward import REWARD
from fsdp_opt.config.methods.rloo import RLOO
from fsdp_opt.config.methods.sft import SFT

METHOD_SPECS: dict[str, MethodSpec] = {s.name: s for s in (SFT, DPO, KTO, GRPO, RLOO, DISTILL, REWARD)}
METHODS = tuple(METHOD_SPECS)
DEFAULT_METHOD = METHODS[0]


def spec(method: str) -> MethodSpec:
    return METHOD_SPECS[method]


def method_flags() -> dict[str, str | None]:
    """Every method's own flags and their drift class (a flag several methods have: one class)."""
    return {name: drift_of(f) for s in METHOD_SPECS.values() for name, f in s.own_flags().items()}


def owners(flag: str) -> list[str]:
    """The methods that take a flag."""
    return [m for m, s in METHOD_SPECS.items() if flag in s.own_flags()]


__all__ = [
    "CAUSAL_LM",
    "DEFAULT_METHOD",
    "GENERATION",
    "GENERATOR",
    "LOSS",
    "MACHINE",
    "METHODS",
    "METHOD_SPECS",
    "REFERENCE_BESIDE",
    "REFERENCE_PASS",
    "REWARDS",
    "SECOND_FORWARD",
    "SEQUENCE_SCORE",
    "TEACHER",
    "MethodSpec",
    "method_flags",
    "owners",
    "spec",
]
