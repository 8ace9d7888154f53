"""fsdp-opt: fine-tune Hugging Face causal LMs with PyTorch FSDP2, one resumable run across sessions."""

__version__ = "0.1.0"
