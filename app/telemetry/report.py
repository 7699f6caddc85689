"""`python -m app report RUN_DIR [RUN_DIR...] [--out DIR]`: runs' summaries and their curves.

Reads each run's metrics.jsonl and summary.json (nothing else, so it works on a run that is still
going or was stopped) and writes, into DIR (default: the run directory, for one run):

    curves.png      overview: loss, learning rate, throughput, memory, against tokens seen
    loss.png        train and eval loss against steps and against tokens
    throughput.png  tokens/s (and MFU where the accelerator's peak is known)
    data_wait.png   the share of step time spent waiting for data: mean and the slowest rank
    memory.png      memory per rank: in use and peak (the largest rank)
    report.md       a table of the runs

Several runs are overlaid, one colour each, named in the legend.
"""
from __future__ import annotations

import io
import statistics
from pathlib import Path
from typing import Any, Callable

from app import rundir
from data_tools import output
from data_tools.errors import UserError

KIND, COMMAND = "report", "app report"
PLOT = "curves.png"
TABLE = "report.md"


def add_arguments(p) -> None:
    p.add_argument("run_dirs", type=Path, nargs="+", metavar="RUN_DIR",
                   help="run directories of app train (several: overlaid)")
    p.add_argument("--out", type=Path, metavar="DIR",
                   help="directory for the PNGs and report.md (default: the run directory, for "
                        "one run)")


class Run:
    """One run's records, as the plots read them."""

    def __init__(self, run_dir: Path, label: str):
        self.dir, self.label = run_dir, label
        self.rows = rundir.read_metrics(run_dir)
        self.summary = rundir.read_summary(run_dir) or {}

    def series(self, key: str, x: str = "tokens_seen") -> tuple[list[float], list[float]]:
        pts = [(r[x], r[key]) for r in self.rows if r.get(key) is not None and x in r]
        return [p[0] for p in pts], [p[1] for p in pts]

    def last(self, key: str) -> float | None:
        values = self.series(key)[1]
        return values[-1] if values else None

    def median(self, key: str) -> float | None:
        values = self.series(key)[1]
        return statistics.median(values) if values else None


def labels_for(run_dirs: list[Path]) -> list[str]:
    """Each run's name in legends: its directory name, or its path where names repeat."""
    names = [d.resolve().name for d in run_dirs]
    return [n if names.count(n) == 1 else str(d) for n, d in zip(names, run_dirs)]


def _figure(runs: list[Run], panels: list[tuple[str, Callable]], title: str):
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    cols = 2 if len(panels) > 1 else 1
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(7 * cols, 4.2 * rows), squeeze=False)
    for ax, (panel_title, draw) in zip(axes.flat, panels):
        for i, run in enumerate(runs):
            draw(ax, run, f"C{i}")
        ax.set_title(panel_title)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        else:  # e.g. MFU of CPU runs: no accelerator peak, so none was logged
            ax.text(0.5, 0.5, "not logged by these runs", ha="center", va="center",
                    transform=ax.transAxes, color="gray")
            ax.set_xticks([])
            ax.set_yticks([])
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(title)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()


def _line(key: str, x: str = "tokens_seen", style: str = "-", suffix: str = "",
          scale: float = 1.0) -> Callable:
    def draw(ax, run: Run, color: str) -> None:
        xs, ys = run.series(key, x)
        if ys:
            ax.plot(xs, [y * scale for y in ys], style, color=color, label=run.label + suffix,
                    markersize=4)
        ax.set_xlabel("tokens seen" if x == "tokens_seen" else "optimizer step")
    return draw


def _both(*draws: Callable) -> Callable:
    def draw(ax, run: Run, color: str) -> None:
        for d in draws:
            d(ax, run, color)
    return draw


