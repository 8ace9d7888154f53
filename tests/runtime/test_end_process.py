"""`end_process`: how every command that torchrun launches ends. It skips the interpreter's teardown (where gloo's
threads can abort a finished rank), so what it must keep is the exit code and every line already printed."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from conftest import ROOT

CASES = {
    # main's body -> (exit code, text expected on stdout, on stderr)
    "print('written, not flushed', end=''); return 3": (3, "written, not flushed", ""),
    "return None": (0, "", ""),
    "fail('--end_idx: must be above --start_idx')": (2, "", "error: --end_idx: must be above --start_idx\n"),
    "sys.exit('stopped: a message')": (1, "", "stopped: a message\n"),
    "sys.stderr.write('partial line'); sys.exit(0)": (0, "", "partial line"),
    # torch's own exception and message, as a rank that ran out of GPU memory raised it (the first GPU run did)
    "import torch; raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 16.00 MiB. GPU 0 has a total "
    "capacity of 79.18 GiB of which 63.33 GiB is free. 14.56 GiB allowed; Of the allocated memory 14.46 GiB is "
    "allocated by PyTorch. If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF')": (
        1,
        "",
        "error: rank 0: out of GPU memory (CUDA out of memory. Tried to allocate 16.00 MiB. GPU 0 has a total "
        "capacity of 79.18 GiB of which 63.33 GiB is free. 14.56 GiB allowed). The run does not fit its GPUs: "
        "--batch_size auto picks a layout that fits (python -m fsdp_opt.plan with the same flags shows the peak), "
        "or train LoRA adapters (--lora_rank 16), on more GPUs, or with --cpu_offload\n",
    ),
    # a package this Python lacks (a lent GPU image had no datasets): one line naming it and the install
    "import sys; sys.modules['datasets'] = None; import datasets": (
        1,
        "",
        f"error: rank 0: the package 'datasets' is not installed in this Python ({sys.executable}): pip install "
        "-r requirements.txt installs what fsdp-opt needs\n",
    ),
}


@pytest.mark.parametrize("body", list(CASES))
def test_exit_code_and_output_survive(tmp_path, body):
    code, out, err = CASES[body]
    script = tmp_path / "command.py"
    script.write_text(
        textwrap.dedent(f"""
        import sys
        from fsdp_opt.runtime.exits import end_process, fail

        def main():
            {body}

        end_process(main)
        print("never reached")
    """)
    )
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stdout, proc.stderr) == (code, out, err)


@pytest.mark.parametrize("raised", ["RuntimeError('a bug')", "ModuleNotFoundError('gone', name='fsdp_opt.missing')"])
def test_an_unexpected_error_keeps_its_traceback(tmp_path, raised):
    """A bug, and a module of the package itself missing (an incomplete install of it, not a package to add)."""
    script = tmp_path / "command.py"
    script.write_text(
        f"from fsdp_opt.runtime.exits import end_process\ndef main():\n    raise {raised}\nend_process(main)\n"
    )
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr and raised.split("(")[0] in proc.stderr.splitlines()[-1]
