"""A benchmark sweep's results: each configuration's figures read from its run's metrics.jsonl
(what telemetry recorded, nothing re-measured), the scaling efficiency across world sizes, and the
files a sweep leaves: results.csv, results.md and the PNG plots (docs/benchmarks.md, "bench").

Warm-up is left out: the first log interval of a run (start-up, the allocator, the first batches,
ZeRO-3's first trace) does not count when there are others. Per-interval figures are combined by
their median, so a burst of load from another process on a shared machine moves one interval,
not the result.
"""
from __future__ import annotations

import csv
import io
import statistics
from pathlib import Path
from typing import Any, Iterable

from app import rundir
from app.sweep.configs import KEYS, Config

COLUMNS = ("world_size", "nodes", "procs_per_node", "rate", "zero", "model", "micro_batch",
           "seq_len", "workers", "threads", "status", "tokens_per_sec", "tokens_per_sec_per_device",
           "step_time_ms", "step_time_ms_min", "step_time_ms_max", "step_time_ms_slowest_rank",
           "data_wait_pct", "data_wait_pct_max", "mfu", "tflops_per_device", "peak_mem_gb",
           "model_state_gb", "scaling_efficiency", "steps_measured", "seconds",
           "other_load_cores", "error", "run_dir")
# how many decimals each figure keeps in the table files
DECIMALS = {"tokens_per_sec": 1, "tokens_per_sec_per_device": 1, "step_time_ms": 2,
            "step_time_ms_min": 2, "step_time_ms_max": 2, "step_time_ms_slowest_rank": 2,
            "data_wait_pct": 3, "data_wait_pct_max": 3, "mfu": 5, "tflops_per_device": 5,
            "peak_mem_gb": 4, "model_state_gb": 5, "scaling_efficiency": 4, "seconds": 1,
            "other_load_cores": 2}
PLOTS = ("throughput.png", "scaling_efficiency.png", "memory.png")


def _median(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def run_figures(run_dir: Path, world: int) -> dict[str, Any]:
    """One configuration's figures from its run directory (the first log interval left out)."""
    records = [r for r in rundir.read_metrics(run_dir) if r.get("perf/tokens_per_sec")]
    if not records:
        raise ValueError(f"{run_dir / rundir.METRICS}: no training interval logged")
    steady = records[1:] or records
    times = [r["perf/step_time_ms"] for r in steady if r.get("perf/step_time_ms") is not None]
    tokens_per_sec = _median(steady, "perf/tokens_per_sec")
    peaks = [r["sys/max_mem_gb"] for r in records if r.get("sys/max_mem_gb") is not None]
    states = [r["sys/model_state_gb"] for r in records if r.get("sys/model_state_gb")]
    return {"tokens_per_sec": tokens_per_sec,
            "tokens_per_sec_per_device": tokens_per_sec / world,
            "step_time_ms": _median(steady, "perf/step_time_ms"),
            "step_time_ms_min": min(times, default=None),
            "step_time_ms_max": max(times, default=None),
            "step_time_ms_slowest_rank": _median(steady, "perf/step_time_ms_max"),
            "optimizer_ms": _median(steady, "perf/optimizer_ms"),
            "forward_ms": _median(steady, "perf/forward_ms"),
            "data_wait_pct": _median(steady, "perf/data_wait_pct"),
            "data_wait_pct_max": _median(steady, "perf/data_wait_pct_max"),
            "mfu": _median(steady, "perf/mfu"),
            "tflops_per_device": _median(steady, "perf/tflops_per_device"),
            "peak_mem_gb": max(peaks, default=None),
            "model_state_gb": max(states, default=None),
            "steps_measured": steady[-1]["step"] - (records[0]["step"] if len(records) > 1
                                                    else 0)}


def rows(results: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """results.csv's rows from the per-configuration records, with the scaling efficiency: the
    throughput per device against that of the smallest world size of the same group (model,
    ZeRO stage, micro batch, sequence length, workers, threads) that ran."""
    out = []
    for res in results:
        c = Config(**res["config"])
        row = {"world_size": c.world,
               **{k: getattr(c, k) for k in KEYS if k not in ("world", "nodes")},
               "nodes": c.nodes, "procs_per_node": c.procs_per_node, "status": res["status"],
               "error": res.get("error"), "seconds": res.get("seconds"),
               "other_load_cores": res.get("other_load_cores"),
               "run_dir": res.get("run_dir"), **res.get("figures", {})}
        out.append((c, row))
    base: dict[tuple, dict[str, Any]] = {}
    for c, row in sorted(out, key=lambda cr: cr[0].world):
        if row["status"] == "ok" and c.group not in base:
            base[c.group] = row
    for c, row in out:
        ref = base.get(c.group)
        if row["status"] == "ok" and ref is not None and ref["tokens_per_sec_per_device"]:
            row["scaling_efficiency"] = (row["tokens_per_sec_per_device"]
                                         / ref["tokens_per_sec_per_device"])
    return [row for _, row in out]


def _cell(row: dict[str, Any], key: str) -> str:
    value = row.get(key)
    if value is None:
        return ""
    if key in DECIMALS and isinstance(value, (int, float)):
        return f"{value:.{DECIMALS[key]}f}"
    return str(value)


def csv_text(table: list[dict[str, Any]]) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(COLUMNS)
    for row in table:
        writer.writerow([_cell(row, k) for k in COLUMNS])
    return buf.getvalue()


MD_COLUMNS = (("world_size", "world"), ("nodes", "nodes"), ("zero", "ZeRO"), ("model", "model"),
              ("micro_batch", "micro batch"), ("seq_len", "seq"), ("threads", "threads"),
              ("workers", "workers"), ("rate", "link"), ("status", "status"),
              ("tokens_per_sec", "tokens/s"), ("tokens_per_sec_per_device", "tokens/s/device"),
              ("step_time_ms", "step ms (median)"), ("step_time_ms_min", "min"),
              ("step_time_ms_max", "max"), ("data_wait_pct", "data wait %"),
              ("data_wait_pct_max", "slowest rank %"), ("mfu", "MFU"),
              ("peak_mem_gb", "peak GiB/rank"), ("model_state_gb", "model state GiB/rank"),
              ("scaling_efficiency", "scaling eff."),
              ("other_load_cores", "other load (cores)"))


def markdown(table: list[dict[str, Any]], header: list[str]) -> str:
    """results.md: what was run, then one row a configuration (errors below the table)."""
    lines = [*header, "",
             "| " + " | ".join(title for _, title in MD_COLUMNS) + " |",
             "| " + " | ".join("---:" if k not in ("model", "status") else "---"
                               for k, _ in MD_COLUMNS) + " |"]
    for row in table:
        lines.append("| " + " | ".join(_cell(row, k) or "–" for k, _ in MD_COLUMNS) + " |")
    failed = [r for r in table if r["status"] != "ok"]
    if failed:
        lines += ["", "Failed configurations:", ""]
        lines += [f"- world={r['world_size']} zero={r['zero']} model={r['model']} micro_batch="
                  f"{r['micro_batch']}: {r['status']}: {r.get('error') or ''}" for r in failed]
    return "\n".join(lines) + "\n"


# -- plots ---------------------------------------------------------------------------------------

def _series(table: list[dict[str, Any]], configs: list[Config]) -> dict[str, list[dict]]:
    """The rows that ran, by group, named by the keys that vary in the sweep (not the world)."""
    from app.sweep.configs import varying

    keys = varying(configs) - {"world"}
    out: dict[str, list[dict]] = {}
    for row in table:
        if row["status"] != "ok":
            continue
        name = " ".join(f"{k}={row[k]}" for k in KEYS if k in keys) or row["model"]
        out.setdefault(name, []).append(row)
    for group in out.values():
        group.sort(key=lambda r: r["world_size"])
    return out


def _png(fig) -> bytes:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()


def _axes(title: str, xlabel: str, ylabel: str, width: float = 7.0):
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(width, 4.5))
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    return fig, ax


def _world_axis(ax, series: dict[str, list[dict]]) -> None:
    worlds = sorted({r["world_size"] for rs in series.values() for r in rs})
    if worlds:
        ax.set_xticks(worlds)
    if len(worlds) > 2 and worlds[-1] / worlds[0] >= 8:
        ax.set_xscale("log", base=2)
        ax.set_xticks(worlds, [str(w) for w in worlds])


def _legend(ax, any_data: bool) -> None:
    if any_data:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no configuration ran", ha="center", va="center",
                transform=ax.transAxes, color="gray")


