"""fsdp-opt: fine-tune Hugging Face causal LMs with PyTorch FSDP2, one resumable run across sessions."""

from __future__ import annotations

import logging as _logging
import os as _os

from fsdp_opt.base import VERSION as __version__  # noqa: F401 - the package's version, as `fsdp_opt.__version__`
from fsdp_opt.runtime.torchao_gate import gate_before_use

# transformers imports torchao (the NF4 tensor of --base_bits 4) whenever it is installed. torchao then reports the
# compiled kernels it has for other hardware failing to load, and torch warns about how it registers its enums: none
# of that is used here, so those two loggers only speak up for errors.
for _name in ("torchao", "torch.utils._pytree"):
    _logging.getLogger(_name).setLevel(_logging.ERROR)

# A torchao this torch or peft cannot use is hidden before transformers or peft look for it (only --base_bits 4 needs
# it, and that flag then stops in one line naming the install that fixes it). The check itself waits for the first
# import of one of them, so a command that needs neither stays light.
gate_before_use()

# `python -m fsdp_opt.plan`, `.evaluate`, `.export`, ... by the names the commands had before they moved into
# fsdp_opt/commands: a module the package does not hold itself is looked for there (fsdp_opt/cli.py routes
# `fsdp-opt <command>` to the same modules).
__path__.append(_os.path.join(_os.path.dirname(__file__), "commands"))
