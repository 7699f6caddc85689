"""Benchmark: what the low-communication mode costs in quality. Synchronous data parallelism and
`--dp-mode diloco` at several H, the same model, data, global batch and steps, on one box (each
rank an island: `--island-ranks 1`), eval loss against tokens; the issue's target: at the H the
plan recommends, the eval loss at equal tokens within 2 % of synchronous training.

    python bench/bench_lowcomm_quality.py --data D --out OUT --ranks 4 --steps 2000 \\
        --outer-every 20,50,100 -- --model bert-tiny --model-arg hidden_size=256 ...

Every run goes through launch.sh (the real launcher, `--procs-per-node RANKS`), one after
another; OUT/quality.json has every run's eval losses, OUT/quality.md the table (the last eval's
loss per run and its difference from sync's), OUT/quality.png the curves.

`--sync-start N` runs DiLoCo's protocol: one synchronous run of the same schedule stopped and
saved at step N, and every diloco run resumed from a copy of it (`--resume auto`, converted to
the mode), so the runs share their first N steps with sync.

`--outer-lr` and `--outer-momentum` take lists: every H runs with every pair (the outer-settings
sweep). A run already finished in OUT with the same command (OUT/runs/NAME.cmd) is read, not run
again, so a stopped benchmark goes on where it stopped and a new H or setting reuses sync's run.
"""
from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from data_tools.errors import UserError  # noqa: E402


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--ranks", type=int, default=4, help="ranks, one island each (default 4)")
    p.add_argument("--steps", type=int, default=2000, help="optimizer steps a run (default 2000)")
    p.add_argument("--outer-every", default="20,50,100", help="the H values (default 20,50,100)")
    p.add_argument("--outer-lr", default="",
                   help="outer learning rates to sweep, e.g. 1,0.7 (default: the app's)")
    p.add_argument("--outer-momentum", default="",
                   help="outer Nesterov momenta to sweep, e.g. 0,0.9 (default: the app's)")
    p.add_argument("--sync-start", type=int, default=0, metavar="N",
                   help="diloco runs start from a synchronous run's checkpoint at step N of the "
                        "same schedule (DiLoCo's protocol; docs/recipes.md); default 0: from "
                        "random weights")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--zero", type=int, default=1)
    p.add_argument("--timeout", type=float, default=7200.0, help="seconds a run")
    p.add_argument("train_args", nargs=argparse.REMAINDER, metavar="-- TRAIN_ARGS")
    args = p.parse_args()
    args.train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    try:
        args.hs = [int(h) for h in args.outer_every.split(",") if h]
        args.lrs = [float(x) for x in args.outer_lr.split(",") if x] or [None]
        args.moms = [float(x) for x in args.outer_momentum.split(",") if x] or [None]
    except ValueError as e:
        raise UserError(f"--outer-every, --outer-lr and --outer-momentum take lists of numbers: "
                        f"{e}") from None
    if args.ranks < 2 or args.steps < 1 or not args.hs or min(args.hs) < 1:
        raise UserError("--ranks at least 2, --steps and every --outer-every at least 1")
    if not 0 <= args.sync_start < args.steps:
        raise UserError(f"--sync-start {args.sync_start}: a step before --steps {args.steps}")
    return args


