"""Benchmark: what telemetry and the fault guards cost, against the training step they watch.

The app's own Trainer (real DeepSpeed engine, one rank) trains a model for a while; in the same
process the instrumentation of a step is then timed on its own, with the trainer's own objects:

- per micro step: the timing window's data-wait and forward contexts (with the device clock's
  events), and the three watchdog beats;
- per step: the anomaly monitor's observation (device arithmetic, no sync) and the train state's
  advance;
- per log interval: the trainer's check-point gather (the device sync, one copy of the device
  figures and the anomaly marks to the host, the memory probe, the one all-gather of every
  rank's row) and telemetry's interval figures (divided by --log-every).

Overhead = (per-step instrumentation + per-interval work / log_every) / the median step time,
all measured in the same run. No host-device sync is added per step (tests/test_gpu_path.py
checks that with a probe); on an accelerator the step is far longer than here, the overhead the
same host microseconds.

    python bench/bench_telemetry.py --data runs/demo/dataset-wordpiece --model bert-120m
"""
from __future__ import annotations

import argparse
import atexit
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from app.build import build  # noqa: E402
from app.checkpoint.train_state import TrainState  # noqa: E402
from app.config import TrainConfig  # noqa: E402
from app.runtime.device import synchronize  # noqa: E402
from app.telemetry import figures as telemetry  # noqa: E402
from app.trainer import FIGURES  # noqa: E402


def per_call(fn, repeats: int) -> float:
    """Median seconds of one call of `fn` over 5 rounds of `repeats` calls."""
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        rounds.append((time.perf_counter() - t0) / repeats)
    return statistics.median(rounds)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--model", default="bert-tiny")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--steps", type=int, default=30, help="timed training steps")
    ap.add_argument("--log-every", type=int, default=10)
    args = ap.parse_args()

    scratch = tempfile.mkdtemp(prefix="bench_telemetry_")
    atexit.register(shutil.rmtree, scratch, True)  # the throwaway run: nothing left in /tmp
    out = Path(scratch) / "run"
    out.mkdir()
    cfg = TrainConfig(data=args.data, out=out, model=args.model, seq_len=args.seq_len,
                      micro_batch=args.micro_batch, grad_accum=args.grad_accum,
                      max_steps=args.steps + 5, log_every=10 ** 9, wandb="disabled",
                      num_workers=0, hang_timeout=600)
    built = build(cfg)
    trainer, state, n_params, device = built.trainer, built.state, built.n_params, built.plan.device

    for _ in range(3):  # warm-up: allocator, first batches
        trainer.train_step()
    step_times = []
    for _ in range(args.steps):
        synchronize()
        t0 = time.perf_counter()
        trainer.train_step()
        synchronize()
        step_times.append(time.perf_counter() - t0)
    step = statistics.median(step_times)

    window, beat = trainer.window, trainer.guards.watchdog.beat
    recovery, dev = trainer.guards.recovery, trainer.device
    loss = torch.tensor(3.0, device=dev)

    def micro_step():
        beat("waiting for data")
        with window.waiting_for_data():
            pass
        beat("in forward/backward")
        with window.forward():
            pass
        beat("in the optimizer step")

    probe_state = TrainState()
    counter = iter(range(10 ** 9))

    def step_work():
        recovery.observe(state.step + 1 + next(counter), 0, loss)
        probe_state.advance(trainer.global_batch, cfg.seq_len, frozenset())

    def interval_work():
        rows = trainer.gather(figures=True)
        telemetry.interval([r[FIGURES:] for r in rows], args.log_every, trainer.shape)

    micro = per_call(micro_step, 2000)
    per_step = per_call(step_work, 2000)
    recovery.monitor.reset()
    interval = per_call(interval_work, 200)
    overhead = micro * args.grad_accum + per_step + interval / args.log_every
    trainer.guards.watchdog.close()

    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"torch {torch.__version__}, device {device.name}")
    print(f"model {args.model} ({n_params / 1e6:.1f}M), seq {args.seq_len}, micro batch "
          f"{args.micro_batch} x grad accum {args.grad_accum}, log every {args.log_every}")
    print("| part | us per step | share of the step |")
    print("| --- | --- | --- |")
    rows = [("training step (median of %d)" % args.steps, step),
            ("window contexts + watchdog beats (x grad accum)", micro * args.grad_accum),
            ("anomaly monitor + train state", per_step),
            ("log interval (sync, all-gather, figures, memory) / log_every",
             interval / args.log_every),
            ("**telemetry and guards, total**", overhead)]
    for name, seconds in rows:
        print(f"| {name} | {seconds * 1e6:,.1f} | {seconds / step:.4%} |")
    verdict = "under" if overhead < 0.01 * step else "OVER"
    print(f"overhead: {overhead / step:.4%} of the step ({verdict} the 1% target)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
