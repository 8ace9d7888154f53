"""Layer 6, what a run reports: metrics.jsonl, the progress bar and summary lines, W&B."""
