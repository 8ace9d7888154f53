"""What a training run learned holds under another CPU kernel: the suite's tests marked `learns` (tests/conftest.py's
LEARNS: a loss drop, an accuracy, a format, an answer) run once more, in a pytest session of their own started with
ATEN_CPU_CAPABILITY=default, the kernels every x86 CPU has (no vector units). The session's tests, its references
computed in process included, all run under that kernel, with an inductor cache of its own (kernels compiled for
another capability fail to build). It runs inside the suite, beside the other tests, so the suite's two workers stay
busy: one session for both kernels, not a second one after the first."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from conftest import LEARNS, ROOT

KERNEL = "default"


def test_the_learned_behaviour_holds_under_the_default_kernel(request, tmp_path, wheel_venv):
    ids = [item.nodeid for item in request.session.items]
    expected = sum(1 for item in request.session.items if item.get_closest_marker("learns"))
    if not all(any(i.startswith(entry) for i in ids) for entry in LEARNS):
        # this session was narrowed (a file, -k): count the learned-behaviour tests of the whole suite
        listed = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-m", "learns", "-p",
                                 "no:cacheprovider"], cwd=ROOT, capture_output=True, text=True, timeout=300)  # fmt: skip
        expected = int(re.search(r"(\d+)/\d+ tests collected", listed.stdout).group(1))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.update(
        ATEN_CPU_CAPABILITY=KERNEL,
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"),
        # the demos' virtualenv this session built from the same checkout (tests/conftest.py: wheel_venv)
        FSDP_OPT_WHEEL_VENV=str(wheel_venv),
    )
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "learns", "--basetemp",
         str(tmp_path / "base")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600,
    )  # fmt: skip
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    # every one of them ran and passed: none skipped, none deselected by a typo in LEARNS
    assert re.search(rf"\b{expected} passed\b", summary) and "skipped" not in summary, summary
