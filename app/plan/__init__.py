"""Planning before a run: the memory model (memory), the network model (network), the model and
ZeRO set-ups both planners read (inputs), `app plan` (planner), `app tune` and its probes (tune,
probe)."""
