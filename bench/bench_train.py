"""Benchmark: the app's step time against a plain PyTorch loop, and the data-wait share.

Both sides train the same model (same preset, config and seed), on the same batches (the app's
own loader, same workers), with the same optimizer (AdamW, same hyper-parameters and LR schedule),
precision (fp32 on CPU) and gradient clipping (1.0). The app runs for real: `launch.sh` starts
`python -m app train` through the deepspeed launcher, one rank; its per-step time and data-wait
share are read from RUN_DIR/metrics.jsonl. The reference is a bare loop in this process.
The first log window of each side (warm-up: allocator, first batches) is left out; the two sides
alternate, `--repeats` times, and the medians are compared.

    python bench/bench_train.py --data runs/demo/dataset-wordpiece            # bert-tiny
    python bench/bench_train.py --data ... --model-arg hidden_size=256
        --model-arg num_hidden_layers=4   (one command)
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from app.data import DataSpec, build_train_loader, default_num_workers  # noqa: E402
from app.model import build_config, build_model, parse_overrides  # noqa: E402
from app.schedule import schedule_fn  # noqa: E402
from data_tools.manifest import load_manifest  # noqa: E402

# The app's defaults (app/config.py) that the reference must match.
LR, BETAS, EPS, WEIGHT_DECAY, MIN_LR_RATIO = 1e-3, (0.9, 0.98), 1e-8, 0.01, 0.1


def special_ids(manifest: dict) -> dict:
    return {"pad_token_id": manifest.get("pad_token_id")}


def reference_loop(args, manifest: dict) -> dict:
    """A bare PyTorch loop: forward, backward, clip, AdamW step, LR schedule."""
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    config = build_config(args.model, vocab_size=manifest["vocab_size"],
                          special_ids=special_ids(manifest),
                          overrides=parse_overrides(args.model_arg), dropout=args.dropout)
    # the same module the app trains (for MLM: the vocabulary head on labelled positions only)
    model = build_model(config, seed=args.seed, for_training=not args.full_head)
    model.train()
    # one parameter group, as the app hands model.parameters() to deepspeed.initialize
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS,
                            weight_decay=WEIGHT_DECAY)
    warmup = max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule_fn(
        warmup_steps=warmup, total_steps=args.steps, min_lr_ratio=MIN_LR_RATIO))
    spec = DataSpec(args.data, "train", args.seq_len, args.objective, seed=args.seed)
    loader = iter(build_train_loader(spec, micro_batch=args.micro_batch,
                                     global_batch=args.micro_batch, dp_rank=0, dp_size=1,
                                     consumed_samples=0, num_workers=args.num_workers))
    step_times, waits = [], []
    for step in range(args.steps):
        t0 = time.perf_counter()
        batch = next(loader)
        t1 = time.perf_counter()
        if args.full_head and "mlm_positions" in batch:  # the full head takes full-length labels
            labels = torch.full_like(batch["input_ids"], -100)
            for row, pos, lab in zip(labels, batch["mlm_positions"], batch["mlm_labels"]):
                row[pos[lab != -100]] = lab[lab != -100]
            batch = {"input_ids": batch["input_ids"], "labels": labels}
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % args.log_every == args.log_every - 1:
            loss.item()  # the app syncs at log steps too
        step_times.append(time.perf_counter() - t0)
        waits.append(t1 - t0)
    skip = args.log_every  # the app's first log window is skipped too
    return {"step_time_ms": 1000 * statistics.mean(step_times[skip:]),
            "data_wait_pct": 100 * sum(waits[skip:]) / sum(step_times[skip:])}


def reference_run(args) -> dict:
    """The reference loop in a process of its own, so neither side shares a process with the
    other's leftovers (loader workers, spinning OpenMP threads)."""
    cmd = [sys.executable, __file__, "--reference-only", *sys.argv[1:]]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"reference loop failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def app_run(args) -> dict:
    """`launch.sh -- app train` on one rank; figures from metrics.jsonl, first window left out."""
    with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
        run_dir = Path(tmp) / "run"
        cmd = ["bash", str(REPO / "launch.sh"), "--procs-per-node", "1",
               "--master-port", str(args.port), "--",
               "--data", str(args.data), "--out", str(run_dir), "--model", args.model,
               "--objective", args.objective, "--seq-len", str(args.seq_len),
               "--micro-batch", str(args.micro_batch), "--max-steps", str(args.steps),
               "--log-every", str(args.log_every), "--num-workers", str(args.num_workers),
               "--seed", str(args.seed), "--wandb", "disabled", "--resume", "never",
               "--save-every", "0", "--eval-every", str(10 * args.steps)]
        for item in args.model_arg:
            cmd += ["--model-arg", item]
        if args.dropout is not None:
            cmd += ["--dropout", str(args.dropout)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"app train failed:\n{proc.stderr[-3000:]}")
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        train = [r for r in rows if "perf/step_time_ms" in r][1:]  # first window: warm-up
        steps = [r["step"] for r in train]
        widths = [b - a for a, b in zip([args.log_every] + steps, steps)]
        total = sum(widths)
        return {"step_time_ms": sum(r["perf/step_time_ms"] * w for r, w in zip(train, widths))
                / total,
                "data_wait_pct": sum(r["perf/data_wait_pct"] * w for r, w in zip(train, widths))
                / total}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, required=True)
    p.add_argument("--model", default="bert-tiny")
    p.add_argument("--model-arg", action="append", default=[])
    p.add_argument("--objective", default="mlm")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--num-workers", type=int, default=default_num_workers())
    p.add_argument("--dropout", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--port", type=int, default=29655)
    p.add_argument("--full-head", action="store_true",
                   help="reference runs HF's BertForMaskedLM head on every position (shows what "
                        "the app's labelled-positions head saves; not the overhead comparison)")
    p.add_argument("--json", type=Path, help="also write the figures here")
    p.add_argument("--reference-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    manifest = load_manifest(args.data)
    if args.reference_only:
        print(json.dumps(reference_loop(args, manifest)))
        return

    ref, app = [], []
    for i in range(args.repeats):
        order = (("ref", "app") if i % 2 == 0 else ("app", "ref"))
        for side in order:
            if side == "ref":
                ref.append(reference_run(args))
            else:
                app.append(app_run(args))
            last = (ref if side == "ref" else app)[-1]
            print(f"repeat {i + 1} {side}: {last['step_time_ms']:.1f} ms/step, "
                  f"data wait {last['data_wait_pct']:.2f}%", flush=True)
    ref_ms = statistics.median(r["step_time_ms"] for r in ref)
    app_ms = statistics.median(r["step_time_ms"] for r in app)
    result = {
        "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores, "
                   f"torch {torch.__version__}",
        "model": args.model, "model_args": args.model_arg, "seq_len": args.seq_len,
        "micro_batch": args.micro_batch, "steps": args.steps, "num_workers": args.num_workers,
        "reference_head": "full" if args.full_head else "same as the app",
        "reference_step_time_ms": round(ref_ms, 2), "app_step_time_ms": round(app_ms, 2),
        "ratio_app_over_reference": round(app_ms / ref_ms, 3),
        "app_data_wait_pct": round(statistics.median(r["data_wait_pct"] for r in app), 3),
        "reference_data_wait_pct": round(statistics.median(r["data_wait_pct"] for r in ref), 3),
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
