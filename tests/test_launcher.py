"""The tests' launcher (tests/launcher.py) against the real torchrun it stands in for: the same script, run both
ways, sees the same rank environment, prints the same lines, and ends with the same exit code; when one rank fails
the other is stopped (torchrun's rule) in both; a timeout ends the whole launch."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from conftest import launch

SCRIPT = """
import os, sys, time
rank = int(os.environ["RANK"])
# one write of the whole line: unbuffered (PYTHONUNBUFFERED), print() writes the text and its newline apart, and
# the two ranks' lines can interleave on the shared pipe (one line "rank 1 ...rank 0 ...", then two newlines)
sys.stdout.write(f"rank {rank} of {os.environ['WORLD_SIZE']}, local {os.environ['LOCAL_RANK']}, cwd {os.getcwd()}\\n")
sys.stdout.flush()
if sys.argv[1] == "fail":
    if rank == 1:
        print("rank 1 fails", file=sys.stderr, flush=True)
        sys.exit(3)
    time.sleep(120)  # the launcher must stop this rank
elif sys.argv[1] == "hang":
    open(f"pid{rank}", "w").write(str(os.getpid()))
    time.sleep(120)
"""


def _lines(text: str) -> list[str]:
    return sorted(l for l in text.splitlines() if l.startswith("rank "))


@pytest.mark.parametrize("mode", ["ok", "fail"])
def test_the_launcher_runs_a_script_as_torchrun_does(tmp_path, mode):
    script = tmp_path / "ranks.py"
    script.write_text(SCRIPT)
    got = {}
    for real in (False, True):
        started = time.monotonic()
        proc = launch([str(script)], [mode], tmp_path, nproc=2, timeout=300, real=real)
        got[real] = (proc, time.monotonic() - started)
    (forked, forked_s), (torchrun, torchrun_s) = got[False], got[True]
    assert "fast-launch" in forked.args and "torch.distributed.run" in " ".join(torchrun.args)
    want = [f"rank {r} of 2, local {r}, cwd {tmp_path}" for r in (0, 1)]
    if mode == "ok":
        assert forked.returncode == torchrun.returncode == 0
        assert _lines(forked.stdout) == _lines(torchrun.stdout) == want
    else:  # torchrun's exit code for a failed worker is 1, whatever the worker's own; the other rank is stopped
        assert forked.returncode == torchrun.returncode == 1
        assert "rank 1 fails" in forked.stderr and "rank 1 fails" in torchrun.stderr
        assert forked_s < 60 and torchrun_s < 90, (forked_s, torchrun_s)


def test_one_process_keeps_its_own_exit_code_and_a_timeout_ends_the_launch(tmp_path):
    script = tmp_path / "one.py"
    script.write_text("import sys\nprint('alone', flush=True)\nsys.exit(3)\n")
    proc = launch([str(script)], [], tmp_path, nproc=0)
    assert proc.returncode == 3 and proc.stdout == "alone\n"
    ranks = tmp_path / "ranks.py"
    ranks.write_text(SCRIPT)
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        launch([str(ranks)], ["hang"], tmp_path, nproc=2, timeout=5)
    assert time.monotonic() - started < 30
    time.sleep(0.5)
    for r in (0, 1):  # both ranks are gone (or dead, waiting to be reaped), not left running
        status = Path(f"/proc/{(tmp_path / f'pid{r}').read_text()}/status")
        assert not status.exists() or "\nState:\tZ" in status.read_text(), (r, status.read_text())
