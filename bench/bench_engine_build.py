"""The engine's build with the imported objects frozen out of the collector's way (what
app/runtime/engine.py does before `deepspeed.initialize`) against the same build without the freeze.

    python bench/bench_engine_build.py --data DATASET --model bert-tiny --runs 2

DeepSpeed's BF16_Optimizer (bf16 at ZeRO 0-1) runs `gc.collect()` twice per parameter group while
it builds (docs/design.md, "Start-up"). Each run here is a process of its own (one rank, this box's
accelerator; a fork of this one, which has imported nothing of the app's, so the run imports it as
a fresh process would) that builds a bf16 ZeRO-1 `app train` run with `app.build.build` and reports
the build's seconds, `app.runtime.engine.initialize`'s, and how many `gc.collect()` calls there
were and their seconds; "without" replaces `gc.freeze` by a no-op in that process. The two
alternate, run by run. Prints a markdown table and the ratio with/without of the medians.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench._forking import fork_call, wait_exit  # noqa: E402


def measure(data: str, out: str, model: str, freeze: bool) -> dict:
    """In this process (a run's own): build the run, time it and its collections."""
    import gc
    import time

    # A parent that has imported the app already and frozen it (a test's warm process) hands
    # its objects back to the collector: both sides start as a fresh process's imports leave them
    gc.unfreeze()
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      WANDB_MODE="disabled")
    from app.runtime.dist import free_port
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    calls: list[float] = []
    collect = gc.collect

    def timed_collect(*args):
        start = time.perf_counter()
        found = collect(*args)
        calls.append(time.perf_counter() - start)
        return found

    gc.collect = timed_collect
    if not freeze:
        gc.freeze = lambda: None
    import app.build
    from app.config import TrainConfig, add_arguments

    engine_s: list[float] = []
    initialize = app.build.initialize

    def timed_initialize(*args, **kwargs):
        start = time.perf_counter()
        engine = initialize(*args, **kwargs)
        engine_s.append(time.perf_counter() - start)
        return engine

    app.build.initialize = timed_initialize
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cfg = TrainConfig.from_args(parser.parse_args([
        "--data", data, "--out", out, "--model", model, "--seq-len", "64", "--micro-batch", "1",
        "--precision", "bf16", "--zero", "1", "--wandb", "disabled", "--num-workers", "0",
        "--max-steps", "1", "--eval-samples", "1"]))
    start = time.perf_counter()
    app.build.build(cfg)
    return {"build_s": time.perf_counter() - start, "initialize_s": engine_s[0],
            "collect_calls": len(calls), "collect_s": sum(calls),
            "objects_tracked": len(gc.get_objects())}


def one_run(args: argparse.Namespace, freeze: bool, work: Path, k: int) -> dict:
    """One side's build in a forked child, its output in a log beside its figures."""
    name = f"run-{k}-{'with' if freeze else 'without'}"
    log, result = work / f"{name}.log", work / f"{name}.json"

    def build() -> None:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        result.write_text(json.dumps(measure(args.data, str(work / name), args.model, freeze)))

    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        code = wait_exit(fork_call(build, output=fd))
    finally:
        os.close(fd)
    if code != 0 or not result.is_file():
        sys.exit(f"bench_engine_build: a run failed (exit {code}):\n"
                 f"{log.read_text(errors='replace')[-3000:]}")
    return json.loads(result.read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="a prepared dataset (data_tools prepare)")
    p.add_argument("--model", default="bert-tiny", help="a preset (default bert-tiny)")
    p.add_argument("--runs", type=int, default=2, help="runs of each side (default 2)")
    p.add_argument("--json", help="also write the runs and medians here")
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error("--runs: at least 1")
    runs: dict[str, list[dict]] = {"without": [], "with": []}
    with tempfile.TemporaryDirectory(prefix="engine-build-") as tmp:
        for k in range(args.runs):
            for side in ("without", "with"):
                runs[side].append(one_run(args, side == "with", Path(tmp), k))
                r = runs[side][-1]
                print(f"run {k + 1}/{args.runs} {side}: build {r['build_s']:.2f} s, "
                      f"{r['collect_calls']} collections {r['collect_s']:.2f} s",
                      file=sys.stderr, flush=True)
    median = {side: {key: statistics.median(r[key] for r in rs) for key in rs[0]}
              for side, rs in runs.items()}
    print(f"{args.model}, bf16 ZeRO-1, 1 rank, median of {args.runs}:\n")
    print("| the imported objects | build s | initialize s | gc.collect calls | gc.collect s "
          "| objects a collection walks after |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for side in ("without", "with"):
        m = median[side]
        label = "frozen" if side == "with" else "not frozen"
        print(f"| {label} | {m['build_s']:.2f} | {m['initialize_s']:.2f} | "
              f"{m['collect_calls']:.0f} | {m['collect_s']:.2f} | {m['objects_tracked']:,.0f} |")
    ratio = median["with"]["build_s"] / median["without"]["build_s"]
    print(f"\nbuild with/without: {ratio:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "median": median,
                                               "build_ratio": ratio}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
