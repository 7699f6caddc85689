"""The figures of a log interval, from every rank's timings: throughput, model FLOPs utilisation,
stragglers and memory (docs/design.md, "Metrics"). Pure functions: the trainer gathers one small
row per rank at the log interval (the only cross-rank traffic of telemetry) and hands it here.

Per rank, a window holds: its wall time, its time waiting for data, its forward time (device
time, from accelerator events), its memory, the model state it holds (parameters,
gradients, optimizer states; measured at the window's last step) and the real (not padding)
tokens of its micro batches: throughput and MFU count those, and `data/padding_pct` is the rest's
share of the window's sample tokens. In synchronous data
parallelism every rank's wall time is about the same (they wait for each other in the gradient
reduction); what tells a straggler apart is where its time went: a starved loader shows as data
wait, a slow device as a longer forward. `perf/slowest_rank` is the rank with the most of both:
the one the others wait for.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from app.telemetry import hardware

# the order of one rank's row in the gather
ROW = ("wall", "data_wait", "forward", "mem", "mem_reserved", "mem_peak", "model_state",
       "real_tokens", "optimizer")


@dataclass(frozen=True)
class RunShape:
    """What turns a window's times into throughput and utilisation."""

    global_batch: int
    """Samples per optimizer step, over all ranks."""
    seq_len: int
    world_size: int
    flops_per_token: float
    """Model FLOPs of a training token (forward and backward; app.telemetry.flops)."""
    peak_tflops: float | None
    """The accelerator's dense peak for the run's precision (app.telemetry.hardware); None: no
    MFU."""


def interval(rows: Sequence[Sequence[float]], steps: int, shape: RunShape) -> dict[str, Any]:
    """perf/ and sys/ figures of a window of `steps` optimizer steps; `rows[r]` is rank r's ROW."""
    col = {name: [float(r[i]) for r in rows] for i, name in enumerate(ROW[:len(rows[0])])}
    n, steps = len(rows), max(steps, 1)
    wall = max(sum(col["wall"]) / n, 1e-9)
    samples = steps * shape.global_batch
    window_tokens = samples * shape.seq_len  # the samples' tokens, padding included
    real = sum(col["real_tokens"]) if "real_tokens" in col else window_tokens
    tokens_per_sec = real / wall  # real tokens: padding is not throughput
    per_rank_ms = [1000.0 * w / steps for w in col["wall"]]
    wait_pct = [100.0 * d / max(w, 1e-9) for d, w in zip(col["data_wait"], col["wall"])]
    held_up_by = [d + f for d, f in zip(col["data_wait"], col["forward"])]
    tflops = shape.flops_per_token * tokens_per_sec / n / 1e12
    out = {"perf/tokens_per_sec": tokens_per_sec,
           "perf/tokens_per_sec_per_device": tokens_per_sec / n,
           "perf/samples_per_sec": samples / wall,
           "perf/step_time_ms": 1000.0 * wall / steps,
           "perf/step_time_ms_max": max(per_rank_ms), "perf/step_time_ms_min": min(per_rank_ms),
           "perf/data_wait_pct": 100.0 * sum(col["data_wait"]) / max(sum(col["wall"]), 1e-9),
           "perf/data_wait_pct_max": max(wait_pct), "perf/data_wait_pct_min": min(wait_pct),
           "perf/forward_ms": 1000.0 * sum(col["forward"]) / n / steps,
           "perf/forward_ms_max": 1000.0 * max(col["forward"]) / steps,
           "perf/slowest_rank": held_up_by.index(max(held_up_by)),
           "perf/tflops_per_device": tflops,
           "sys/mem_gb": max(col["mem"]), "sys/mem_reserved_gb": max(col["mem_reserved"]),
           "sys/max_mem_gb": max(col["mem_peak"]),
           "data/padding_pct": 100.0 * max(0.0, 1.0 - real / max(window_tokens, 1))}
    if "optimizer" in col:  # engine.step() at the boundaries: the part nothing overlaps
        out["perf/optimizer_ms"] = 1000.0 * sum(col["optimizer"]) / n / steps
    if max(col.get("model_state", [0.0])) > 0:  # measured at the window's last step
        out["sys/model_state_gb"] = max(col["model_state"])
    if shape.peak_tflops:
        out["perf/mfu"] = tflops / shape.peak_tflops
    return out


