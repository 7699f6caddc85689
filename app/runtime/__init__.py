"""The runtime, where DeepSpeed is used: the accelerator (device), the process group (dist), the
DeepSpeed config (ds_config), its compiled ops (ops), the engine and its patches (engine,
patches), and ZeRO-3's partitioned build (zero3_init). docs/design.md has the table."""
