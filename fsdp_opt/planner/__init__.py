"""Layer 8, the planner: per-GPU memory, host RAM, disk and Hub bytes, step time, and the fake-tensor simulation,
all before anything is launched. `python -m fsdp_opt.plan` is its command."""
