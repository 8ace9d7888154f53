"""The package as a Kaggle notebook gets it: a wheel built from the repo, installed on its own, run with `-m fsdp_opt`.
(The demos run from the same wheel in a fresh virtualenv outside the checkout, each from an empty folder, in the tests
of what they learn: tests/commands/test_cli.py, tests/train/test_chat_data.py, tests/train/test_dpo.py.)"""

from __future__ import annotations

import subprocess
import sys
import zipfile

from conftest import sandbox_env


def test_wheel_carries_the_package_and_trains_from_outside_the_repo(tmp_path, wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert "fsdp_opt/__main__.py" in names and any(n.startswith("fsdp_opt/assets/tiny-opt/") for n in names)
    site = tmp_path / "site"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                             capture_output=True, text=True, timeout=300)  # fmt: skip
    assert install.returncode == 0, install.stderr[-2000:]
    env = {**sandbox_env(tmp_path), "PYTHONPATH": str(site)}  # the wheel's copy, not the checkout
    run = tmp_path / "run"
    run.mkdir()
    cmd = [sys.executable, "-m", "fsdp_opt", "--model", "tiny-opt", "--dataset", "python-docs", "--end_idx", "16",
           "--max_length", "32", "--batch_size", "4", "--output_dir", str(run / "out")]  # fmt: skip
    proc = subprocess.run(cmd, cwd=run, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-1500:] + proc.stderr[-2000:]
    assert (run / "out" / "tiny_opt_0-16-epoch-1.pt").exists()
    where = subprocess.run([sys.executable, "-c", "import fsdp_opt; print(fsdp_opt.__file__)"], cwd=run, env=env,
                           capture_output=True, text=True, timeout=120).stdout  # fmt: skip
    assert where.startswith(str(site)), where
    help_text = subprocess.run([sys.executable, "-m", "fsdp_opt", "--help"], cwd=run, env=env, capture_output=True,
                               text=True, timeout=120).stdout  # fmt: skip
    assert "--sharding_strategy" in help_text and "--link_gbps" in help_text
