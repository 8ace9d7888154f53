"""Layer 3, the model: where it comes from, its shape, the decoder-block wrap policy, FSDP2 sharding with mixed
precision and activation checkpointing, LoRA adapters and the NF4 base."""
