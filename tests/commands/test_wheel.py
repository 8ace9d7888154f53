"""The package as a Kaggle notebook gets it: a wheel built from the repo, installed on its own, run with `-m fsdp_opt`.
(The demos run from the same wheel in a fresh virtualenv outside the checkout, each from an empty folder, in the tests
of what they learn: tests/commands/test_cli.py, tests/train/test_chat_data.py, tests/train/test_dpo.py.)"""

from __future__ import annotations

import subprocess
import zipfile

from conftest import sandbox_env


def test_wheel_carries_the_package_and_its_command_runs_from_outside_the_repo(tmp_path, wheel, wheel_venv):
    """The wheel holds the package and its built-in model; installed alone in a fresh virtualenv (tests/conftest.py:
    wheel_venv, which checks that `fsdp_opt` imports from the wheel's copy), its command answers from an empty folder.
    (Training from that virtualenv: the demos' tests.)"""
    names = zipfile.ZipFile(wheel).namelist()
    assert "fsdp_opt/__main__.py" in names and any(n.startswith("fsdp_opt/assets/tiny-opt/") for n in names)
    assert not any(n.startswith(("tests/", "notebooks/", "benchmarks/")) for n in names)
    env = {k: v for k, v in sandbox_env(tmp_path).items() if k != "PYTHONPATH"}
    help_text = subprocess.run(
        [str(wheel_venv / "bin" / "python"), "-m", "fsdp_opt", "--help"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    assert "--sharding_strategy" in help_text and "--link_gbps" in help_text
