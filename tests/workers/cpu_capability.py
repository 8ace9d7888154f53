"""Prints the CPU kernels torch dispatches to in this process (ATEN_CPU_CAPABILITY can only lower them): the nested
session of tests/test_kernels.py runs it as its training runs start, to show they ran under the kernel it set."""

import torch

print(f"cpu capability: {torch.backends.cpu.get_cpu_capability()}", flush=True)
