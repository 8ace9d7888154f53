"""What the GPUs of this machine are, asked without creating a CUDA context in this process.

A notebook kernel or a launcher that initialised CUDA would hold a context (about 0.3-0.5 GiB) on GPU 0 for as long as
it lives, taken from the training's rank 0. So nvidia-smi is asked, or a short-lived Python process whose context ends
with it. bf16 is told from the compute capability (8.0 or more): `torch.cuda.is_bf16_supported()` answers True on a
T4, which only emulates bf16.
"""

from __future__ import annotations

import ctypes
import json
import shutil
import subprocess
import sys
from typing import Any


def has_bf16(capability: str) -> bool:
    return int(str(capability).split(".")[0]) >= 8


def precision_for(capability: str) -> str:
    """What --precision auto trains in on this GPU."""
    return "bf16" if has_bf16(capability) else "fp16"


def from_nvidia_smi() -> list[dict[str, Any]]:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return []
    query = [exe, "--query-gpu=index,name,memory.total,compute_cap", "--format=csv,noheader,nounits"]
    try:
        out = subprocess.run(query, capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = []
    for line in out.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 4:
            return []  # an older nvidia-smi without compute_cap
        gpus.append(
            {"index": int(parts[0]), "name": parts[1], "memory_gib": float(parts[2]) / 1024, "capability": parts[3]}
        )
    return gpus


# Each GPU as torch reads it, and what is free once a context exists (mem_get_info): total less the context and
# whatever other processes hold.
CHILD_QUERY = """
import json, torch
GIB = 2**30
out = []
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    free, total = torch.cuda.mem_get_info(i)
    out.append({"index": i, "name": p.name, "memory_gib": p.total_memory / GIB, "capability": f"{p.major}.{p.minor}",
                "free_after_context_gib": free / GIB})
print(json.dumps(out))
"""


def from_a_child_process() -> list[dict[str, Any]]:
    """torch's own reading, from a process that ends (and frees its CUDA contexts) before this returns."""
    try:
        out = subprocess.run(
            [sys.executable, "-c", CHILD_QUERY], capture_output=True, text=True, timeout=180, check=True
        )
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return []


def contexts_held(lib: Any = None) -> list[bool] | None:
    """Whether this process holds a CUDA context on each GPU, as the driver answers (`cuDevicePrimaryCtxGetState`:
    the contexts torch makes), asking creates none. None where no driver answers. `torch.cuda.is_initialized()` is no
    answer: importing transformers with torchao beside it initialises torch's CUDA state (torchao asks the compute
    capability at import) and makes no context, as the H200 machine showed (4 MiB used on the GPU, none by it)."""
    try:
        lib = lib or ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    count = ctypes.c_int()
    if lib.cuInit(0) != 0 or lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return None
    held = []
    for i in range(count.value):
        device, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
        if lib.cuDeviceGet(ctypes.byref(device), i) != 0:
            return None
        if lib.cuDevicePrimaryCtxGetState(device, ctypes.byref(flags), ctypes.byref(active)) != 0:
            return None
        held.append(bool(active.value))
    return held


def describe(gpus: list[dict[str, Any]]) -> list[str]:
    lines = []
    for g in gpus:
        bf16 = "bf16" if has_bf16(g["capability"]) else "no bf16 (fp16 with loss scaling)"
        lines.append(f"cuda:{g['index']} {g['name']}, {g['memory_gib']:.2f} GiB, compute {g['capability']}, {bf16}")
    return lines


# Dense fp16/bf16 tensor-core peaks from vendor datasheets, by substring of the device name.
PEAK_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "A10G": 125e12,
    "L40S": 362e12,
    "L4": 121e12,
    "V100": 125e12,
    "T4": 65e12,
}


# Memory bandwidth (GB/s) from vendor datasheets, by substring of the device name: what a decoding step reads at.
MEMORY_GBPS = {
    "H200": 4800.0,
    "H100": 3350.0,
    "A100": 1555.0,
    "A10G": 600.0,
    "L40S": 864.0,
    "L4": 300.0,
    "V100": 900.0,
    "T4": 320.0,
}