def pictures(runs: list[Run]) -> dict[str, bytes]:
    """The PNGs of the report, by file name."""
    loss = [("loss against tokens seen", _both(_line("train/loss", suffix=" train"),
                                               _line("eval/loss", style="o--", suffix=" eval"))),
            ("loss against optimizer steps",
             _both(_line("train/loss", "step", suffix=" train"),
                   _line("eval/loss", "step", style="o--", suffix=" eval")))]
    speed = [("throughput (tokens/s, all ranks)", _line("perf/tokens_per_sec")),
             ("model FLOPs utilisation (%)", _line("perf/mfu", scale=100.0)),
             ("TFLOP/s per device", _line("perf/tflops_per_device"))]
    wait = [("data wait (% of step time)",
             _both(_line("perf/data_wait_pct", suffix=" mean"),
                   _line("perf/data_wait_pct_max", style=":", suffix=" slowest rank")))]
    memory = [("memory per rank (GiB, the largest rank)",
               _both(_line("sys/mem_gb", suffix=" in use"),
                     _line("sys/max_mem_gb", style=":", suffix=" peak")))]
    overview = [loss[0], ("learning rate", _line("train/lr")), speed[0], memory[0]]
    return {PLOT: _figure(runs, overview, "overview"), "loss.png": _figure(runs, loss, "loss"),
            "throughput.png": _figure(runs, speed, "throughput"),
            "data_wait.png": _figure(runs, wait, "data wait"),
            "memory.png": _figure(runs, memory, "memory")}


def _fmt(value: Any, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def table(runs: list[Run]) -> str:
    """report.md: one row a run."""
    lines = ["| run | steps | tokens | train loss | best eval loss | tokens/s (median) | MFU | "
             "peak memory (GiB) | wall time (s) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in runs:
        s = r.summary
        mfu = r.median("perf/mfu")
        lines.append(
            f"| {r.label} | {_fmt(s.get('steps', r.last('step')), ',')} | "
            f"{_fmt(s.get('tokens_seen', r.last('tokens_seen')), ',')} | "
            f"{_fmt(r.last('train/loss'), '.4f')} | {_fmt(s.get('best_eval_loss'), '.4f')} | "
            f"{_fmt(r.median('perf/tokens_per_sec'), ',.0f')} | "
            f"{_fmt(None if mfu is None else 100 * mfu, '.1f')}{'%' if mfu is not None else ''} | "
            f"{_fmt(max(r.series('sys/max_mem_gb')[1], default=None), '.2f')} | "
            f"{_fmt(s.get('wall_seconds'), ',.0f')} |")
    return "\n".join(lines) + "\n"


def summary_lines(run: Run) -> list[str]:
    """What a run did, in a few lines."""
    out = []
    train = [r for r in run.rows if "train/loss" in r]
    evals = [r for r in run.rows if "eval/loss" in r]
    if train:
        first, last = train[0], train[-1]
        out.append(f"train/loss {first['train/loss']:.3f} (step {first['step']}) -> "
                   f"{last['train/loss']:.3f} (step {last['step']})")
    if evals:
        e = evals[-1]
        extra = f", eval/accuracy {e['eval/accuracy']:.3f}" if "eval/accuracy" in e else ""
        out.append(f"eval/loss {evals[0]['eval/loss']:.3f} -> {e['eval/loss']:.3f} "
                   f"(perplexity {e.get('eval/perplexity', float('nan')):.1f}{extra})")
    s = run.summary
    if s:
        out.append(f"{s['steps']} steps, {s['tokens_seen']:,} tokens, "
                   f"{s.get('tokens_per_sec', 0):,.0f} tokens/s, {s.get('wall_seconds', 0):.0f} s")
    return out


def write(target: Path, files: dict[str, bytes], runs: list[Path]) -> None:
    """Into a run's own directory file by file (each atomic); elsewhere as a whole directory
    that appears at once (replacing an earlier report there, never anything else)."""
    if target.is_dir() and (rundir.is_run_dir(target)
                            or any(target.resolve() == r.resolve() for r in runs)):
        for name, data in files.items():
            output.write_bytes_atomic(target / name, data)
        return
    output.claim(target, KIND, COMMAND, overwrite=True)
    with output.new_dir(target, KIND, COMMAND) as tmp:
        for name, data in files.items():
            (tmp / name).write_bytes(data)


def run(args) -> int:
    runs = [Run(d, label) for d, label in zip(args.run_dirs, labels_for(args.run_dirs))]
    for r in runs:
        for line in summary_lines(r):
            print(f"{r.label}: {line}" if len(runs) > 1 else line)
    if args.out is None and len(runs) > 1:
        raise UserError("several runs: say where the report goes (--out DIR)")
    target = args.out or args.run_dirs[0]
    write(target, {**pictures(runs), TABLE: table(runs).encode()}, args.run_dirs)
    print(f"curves: {target / PLOT} (and loss, throughput, data_wait, memory .png; {TABLE})")
    return 0
