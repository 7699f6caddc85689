"""Benchmark: the app's training step against a plain PyTorch step, in one process, alternating.

`bench_train.py` runs each side in its own process one after the other, so on a shared machine a
burst of someone else's load lands on one side. Here both sides live in one process and take
turns in blocks of `--block` steps (`--rounds` times, the order alternating), so load hits both
alike; the medians of the blocks' ms/step are compared. The app side is the app's own Trainer
(app.build's `build`, the real DeepSpeed engine, one rank, ZeRO-0, fp32, with its
telemetry and guards) and its loader; the plain side is the same model (preset, config, seed),
on the same loader's batches, with torch's AdamW (the optimizer the app's engine runs on CPU), its
LR schedule and clipping at 1.0, and a `.item()` every `--log-every` steps as the app.

    python bench/bench_step.py --data DIR                          # bert-tiny, MLM
    python bench/bench_step.py --data DIR --model gpt-tiny --objective clm \\
        --model-arg n_layer=4 --model-arg n_embd=256 --model-arg n_head=4   (one command)
    add --profile to print torch.profiler's table of one app step and one plain step
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from app.build import build  # noqa: E402
from app.config import TrainConfig  # noqa: E402
from app.schedule import schedule_fn  # noqa: E402
from bench.bench_train import (  # noqa: E402
    BETAS,
    EPS,
    LR,
    MIN_LR_RATIO,
    WEIGHT_DECAY,
    _model_and_batches,
    model_arguments,
)
from data_tools.manifest import load_manifest  # noqa: E402


def alternate(sides: dict[str, Callable[[], None]], block: int, rounds: int,
              sync: Callable[[], None] = lambda: None) -> dict[str, list[float]]:
    """ms/step of each side's blocks: `rounds` rounds of one `block`-step block a side, the order
    reversed every other round, so a burst of outside load lands on both sides alike. `sync`
    waits for queued device work (torch.cuda.synchronize on a GPU) before each clock read."""
    blocks: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(rounds):
        for name in (sides if r % 2 == 0 else list(sides)[::-1]):
            sync()
            t0 = time.perf_counter()
            for _ in range(block):
                sides[name]()
            sync()
            blocks[name].append(1000 * (time.perf_counter() - t0) / block)
    return blocks


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_arguments(p)
    p.add_argument("--block", type=int, default=5, help="steps a turn")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    args.num_workers, args.dropout, args.seed = 0, None, 0
    steps = 2 * args.block * args.rounds + 20
    os.environ.setdefault("WANDB_MODE", "disabled")
    scratch = tempfile.mkdtemp(prefix="bench_step_")
    atexit.register(shutil.rmtree, scratch, True)  # the throwaway run: nothing left in /tmp
    out = Path(scratch) / "run"
    out.mkdir()
    cfg = TrainConfig(data=args.data, out=out, model=args.model, objective=args.objective,
                      seq_len=args.seq_len, micro_batch=args.micro_batch, max_steps=steps,
                      log_every=args.log_every, wandb="disabled", num_workers=0,
                      hang_timeout=3600, model_arg=args.model_arg)
    trainer = build(cfg).trainer

    model, loader = _model_and_batches(args, load_manifest(args.data))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS,
                            weight_decay=WEIGHT_DECAY)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule_fn(
        warmup_steps=max(1, steps // 20), total_steps=steps, min_lr_ratio=MIN_LR_RATIO))
    batches = iter(loader)
    done = [0]

    def plain_step():
        loss = model(**next(batches)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        done[0] += 1
        if done[0] % args.log_every == 0:
            loss.item()

    sides = {"app": trainer.train_step, "plain": plain_step}
    for step in sides.values():  # warm-up
        for _ in range(3):
            step()
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        for name, step in sides.items():
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                step()
            print(f"== {name}: one step\n"
                  + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    blocks = alternate(sides, args.block, args.rounds)
    app, plain = (statistics.median(blocks[k]) for k in ("app", "plain"))
    print(json.dumps({"model": args.model, "model_args": args.model_arg,
                      "seq_len": args.seq_len, "micro_batch": args.micro_batch,
                      "threads": torch.get_num_threads(), "blocks_ms": blocks,
                      "app_ms": round(app, 2), "plain_ms": round(plain, 2),
                      "ratio_app_over_plain": round(app / plain, 3)}))


if __name__ == "__main__":
    main()
