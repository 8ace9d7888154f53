"""The commands, one module a verb (fsdp_opt/cli.py routes `fsdp-opt <verb>` here): flags in, one layer's work out."""
