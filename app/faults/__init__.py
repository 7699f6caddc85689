"""Faults: anomalies and recovery, preemption signals, the hang watchdog, fault injection."""
