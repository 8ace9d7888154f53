"""Layer 1, the process and its machine: process group and rank helpers, devices and GPUs, host memory, stop
signals and time limits, the torchao gate."""
