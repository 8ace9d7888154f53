"""The host allocator's setting: where a block of a training step's size comes from, per device."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT, sandbox_env

# In a fresh process: set the threshold as a run on each device does, allocate a block with the C library's own
# malloc, and say whether it lies in the brk heap or in a mapping of its own (Linux: /proc/self/maps). Then the
# same call with a MALLOC_MMAP_THRESHOLD_ of the user's in the environment.
WHERE = """
import ctypes, json, os
from fsdp_opt.runtime.hostmem import _libc, configure_allocator
libc = _libc()
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
def where(mib):
    p = libc.malloc(mib << 20)
    heap = [line.split()[0] for line in open("/proc/self/maps") if line.rstrip().endswith("[heap]")]
    return "heap" if any(int(lo, 16) <= p < int(hi, 16) for lo, hi in (h.split("-") for h in heap)) else "mapped"
out = {}
for device, mib in (("cuda", 4), ("cpu", 4), ("cpu", 64)):
    assert configure_allocator(cpu_device=device == "cpu")
    out[f"{device} {mib} MiB"] = where(mib)
os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"
out["set by the user"] = configure_allocator(cpu_device=True)
print(json.dumps(out))
"""


def test_a_cpu_device_serves_step_sized_blocks_from_the_heap(tmp_path):
    env = sandbox_env(tmp_path)
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    proc = subprocess.run([sys.executable, "-c", WHERE], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout) == {
        "cuda 4 MiB": "mapped",  # a GPU run's host blocks are checkpoint-sized: each given back when freed
        "cpu 4 MiB": "heap",  # a CPU step's activations and gradients: reused from the heap, step after step
        "cpu 64 MiB": "mapped",  # above glibc's largest threshold: a mapping of its own on any device
        "set by the user": False,  # the user's threshold wins: the call leaves it
    }