def variants(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    """(name, train flags) of every diloco run: each H with each outer lr and momentum."""
    out = []
    for h in args.hs:
        for lr in args.lrs:
            for mom in args.moms:
                name, flags = f"diloco-H{h}", ["--dp-mode", "diloco", "--island-ranks", "1",
                                                "--outer-every", str(h)]
                if lr is not None:
                    name, flags = f"{name}-lr{lr:g}", [*flags, "--outer-lr", f"{lr:g}"]
                if mom is not None:
                    name, flags = f"{name}-m{mom:g}", [*flags, "--outer-momentum", f"{mom:g}"]
                out.append((name, flags))
    return out


def run(name: str, mode: list[str], args: argparse.Namespace, start: Path | None = None,
        stop: int | None = None) -> dict:
    """One run of `args.steps` (the schedule's length) through launch.sh: from step 0, or
    resumed from a copy of the run at `start` (a synchronous start: its checkpoint at
    --sync-start); `stop`: stopped and saved there."""
    out = args.out / "runs" / name
    begin = (["--resume", "auto", "--save-every", "0"] if start is not None else
             ["--resume", "never", "--overwrite", "--save-every", str(stop or 0)])
    cmd = ["bash", str(REPO / "launch.sh"), "--procs-per-node", str(args.ranks), "--",
           "--data", str(args.data), "--out", str(out), "--max-steps", str(args.steps),
           "--eval-every", str(args.eval_every), "--log-every", str(args.eval_every),
           *begin, "--wandb", "disabled", "--zero", str(args.zero), *mode,
           *(["--stop-at-step", str(stop)] if stop else []), *args.train_args]
    # beside the run, named after it whole (with_suffix would take "m0.5"'s ".5" for a suffix)
    record, log_path = out.parent / f"{name}.cmd", out.parent / f"{name}.log"
    # record: the command a finished run in OUT was run with
    done = finished(out, stop or args.steps) if record.exists() and \
        record.read_text().strip() == shlex.join(cmd) else None
    if done is not None:
        print(f"quality: {name}: finished before with the same command, read", file=sys.stderr,
              flush=True)
        return {"name": name, "mode": mode, "wall_s": done[0], "evals": done[1], "reused": True}
    print(f"quality: {name}: {shlex.join(cmd)}", file=sys.stderr, flush=True)
    record.unlink(missing_ok=True)
    if start is not None:  # the synchronous start's checkpoint, copied: resumed in this mode
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(start, out)
        (out / "bench_wall_s").unlink(missing_ok=True)
    began = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout)
    if proc.returncode != 0:
        return {"name": name, "error": f"exit {proc.returncode} (log {log_path})"}
    wall = round(time.time() - began, 1)
    (out / "bench_wall_s").write_text(f"{wall}\n")
    record.write_text(shlex.join(cmd) + "\n")
    return {"name": name, "mode": mode, "wall_s": wall, "evals": evals_of(metrics(out))}


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").open()]


def evals_of(rows: list[dict]) -> list[tuple[int, float]]:
    """(tokens seen, eval loss) of every eval a run logged."""
    return [(r["tokens_seen"], r["eval/loss"]) for r in rows if "eval/loss" in r]


def finished(out: Path, steps: int) -> tuple[float, list] | None:
    """(wall seconds, evals) of a run in `out` that reached `steps`, else None."""
    try:
        rows = metrics(out)
        wall = float((out / "bench_wall_s").read_text())
    except (OSError, ValueError):
        return None
    if not any(r.get("step") == steps and "eval/loss" in r for r in rows):
        return None
    return wall, evals_of(rows)


def table(runs: list[dict]) -> str:
    sync = next(r for r in runs if r["name"] == "sync")
    base = dict(sync["evals"])
    lines = ["| run | last eval loss | vs sync at equal tokens | mean gap over the evals | wall |",
             "|---|---|---|---|---|"]
    for r in runs:
        if "error" in r:
            lines.append(f"| {r['name']} | {r['error']} | | | |")
            continue
        tokens, loss = r["evals"][-1]
        gaps = [(x / base[t] - 1) for t, x in r["evals"] if t in base and t > 0]
        ref = base.get(tokens)
        lines.append(f"| {r['name']} | {loss:.4f} | {loss / ref - 1:+.2%} | "
                     f"{sum(gaps) / max(len(gaps), 1):+.2%} | {r['wall_s']:.0f} s |"
                     if ref else f"| {r['name']} | {loss:.4f} | - | - | {r['wall_s']:.0f} s |")
    return "\n".join(lines) + "\n"


def plot(path: Path, runs: list[dict]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in runs:
        if "error" not in r:
            xs, ys = zip(*r["evals"])
            ax.plot([x / 1e6 for x in xs], ys, "-", label=r["name"])
    ax.set_xlabel("tokens, millions")
    ax.set_ylabel("eval loss")
    ax.legend()
    ax.set_title("Synchronous against --dp-mode diloco (bench/bench_lowcomm_quality.py)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    try:
        args = parse()
    except UserError as e:
        print(f"bench_lowcomm_quality: error: {e}", file=sys.stderr)
        return 2
    (args.out / "runs").mkdir(parents=True, exist_ok=True)
    runs = [run("sync", [], args)]
    start = None
    if args.sync_start:  # DiLoCo's protocol: the islands start from synchronously trained weights
        first = run(f"sync-start{args.sync_start}", [], args, stop=args.sync_start)
        if "error" in first:
            runs.append(first)
        else:
            start = args.out / "runs" / first["name"]
    for name, flags in variants(args):
        if args.sync_start and start is None:
            break
        runs.append(run(name + (f"-from{args.sync_start}" if start else ""), flags, args,
                        start=start))
        (args.out / "quality.json").write_text(json.dumps({"runs": runs}, indent=1))
    text = table(runs)
    (args.out / "quality.json").write_text(json.dumps({"command": shlex.join(sys.argv),
                                                       "runs": runs}, indent=1))
    (args.out / "quality.md").write_text(text)
    plot(args.out / "quality.png", runs)
    print(text, end="")
    return 0 if all("error" not in r for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
