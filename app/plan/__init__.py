"""Planning before a run: the memory model (memory), the network model (network), the model and
ZeRO set-ups both planners read (inputs), `app plan` (its flags: request; the request on the
network model: jobs; the network recommendation: recommend; the plan: planner; its tables, JSON
and plot: render; the command: command), `app tune` and its probes (tune, probe)."""
