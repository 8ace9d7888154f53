r"""Fine-tune a Hugging Face causal LM with PyTorch FSDP2 on a slice [start_idx, end_idx) of a dataset.

    torchrun --standalone --nproc_per_node=gpu fsdp_finetune.py --num_epochs 1 \
        --start_idx 0 --end_idx 5000 --batch_size 4 --accum_steps 16 --hf_repo user/repo

Plain `python fsdp_finetune.py ...` runs as a world of one. `--help` lists every flag.
"""

from __future__ import annotations

from fsdp_opt.commands.train import entry

if __name__ == "__main__":
    entry()
