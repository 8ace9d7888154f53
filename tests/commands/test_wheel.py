"""The package as a Kaggle notebook gets it: a wheel built from the repo, installed on its own, run with `-m fsdp_opt`;
and in a fresh virtualenv outside the checkout, the demos from an empty folder."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import ROOT, built_once, sandbox_env


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built once for the module's tests (whichever worker runs them)."""
    (built,) = built_once(tmp_path_factory, "wheel", build_wheel).glob("fsdp_opt-*.whl")
    return built


def build_wheel(dest: Path) -> Path:
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                            str(dest), str(ROOT)], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert build.returncode == 0, build.stderr[-2000:]
    (wheel,) = dest.glob("fsdp_opt-*.whl")
    return wheel


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


def test_the_demos_run_from_a_wheel_in_a_fresh_virtualenv_in_an_empty_folder(tmp_path, wheel):
    """The routes docs/kaggle.md recommends install the package without the repository around it: the demo must launch
    the installed package's own training command, not a file beside it. A fresh virtualenv gets the wheel; the
    libraries come from the test environment's site-packages (a path, so its editable install of the checkout is not
    read). Each demo runs shortened (a few steps: it need not learn) from an empty folder, to its last line."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())  # fmt: skip
    (site / "libraries.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    install = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
                              str(wheel)], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert install.returncode == 0, install.stderr[-2000:]
    env = sandbox_env(tmp_path)
    env.pop("PYTHONPATH")  # nothing of the checkout
    env["PATH"] = f"{venv / 'bin'}:{env['PATH']}"
    where = subprocess.run([str(python), "-c", "import fsdp_opt; print(fsdp_opt.__file__)"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=120).stdout  # fmt: skip
    assert where.startswith(str(site)), where
    short = ["--end_idx", "16", "--num_epochs", "1", "--max_length", "64", "--warmup_steps", "1"]
    demos = {"plain": [], "chat": ["--chat"], "dpo": ["--dpo"]}
    for name in demos:
        (tmp_path / name).mkdir()

    def run(name: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(python), "-m", "fsdp_opt.demo", *demos[name], *short], cwd=tmp_path / name, env=env,
                              capture_output=True, text=True, timeout=600)  # fmt: skip

    with ThreadPoolExecutor(2) as pool:
        procs = dict(zip(demos, pool.map(run, demos)))
    for name, proc in procs.items():
        # 0 when it learned, 1 when these few steps did not: either way it ran to its last line
        assert proc.returncode in (0, 1), (name, proc.stdout[-2000:] + proc.stderr[-3000:])
        assert "Traceback" not in proc.stderr, (name, proc.stderr[-3000:])
        out = {"plain": "outputs/demo", "chat": "outputs/demo-chat", "dpo": "outputs/demo-dpo"}[name]
        assert f"demo: checkpoints and metrics.jsonl are in {out}/" in proc.stdout, (name, proc.stdout[-2000:])
        assert (tmp_path / name / out / "metrics.jsonl").is_file()
    assert "the trained model ended" in procs["chat"].stdout and "held-out accuracy" in procs["dpo"].stdout