def plots(table: list[dict[str, Any]], configs: list[Config]) -> dict[str, bytes]:
    """throughput.png (the paper's Figure 1: tokens/s against world size, with the ideal line
    from each series' smallest world), scaling_efficiency.png and memory.png (per rank, by ZeRO
    stage)."""
    series = _series(table, configs)
    fig, ax = _axes("training throughput against world size", "world size (ranks)",
                    "tokens/s (all ranks)")
    for i, (name, rs) in enumerate(series.items()):
        xs, ys = [r["world_size"] for r in rs], [r["tokens_per_sec"] for r in rs]
        ax.plot(xs, ys, "o-", color=f"C{i}", label=name)
        ideal = [ys[0] * x / xs[0] for x in xs]
        ax.plot(xs, ideal, ":", color=f"C{i}", label=f"{name} ideal (linear)")
    _world_axis(ax, series)
    _legend(ax, bool(series))
    files = {"throughput.png": _png(fig)}

    fig, ax = _axes("scaling efficiency (tokens/s per device against the smallest world)",
                    "world size (ranks)", "efficiency")
    for i, (name, rs) in enumerate(series.items()):
        pts = [(r["world_size"], r["scaling_efficiency"]) for r in rs
               if r.get("scaling_efficiency") is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=f"C{i}", label=name)
    ax.axhline(1.0, color="gray", linestyle=":", label="ideal")
    ax.set_ylim(0, max([1.1] + [r.get("scaling_efficiency") or 0 for r in table]) * 1.05)
    _world_axis(ax, series)
    _legend(ax, bool(series))
    files["scaling_efficiency.png"] = _png(fig)
    files["memory.png"] = _memory_plot(table)
    return files


def _memory_plot(table: list[dict[str, Any]]) -> bytes:
    """Per rank, by ZeRO stage: peak memory and model state, a bar per (model, world)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [r for r in table if r["status"] == "ok"]
    stages = sorted({r["zero"] for r in ran})
    bars = sorted({(r["model"], r["world_size"]) for r in ran})
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for ax, key, title in ((axes[0], "peak_mem_gb", "peak memory per rank (GiB)"),
                           (axes[1], "model_state_gb",
                            "model state per rank (GiB): parameters, gradients, optimizer")):
        width = 0.8 / max(len(bars), 1)
        for i, (model, world) in enumerate(bars):
            ys = []
            for z in stages:
                vals = [r[key] for r in ran if r["zero"] == z and r["model"] == model
                        and r["world_size"] == world and r.get(key) is not None]
                ys.append(max(vals) if vals else 0.0)
            ax.bar([s + (i - (len(bars) - 1) / 2) * width for s in range(len(stages))], ys,
                   width, color=f"C{i}", label=f"{model}, world {world}")
        ax.set_xticks(range(len(stages)), [f"ZeRO-{z}" for z in stages])
        ax.set_title(title)
        ax.grid(alpha=0.3, axis="y")
        _legend(ax, bool(bars))
    return _png(fig)
