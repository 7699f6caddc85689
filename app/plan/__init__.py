"""Planning before a run: the memory model, `app plan`, `app tune` and its probes."""
