"""Layer 7, the Hugging Face Hub as checkpoint store: the repo, background uploads, retention, the model card."""
