"""Where a ZeRO-1/2 step's time goes across nodes, from the reducer's and the gather's traces.

Run a training with both trace files set (every rank appends one JSON line per backward and one
per forward to `PATH.rankN`), then read rank 0's:

    DSPRETRAIN_TEST_OVERLAP_TRACE=/tmp/t/red DSPRETRAIN_TEST_GATHER_TRACE=/tmp/t/gat \\
      python bench/netsim.py run --nodes 2 --rate 280mbit --cores-per-node 1 --threads 1 -- \\
      --zero 1 ...
    python bench/overlap_timeline.py /tmp/t/red.rank0 /tmp/t/gat.rank0

Per step (medians over the steps after the first `--skip`, with min and max), in ms:

    backward      first gradient ready -> end of backward (app/runtime/overlap.py's reducer)
    tail          end of backward -> last reduction bucket done (the reduction left exposed)
    step          last bucket done -> the step's first weight-gather launch (the optimizer step)
    forward       forward starts -> its last gather chunk done (app/runtime/gather.py)
    to_backward   that last chunk -> the next backward's first gradient (rest of forward, loss)

docs/benchmarks.md "ZeRO-1's plan error, traced" reads it against `app plan`'s windows.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from app.runtime.gather import TRACE_ENV as GATHER_TRACE_ENV  # noqa: E402
from app.runtime.overlap import TRACE_ENV as REDUCER_TRACE_ENV  # noqa: E402


def read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def times(line: dict[str, Any], kind: str) -> list[float]:
    return [e[2] for e in line["events"] if e[0] == kind]


def timeline(reducer: list[dict[str, Any]], gather: list[dict[str, Any]]) -> list[dict[str, float]]:
    """One row per backward: its phases (module docstring) in ms; the gather that follows it
    (the first one launched after its last bucket is done) gives step, forward, to_backward."""
    rows = []
    for i, red in enumerate(reducer):
        ready, end, done = times(red, "ready"), times(red, "backward_end"), times(red, "done")
        if not (ready and end and done):
            continue
        row = {"backward": 1000 * (end[0] - min(ready)), "tail": 1000 * (max(done) - end[0])}
        after = [g for g in gather if times(g, "launch") and min(times(g, "launch")) > max(done)]
        if after:
            g = after[0]
            launch, forward, chunks = times(g, "launch"), times(g, "forward"), times(g, "done")
            row["step"] = 1000 * (min(launch) - max(done))
            if forward and chunks:
                row["forward"] = 1000 * (max(chunks) - forward[0])
                if i + 1 < len(reducer) and times(reducer[i + 1], "ready"):
                    row["to_backward"] = 1000 * (min(times(reducer[i + 1], "ready")) - max(chunks))
        rows.append(row)
    return rows


def summary(rows: list[dict[str, float]], skip: int) -> dict[str, dict[str, float]]:
    out = {}
    for key in ("backward", "tail", "step", "forward", "to_backward"):
        values = [r[key] for r in rows[skip:] if key in r]
        if values:
            out[key] = {"median": statistics.median(values), "min": min(values),
                        "max": max(values), "steps": len(values)}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/overlap_timeline.py",
                                description=__doc__.split("\n")[0])
    p.add_argument("reducer", type=Path, help=f"${REDUCER_TRACE_ENV}.rank0: the reducer's trace")
    p.add_argument("gather", type=Path, nargs="?",
                   help=f"${GATHER_TRACE_ENV}.rank0: the gather's trace (step, forward)")
    p.add_argument("--skip", type=int, default=3, help="first steps left out (default 3)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    for path in (args.reducer, args.gather):
        if path is not None and not path.is_file():
            print(f"overlap_timeline.py: error: {path}: no such trace file", file=sys.stderr)
            return 2
    rows = timeline(read(args.reducer), read(args.gather) if args.gather else [])
    result = summary(rows, args.skip)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    for key, s in result.items():
        print(f"{key:12s} {s['median']:7.1f} ms  (min {s['min']:.1f}, max {s['max']:.1f}; "
              f"{s['steps']} steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
