"""The model: presets and configs (presets), attention (attention), the training heads (heads) and
their chunked causal-LM loss (losses), and `build_model` (build)."""
