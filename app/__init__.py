"""The training application: a plain PyTorch loop in the DeepSpeed engine."""
