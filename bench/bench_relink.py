"""Benchmark: the host time of ZeRO-1/2's end-of-step re-linking of the weights to the flat
buffer, DeepSpeed's loop against the app's (app/runtime/patches.py `relink_only_moved`).

DeepSpeedZeroOptimizer re-points every weight's `.data` at its slice of the flat bit16 buffer
after each step (`_update_model_bit16_weights`, all parameter groups). On one H200 the profiled
ZeRO-2 step of bert-120m showed that loop as a 5.5 ms host gap (docs/benchmarks.md, "GPU:
second runs on one H200"). This times both versions on a real engine (one rank, DeepSpeed's
CPU accelerator unless a GPU is here) over the same weights, alternating, and prints the
median microseconds a step of each and their ratio:

    python bench/bench_relink.py                    # bert-120m's weights (182 tensors)
    python bench/bench_relink.py --model bert-tiny  # seconds, what CI runs
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import types
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))



def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="bert-120m", help="a preset whose weights are relinked")
    p.add_argument("--zero", type=int, choices=(1, 2), default=2)
    p.add_argument("--calls", type=int, default=20, help="timed steps a block")
    p.add_argument("--rounds", type=int, default=5, help="blocks of each, alternating")
    args = p.parse_args(argv)

    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from app.models.build import build_model
    from app.models.presets import build_config
    from app.runtime.dist import free_port
    from app.runtime.engine import initialize

    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():
        os.environ.setdefault(key, value)  # a world of one, without a launcher
    cfg = build_config(args.model, vocab_size=32768,
                       special_ids={"pad": 0, "mask": 1, "cls": 2, "sep": 3, "unk": 4})
    model = build_model(cfg, seed=0)
    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
          "train_batch_size": 1, "zero_optimization": {"stage": args.zero},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}}
    engine = initialize(model, ds, lambda step: 1.0, [{"params": list(model.parameters())}])
    opt = engine.optimizer
    groups = range(len(opt.bit16_groups))
    versions = {"deepspeed": types.MethodType(DeepSpeedZeroOptimizer._update_model_bit16_weights,
                                              opt),
                "app": opt._update_model_bit16_weights}

    def block(relink) -> float:
        start = time.perf_counter()
        for _ in range(args.calls):
            for i in groups:  # as the step calls it
                relink(i)
        return 1e6 * (time.perf_counter() - start) / args.calls

    times: dict[str, list[float]] = {name: [] for name in versions}
    for relink in versions.values():
        block(relink)  # warm-up
    for _ in range(args.rounds):
        for name, relink in versions.items():
            times[name].append(block(relink))
    n = sum(len(g) for g in opt.bit16_groups)
    ds_us, app_us = (statistics.median(times[k]) for k in ("deepspeed", "app"))
    print(f"{args.model}, ZeRO-{args.zero}, {n} weights in {len(groups)} group(s): "
          f"DeepSpeed's relink {ds_us:,.0f} us a step, the app's {app_us:,.0f} us "
          f"({app_us / ds_us:.3f} x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