def accelerator_for(device_name: str) -> hardware.Accelerator | None:
    """The table's entry for a device as the driver names it ("NVIDIA H100 80GB HBM3",
    "NVIDIA A100-SXM4-40GB", "AMD Instinct MI300X"): the longest table name in it wins, so
    "H100 PCIe" is not read as "H100"; None for a device the table does not hold."""
    key = hardware._key(device_name)
    best = None
    for acc in hardware.ACCELERATORS:
        for name in (acc.name, *acc.aliases):
            k = hardware._key(name)
            if k and k in key and (best is None or len(k) > best[0]):
                best = (len(k), acc)
    return best[1] if best else None


def peak_tflops(device_name: str | None, precision: str, tf32: bool,
                override: float | None = None) -> float | None:
    """Dense peak TFLOP/s per device for MFU: --peak-tflops if given, else the table's figure
    for this device and precision; None on CPU or an unknown device (no MFU is invented)."""
    if override:
        return override
    acc = accelerator_for(device_name) if device_name else None
    if acc is None:
        return None
    try:
        return acc.peak_tflops(precision, allow_tf32=tf32)
    except Exception:  # noqa: BLE001 - a precision the device has no matrix units for
        return None


def banner(shape: RunShape, *, nodes: int, total_steps: int, device: str | None) -> str:
    """The derived quantities of a run, at start-up."""
    tokens_per_step = shape.global_batch * shape.seq_len
    if shape.peak_tflops:
        peak = f"MFU against {shape.peak_tflops:,.0f} TFLOP/s a device ({device or 'given'})"
    else:
        peak = ("no MFU on CPU" if device is None else
                f"no MFU: {device} is not in app/telemetry/hardware.py's table (--peak-tflops)")
    return (f"run: {shape.world_size} rank(s) on {nodes} node(s); global batch "
            f"{shape.global_batch:,} samples = {tokens_per_step:,} tokens; "
            f"{shape.flops_per_token / 1e9:,.3f} GFLOPs a token (app/telemetry/flops.py); "
            f"{total_steps:,} "
            f"steps = {total_steps * tokens_per_step:,} tokens to train; {peak}")


def expected_time(step_time_ms: float, steps_left: int) -> str:
    """"expected: ..." after the first measured interval."""
    seconds = step_time_ms / 1000.0 * steps_left
    hours, rest = divmod(int(seconds), 3600)
    return (f"expected: {steps_left:,} steps left x {step_time_ms:,.0f} ms = "
            f"{hours}h {rest // 60:02d}m {rest % 60:02d}s")


def run_figures(intervals: list[dict[str, Any]]) -> dict[str, Any]:
    """summary.json's throughput, MFU and memory over a run's log intervals (the first one,
    which holds start-up, left out when there are others)."""
    steady = intervals[1:] or intervals
    out: dict[str, Any] = {}
    for key, name in (("perf/tokens_per_sec", "tokens_per_sec"), ("perf/mfu", "mfu"),
                      ("perf/tflops_per_device", "tflops_per_device")):
        values = [r[key] for r in steady if r.get(key) is not None]
        if values:
            out[f"{name}_mean"] = sum(values) / len(values)
            out[f"{name}_median"] = sorted(values)[len(values) // 2]
    peaks = [r["sys/max_mem_gb"] for r in intervals if r.get("sys/max_mem_gb") is not None]
    if peaks:
        out["peak_mem_gb"] = max(peaks)
    return out
