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

    def run(*args: str) -> str:
        done = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout

    # the commands, then the training command's flags: by the module, and by the installed `fsdp-opt` script
    commands = run(str(wheel_venv / "bin" / "python"), "-m", "fsdp_opt", "--help")
    assert all(f"fsdp-opt {verb}" in commands for verb in ("train", "plan", "evaluate", "export", "demo", "check"))
    assert (
        "fsdp-opt = fsdp_opt.cli:entry"
        in zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    )
    (script,) = wheel_venv.parent.glob("venv/lib/python*/site-packages/bin/fsdp-opt")  # pip --target puts it there
    for flags in (
        run(str(wheel_venv / "bin" / "python"), "-m", "fsdp_opt", "train", "--help"),
        run(str(wheel_venv / "bin" / "python"), str(script), "train", "--help"),
    ):
        assert "--sharding_strategy" in flags and "--link_gbps" in flags
