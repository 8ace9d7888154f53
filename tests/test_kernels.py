"""What a training run learned holds under another CPU kernel: the suite's tests marked `learns` (tests/conftest.py's
LEARNS: a loss drop, an accuracy, a format, an answer) run once more, in a pytest session of their own started with
ATEN_CPU_CAPABILITY=default, the kernels every x86 CPU has (no vector units). The session's tests, its references
computed in process included, all run under that kernel, with an inductor cache of its own (kernels compiled for
another capability fail to build). It runs inside the suite, beside the other tests, so the suite's two workers stay
busy: one session for both kernels, not a second one after the first. Split by tier: the gate (`bash scripts/test.sh`) runs the cheap `learns` tests
under the default kernel, the long tier (`--all`) the rest (marker kernel_long: tests/conftest.py's LONG and
KERNEL_LONG)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from conftest import KERNEL_LONG, LEARNS, LONG, ROOT

KERNEL = "default"


def in_long(entry: str) -> bool:
    """Whether the entry's run under the default kernel is the long tier's (marker kernel_long)."""
    return entry.startswith(LONG + KERNEL_LONG)


@pytest.mark.parametrize("tier", ["gate", "long"])
def test_the_learned_behaviour_holds_under_the_default_kernel(tmp_path, wheel_venv, tier):
    entries = [entry for entry in LEARNS if in_long(entry) == (tier == "long")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.update(
        ATEN_CPU_CAPABILITY=KERNEL,
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"),
        # the demos' virtualenv this session built from the same checkout (tests/conftest.py: wheel_venv), so the
        # nested session builds none; its demos run their commands forked from its own launcher server, started
        # under this kernel (conftest.run_demo_forked): the suite's own run of each demo has launched it from the wheel
        FSDP_OPT_WHEEL_VENV=str(wheel_venv),
        FSDP_OPT_DEMO_FORKED="1",
        FSDP_OPT_REPORT_KERNEL="1",  # the session says which kernels it and its runs dispatched to (conftest.py)
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-rA",
            "-p",
            "no:cacheprovider",
            "-m",
            "learns and kernel_long" if tier == "long" else "learns and not kernel_long",
            "--basetemp",
            str(tmp_path / "base"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    # every entry of LEARNS ran and passed (a renamed test or a typo matches nothing), and nothing was skipped
    passed = re.findall(r"^PASSED (\S+)", proc.stdout, flags=re.M)
    assert entries and all(any(p.startswith(entry) for p in passed) for entry in entries), (entries, passed)
    assert not re.search(r"^(SKIPPED|XFAIL|XPASS)", proc.stdout, flags=re.M), proc.stdout[-3000:]
    # and they ran under the kernel set here: the session's process and the runs it forked
    assert f"kernels: session {KERNEL.upper()}, runs cpu capability: {KERNEL.upper()}" in proc.stdout, proc.stdout[
        -3000:
    ]
