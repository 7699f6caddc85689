"""The runtime: the accelerator, the process group, the DeepSpeed config and engine (docs/design.md)."""
