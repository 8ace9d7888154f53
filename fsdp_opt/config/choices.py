"""The fixed choices the flags accept, and the T4 figures the defaults are drawn from. Defined once here: the
trainer, the planner and the commands all import them."""

from __future__ import annotations

STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD")
PRECISIONS = ("auto", "fp16", "bf16", "fp32")
LR_SCHEDULES = ("constant", "linear", "cosine")
DEVICES = ("auto", "cuda", "cpu")
STATE_DICT_TYPES = ("full", "sharded")
PACKING_MODES = ("docs", "concat", "pad")
# Row formats (--data_format) and which tokens carry loss (--train_on); data/formats.py reads the rows.
DATA_FORMATS = ("auto", "text", "prompt_completion", "messages", "preference", "prompt", "unpaired")
TRAIN_ON = ("auto", "completion", "all")
# --dataset's built-ins (data/sources.py builds them offline): text, conversations, preference pairs, prompts
BUILTIN_DATASETS = ("python-docs", "python-docs-chat", "python-docs-prefs", "python-docs-prompts")
# --reward's built-ins (engine/rewards.py defines them; the flag's help and errors name them from here)
BUILTIN_REWARDS = ("accuracy", "format", "length", "choice")
AUTO = "auto"  # --start_idx auto: the chain of sessions picks its own next range


def shard_count(strategy: str, world_size: int, ranks_per_node: int) -> int:
    """The ranks each parameter is split over: none for NO_SHARD, one node's for HYBRID_SHARD, all otherwise."""
    if strategy == "NO_SHARD":
        return 1
    if strategy == "HYBRID_SHARD":
        return max(1, ranks_per_node)
    return world_size


# What torch.cuda.get_device_properties(i).total_memory reads on Kaggle's T4s (ECC on): 14.56 to 14.75 GiB, not the
# 16 GB they are sold as; the plan takes the lower reading.
T4_MEMORY = "14.56GiB"
# The machine around Kaggle's 2xT4: its host RAM (31 GB as Kaggle states it; about 28.9 GiB) and /kaggle/working's cap.
KAGGLE_HOST_MEMORY = "31GB"
KAGGLE_DISK = "20GB"
# A T4's sustained fp16 tensor-core rate, its GPU-to-GPU bandwidth through NCCL on PCIe 3, and its memory bandwidth.
T4_TFLOPS = 24.0
T4_LINK_GBPS = 3.2  # GB/s
T4_HBM_GBPS = 320.0  # GB/s
# --cpu_offload on Kaggle: host <-> GPU copies over PCIe 3 x16 from pinned memory, and AdamW on the host's 4 vCPUs
# (fp32, foreach kernels: about 28 bytes of memory traffic per parameter).
HOST_LINK_GBPS = 11.0  # GB/s
HOST_OPTIMIZER_GBPS = 4.0  # GB/s of AdamW traffic
