"""Telemetry: step timing, throughput/MFU figures, FLOPs, the hardware table, sinks, reports."""
