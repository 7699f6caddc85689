"""Benchmark: a causal-LM training step's peak memory and time, the app's chunked loss against
transformers' stock one.

Both sides run forward and backward of the same GPT-2 (a preset, gpt-tiny by default, with the
vocabulary given: 50,257 as GPT-2's), same seed and batches, fp32 on CPU:
- stock: transformers' GPT2LMHeadModel as built for export (`build_model(config)`): the full
  [batch, seq, vocab] logits, `ForCausalLMLoss` on them, its inference cache on;
- chunked: the model the app trains (`build_model(config, for_training=True)`,
  app.models.heads.CausalLossGPT2LMHeadModel): the head and cross-entropy in chunks of rows
  (app.models.losses), no cache.
Each side runs in a fresh process (`--side`), alternating, `--repeats` times. Peak memory is
the process's resident high-water mark over the steps (the kernel's VmHWM, reset after the
model is built where /proc/self/clear_refs allows, else the process's whole life) and the step's
own share of it (peak minus the resident set before the first step); step time is the median
over the steps after the first. The medians over the repeats are compared as chunked / stock.

    python bench/bench_clm_loss.py                      # vocab 50,257, seq 512, micro batch 4
    python bench/bench_clm_loss.py --model gpt-125m --micro-batch 2 --repeats 1
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from app.models import losses  # noqa: E402
from app.models.build import build_model  # noqa: E402
from app.models.presets import build_config, parse_overrides  # noqa: E402

SIDES = ("stock", "chunked")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt-tiny", help="a GPT preset (default gpt-tiny)")
    p.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--vocab", type=int, default=50257, help="vocabulary size (default 50,257)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=4, help="steps per process (the first is warm-up)")
    p.add_argument("--repeats", type=int, default=2, help="processes per side, alternating")
    p.add_argument("--chunk-mib", type=int, default=None,
                   help="the chunked side's fp32 logits per chunk in MiB (default: "
                        "app.models.losses.CHUNK_BYTES)")
    p.add_argument("--json", type=Path, help="write the figures here as JSON too")
    p.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # one side, in this process
    return p.parse_args(argv)


def resident_kib(field: str) -> int:
    """VmRSS or VmHWM of this process in KiB (/proc), else the peak from getrusage."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def reset_high_water() -> bool:
    """Start VmHWM again from the current resident set (Linux >= 4.0)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def one_side(args: argparse.Namespace) -> dict:
    """Build the side's model, run its steps; its figures."""
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or len(os.sched_getaffinity(0))))
    if args.chunk_mib:
        losses.CHUNK_BYTES = args.chunk_mib * 2**20
    config = build_config(args.model, vocab_size=args.vocab,
                          special_ids={"eos_token_id": args.vocab - 1},
                          overrides=parse_overrides(args.model_arg), dropout=0.0)
    model = build_model(config, seed=0, for_training=args.side == "chunked").train()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.micro_batch, args.seq_len), generator=gen)
    batch = {"input_ids": ids, "labels": ids.clone()}
    reset = reset_high_water()
    before = resident_kib("VmRSS")
    times, loss = [], None
    for _ in range(args.steps):
        start = time.perf_counter()
        out = model(**batch)
        out.loss.backward()
        model.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        loss = float(out.loss.detach())
        del out
    peak = resident_kib("VmHWM")
    return {"side": args.side, "loss": loss, "rss_before_mib": before / 1024,
            "peak_mib": peak / 1024, "peak_step_mib": (peak - before) / 1024,
            "high_water_reset": reset,
            "step_s": statistics.median(times[1:] or times),
            "chunk_rows": losses.chunk_rows(args.vocab) if args.side == "chunked" else None}


def run_side(side: str, argv: list[str]) -> dict:
    proc = subprocess.run([sys.executable, __file__, *argv, "--side", side], cwd=REPO,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"the {side} side failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def median_of(runs: list[dict]) -> dict:
    keys = ("loss", "rss_before_mib", "peak_mib", "peak_step_mib", "step_s")
    return {**runs[0], **{k: statistics.median(r[k] for r in runs) for k in keys}}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.side:
        print(json.dumps(one_side(args)))
        return
    runs: dict[str, list[dict]] = {s: [] for s in SIDES}
    for _ in range(args.repeats):
        for side in SIDES:
            runs[side].append(run_side(side, argv))
    result = {s: median_of(r) for s, r in runs.items()}
    stock, chunked = result["stock"], result["chunked"]
    result.update(
        peak_ratio=chunked["peak_mib"] / stock["peak_mib"],
        peak_step_ratio=chunked["peak_step_mib"] / max(stock["peak_step_mib"], 1e-9),
        step_time_ratio=chunked["step_s"] / stock["step_s"],
        machine=f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores, torch "
                f"{torch.__version__}",
        setup=f"{' '.join([args.model, *args.model_arg])} vocab {args.vocab} seq {args.seq_len} "
              f"micro batch {args.micro_batch}, fp32, {args.steps} steps x {args.repeats} "
              f"processes a side")
    print(result["machine"] + "; " + result["setup"])
    for side in SIDES:
        r = result[side]
        print(f"{side:8s} loss {r['loss']:.5f}  peak {r['peak_mib']:8.1f} MiB  of which the step "
              f"{r['peak_step_mib']:8.1f} MiB  step {r['step_s'] * 1e3:8.1f} ms"
              + (f"  ({r['chunk_rows']} rows a chunk)" if r["chunk_rows"] else ""))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    print(f"chunked / stock: peak {result['peak_ratio']:.3f}, the step's own peak "
          f"{result['peak_step_ratio']:.3f}, step time {result['step_time_ratio']:.3f}")


if __name__ == "__main__":
    main()
