"""Faults: anomaly detection and recovery, preemption signals, the hang watchdog, fault injection."""
