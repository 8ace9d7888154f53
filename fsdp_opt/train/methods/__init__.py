"""The run's definition of each --method (base.py says what one is). A method's definition is the module of its name
here, holding one `Method` subclass for its spec: the registry is config/methods/ alone (one line a method), and no
other module of the run names a method."""

from __future__ import annotations

import importlib
import inspect
from functools import cache

from fsdp_opt.config.method import MethodConfig
from fsdp_opt.train.methods.base import Method


@cache
def definition(name: str) -> type[Method]:
    """The Method subclass of --method `name` (its module, train/methods/<name>.py)."""
    module = importlib.import_module(f"{__name__}.{name}")
    return next(
        c
        for _, c in inspect.getmembers(module, inspect.isclass)
        if issubclass(c, Method) and getattr(c, "spec", None) is not None and c.spec.name == name
    )


def method_for(config: MethodConfig) -> Method:
    """The method of a run (or of an evaluation): its definition with the run's settings."""
    return definition(config.method)(config.settings)


__all__ = ["Method", "definition", "method_for"]
