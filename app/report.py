"""`python -m app report RUN_DIR`: a run's summary and its curves as a picture.

Reads RUN_DIR/metrics.jsonl and summary.json (nothing else, so it works on a run that is still
going or was stopped) and writes RUN_DIR/curves.png: train and eval loss, learning rate, and
throughput against tokens seen.
"""
from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from app import rundir
from data_tools import output

PLOT = "curves.png"


def add_arguments(p) -> None:
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="run directory of app train")
    p.add_argument("--out", type=Path, help=f"picture to write (default RUN_DIR/{PLOT})")


def series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(tokens_seen, value) of every row that has `key`."""
    pts = [(r["tokens_seen"], r[key]) for r in rows if key in r and r[key] is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_run(run_dir: Path, out: Path | None = None) -> Path:
    """Write the run's curves; returns the picture's path."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    rows = rundir.read_metrics(run_dir)
    out = out or run_dir / PLOT
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    ax.plot(*series(rows, "train/loss"), label="train/loss")
    x, y = series(rows, "eval/loss")
    ax.plot(x, y, "o-", label="eval/loss")
    ax.set_title("loss")
    ax.legend()
    axes[1].plot(*series(rows, "train/lr"))
    axes[1].set_title("train/lr")
    axes[2].plot(*series(rows, "perf/tokens_per_sec"))
    axes[2].set_title("perf/tokens_per_sec")
    for ax in axes:
        ax.set_xlabel("tokens seen")
        ax.grid(alpha=0.3)
    fig.suptitle(str(run_dir))
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    output.write_bytes_atomic(out, buf.getvalue())
    return out


def run(args) -> int:
    run_dir: Path = args.run_dir
    rows = rundir.read_metrics(run_dir)
    train = [r for r in rows if "train/loss" in r]
    evals = [r for r in rows if "eval/loss" in r]
    if train:
        first, last = train[0], train[-1]
        print(f"train/loss {first['train/loss']:.3f} (step {first['step']}) -> "
              f"{last['train/loss']:.3f} (step {last['step']})")
    if evals:
        e = evals[-1]
        extra = f", eval/accuracy {e['eval/accuracy']:.3f}" if "eval/accuracy" in e else ""
        print(f"eval/loss {evals[0]['eval/loss']:.3f} -> {e['eval/loss']:.3f} "
              f"(perplexity {e.get('eval/perplexity', float('nan')):.1f}{extra})")
    s = rundir.read_summary(run_dir)
    if s is not None:
        print(f"{s['steps']} steps, {s['tokens_seen']:,} tokens, "
              f"{s.get('tokens_per_sec', 0):,.0f} tokens/s, {s.get('wall_seconds', 0):.0f} s")
    print(f"curves: {plot_run(run_dir, args.out)}")
    return 0
