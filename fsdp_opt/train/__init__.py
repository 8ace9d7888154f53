"""Layer 9, the run: setup in a fixed order, the loop, saving, publishing, the held-out comparison of checkpoints."""
