"""Telemetry: step timing, throughput/MFU figures, FLOPs, the hardware table, sinks, `app report`."""
