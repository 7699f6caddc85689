"""The runtime, where DeepSpeed is used: the accelerator (device), the process group (dist), the
DeepSpeed config (ds_config), its compiled ops (ops), the engine (engine), DeepSpeed's launcher as
launch.sh starts it (runner), ZeRO-3's partitioned build (zero3_init), the optimizer's parameter
groups in ZeRO-1/2's layer blocks (param_groups), and the DeepSpeed patch layer: its registry
(registry), the patches to DeepSpeed's optimizers (patches), the app's gradient reducers (overlap),
weight gather (gather) and CPU-only ZeRO-2 overlap (zero2_overlap), and the non-finite step guard
(step_guard).
docs/design.md has the tables."""
