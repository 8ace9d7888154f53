"""An installed torchao that does not suit (Kaggle's 0.10.0 beside torch 2.10; one built for a newer torch) never stops a
run that does not use --base_bits 4; --base_bits 4 then stops in one line naming the install for this torch.

The unsuitable torchao is a package of that name and version placed ahead of the installed one on PYTHONPATH: peft and
transformers find it exactly as they would find the real one (by `find_spec` and its dist-info version)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import assert_clean_failure, run_cli, sandbox_env

from fsdp_opt.runtime.torchao_gate import install_line, torchao_for, version_tuple

RUN = [
    "--model",
    "tiny-opt",
    "--dataset",
    "python-docs",
    "--end_idx",
    "16",
    "--max_length",
    "32",
    "--batch_size",
    "2",
    "--precision",
    "fp32",
    "--num_epochs",
    "1",
]


def fake_torchao(root: Path, version: str, body: str = "") -> Path:
    pkg = root / "torchao"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(f"__version__ = {version!r}\n{body}")
    (pkg / "quantization.py").write_text("")
    info = root / f"torchao-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torchao\nVersion: {version}\n")
    return root


def env_with(tmp: Path, shadow: Path) -> dict[str, str]:
    env = sandbox_env(tmp)
    env["PYTHONPATH"] = f"{shadow}:{env['PYTHONPATH']}"
    return env


def test_the_gate_waits_for_the_first_library_that_imports_torchao():
    """`import fsdp_opt` imports neither torch nor torchao: it puts the gate's finder first on sys.meta_path, and the
    first import of transformers (or peft, or torchao) runs the gate and takes the finder off."""
    probe = (
        "import sys, fsdp_opt\n"
        "from fsdp_opt.runtime.torchao_gate import GateOnFirstImport\n"
        "armed = lambda: any(isinstance(f, GateOnFirstImport) for f in sys.meta_path)\n"
        "print('torch' in sys.modules, 'torchao' in sys.modules, armed())\n"
        "import transformers\n"
        "print('torch' in sys.modules, armed())\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["False", "False", "True", "True", "False"], proc.stdout


def test_install_line_names_the_torchao_built_for_this_torch():
    # torchao 0.16.0 was built against torch 2.10 and is the oldest peft 0.19 accepts; 0.17/0.18 need torch >= 2.11.
    assert torchao_for("2.10.0+cu128") == "0.16.0"
    assert torchao_for("2.8.0") == "0.16.0"
    assert torchao_for("2.11.0") == "0.18.0" and torchao_for("2.13.0+cpu") == "0.18.0"
    assert install_line("2.10.0+cu128") == 'pip install -U "torchao==0.16.0"'
    assert version_tuple("0.16.0.dev20250101+cu128") == (0, 16, 0)


@pytest.mark.parametrize(
    "version,body,why",
    [
        ("0.10.0", "", "older than 0.16.0, the oldest peft accepts"),
        ("0.18.0", "from torch.nn.functional import NameFromANewerTorch\n", "does not import on torch"),
    ],
)
def test_an_unsuitable_torchao_does_not_stop_lora_and_4bit_names_the_fix(tmp_path, version, body, why):
    env = env_with(tmp_path, fake_torchao(tmp_path / "shadow", version, body))
    # Without the gate, this torchao stops peft's adapter injection (0.10.0) or the import itself (the too-new one).
    probe = "import peft.import_utils as u; u.is_torchao_available()" if version == "0.10.0" else "import torchao"
    direct = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    assert direct.returncode != 0 and (
        "incompatible version of torchao" in direct.stderr or "NameFromANewerTorch" in direct.stderr
    )

    lora = run_cli(RUN + ["--lora_rank", "4", "--output_dir", str(tmp_path / "lora")], tmp_path, env=env)
    assert lora.returncode == 0, lora.stdout + lora.stderr
    assert "Traceback" not in lora.stderr
    assert list((tmp_path / "lora").glob("*.pt"))
    assert f"torchao {version}" in lora.stdout and why in lora.stdout  # the one note at start

    four = run_cli(
        RUN + ["--lora_rank", "4", "--base_bits", "4", "--output_dir", str(tmp_path / "four")], tmp_path, env=env
    )
    line = assert_clean_failure(four, "--base_bits 4", why, install_line(torch.__version__))
    assert "torch" in line
    assert not (tmp_path / "four").exists() or not list((tmp_path / "four").glob("*.pt"))
