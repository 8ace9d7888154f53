"""Whether the installed torchao can be used, decided once at package import, before transformers or peft load.

torchao is only needed for `--base_bits 4` (the NF4 base), but transformers imports it whenever it is installed and
peft raises at adapter injection when it is older than it accepts. A torchao that does not suit the installed torch
(Kaggle's image ships torchao 0.10.0 beside torch 2.10; a torchao built for a newer torch fails to import on an older
one) would then stop every run, full fine-tuning and LoRA alike. Such a torchao is hidden from this process
(`sys.modules["torchao"] = None`, which makes `importlib.util.find_spec` answer None for transformers and peft) and
only `--base_bits 4` refuses to start, naming the `pip install` line that fixes it.

`import fsdp_opt` only arms the gate (`gate_before_use`): it runs just before the first import of transformers, peft
or torchao in the process, so a command that needs none of them (the demo's parent, `--help`) does not pay for
importing torch and torchao (about 4 s of CPU).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.metadata
import importlib.util
import re
import sys
import threading
import warnings

from fsdp_opt.base import ConfigError

# The oldest torchao peft accepts (peft 0.19: "only versions above 0.16.0 are supported", 0.16.0 included).
TORCHAO_MIN = (0, 16, 0)

# The torchao to install for a torch release (major, minor): each torchao release is built against one torch. 0.16.0
# was built for torch 2.10 and is also the oldest peft accepts, so it is the answer for 2.10 and older (scripts/
# rehearse.sh ran the 4-bit base with it on torch 2.10 and 2.8); 0.17 and 0.18 ask for torch >= 2.11, and 0.18 does not
# import on torch 2.8.
TORCHAO_FOR_TORCH: tuple[tuple[tuple[int, int], str], ...] = (((2, 11), "0.18.0"), ((0, 0), "0.16.0"))

hidden_reason: str | None = None  # why an installed torchao was hidden, if it was

# The libraries that import torchao (transformers when a model class loads, peft at import), and torchao itself.
USERS = ("transformers", "peft", "torchao")


def version_tuple(text: str) -> tuple[int, ...]:
    """'2.10.0+cu128' -> (2, 10, 0); '0.16.0.dev20250101' -> (0, 16, 0)."""
    return tuple(int(x) for x in re.findall(r"\d+", text.split("+")[0])[:3])


def torchao_for(torch_version: str) -> str:
    """The torchao release to install beside this torch."""
    ours = version_tuple(torch_version)[:2]
    return next(ao for floor, ao in TORCHAO_FOR_TORCH if ours >= floor)


def install_line(torch_version: str) -> str:
    return f'pip install -U "torchao=={torchao_for(torch_version)}"'


def installed_torchao() -> str | None:
    try:
        return importlib.metadata.version("torchao")
    except importlib.metadata.PackageNotFoundError:
        return None


def unusable_reason(version: str, torch_version: str) -> str | None:
    """Why this torchao cannot be used here, or None. Imports it (transformers would anyway)."""
    if version_tuple(version) < TORCHAO_MIN:
        return f"torchao {version} is older than {'.'.join(map(str, TORCHAO_MIN))}, the oldest peft accepts"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            importlib.import_module("torchao")
            importlib.import_module("torchao.quantization")  # what transformers imports
    except Exception as exc:  # noqa: BLE001 - any failure to import means it cannot be used
        line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        line = re.sub(r"\s*\(/[^)]*\)", "", line)  # the file torch's module was read from: long, and no help
        return f"torchao {version} does not import on torch {torch_version} ({line})"
    return None


def hide_torchao(reason: str) -> None:
    global hidden_reason
    for name in [m for m in sys.modules if m == "torchao" or m.startswith("torchao.")]:
        del sys.modules[name]
    sys.modules["torchao"] = None  # type: ignore[assignment]
    hidden_reason = reason


def torch_version() -> str:
    """The running torch's version ('2.13.0+cpu'); imports torch, which the gate's callers import next anyway."""
    return importlib.import_module("torch").__version__


def gate() -> str | None:
    """Hide an installed torchao this process cannot use; returns why, or None."""
    version = installed_torchao()
    if version is None or "torchao" in sys.modules and sys.modules["torchao"] is None:
        return hidden_reason
    if importlib.util.find_spec("torchao") is None:
        return None
    reason = unusable_reason(version, torch_version())
    if reason:
        hide_torchao(reason)
    return reason


class GateOnFirstImport(importlib.abc.MetaPathFinder):
    """A finder placed first on sys.meta_path: at the first import of one of USERS it takes itself off, runs the gate,
    and lets the import go on through the usual finders (it never finds a module itself)."""

    lock = threading.Lock()

    def find_spec(self, name, path=None, target=None):  # noqa: ANN001, ANN201 - importlib's signature
        if name.partition(".")[0] in USERS:
            with self.lock:
                if self in sys.meta_path:
                    sys.meta_path.remove(self)
                    gate()
        return None


def gate_before_use() -> None:
    """Run the gate now if one of USERS is imported already, else just before the first import of one (`import
    fsdp_opt` calls this)."""
    if any(name in sys.modules for name in USERS):
        gate()
    elif not any(isinstance(f, GateOnFirstImport) for f in sys.meta_path):
        sys.meta_path.insert(0, GateOnFirstImport())


def check_for_nf4(flag: str = "--base_bits 4") -> None:
    """Raise a ConfigError naming the install line when torchao cannot give an NF4 base."""
    version = torch_version()
    line = install_line(version)
    if hidden_reason is not None:
        raise ConfigError(f"{flag}: {hidden_reason}; install the one for torch {version.split('+')[0]}: {line}")
    if installed_torchao() is None:
        raise ConfigError(f"{flag}: needs torchao, not installed; for torch {version.split('+')[0]}: {line}")
