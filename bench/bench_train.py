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

`--others hf,lightning --python VENV/bin/python` adds two more sides (each in its own process,
under that interpreter, where `accelerate` and `lightning` are installed: they are not the
project's dependencies): the Hugging Face Trainer with DeepSpeed ZeRO-0 (the same DeepSpeed
config as the app's zero0.json, filled the same way) and a Lightning loop, on the same model,
batches, optimizer, schedule and clipping; their step time from a callback around each step.
For a causal LM they train transformers' own GPT2LMHeadModel (its loss, its cache: what users of
those tools run; the same weights), `--others-model app` gives them the app's training model.
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

from app import child_pythonpath  # noqa: E402
from app.data.loader import DataSpec, build_train_loader, default_num_workers  # noqa: E402
from app.models.build import build_model  # noqa: E402
from app.models.presets import build_config, parse_overrides  # noqa: E402
from app.schedule import schedule_fn  # noqa: E402
from data_tools.manifest import load_manifest  # noqa: E402

# The app's defaults (app/config.py) that the reference must match.
LR, BETAS, EPS, WEIGHT_DECAY, MIN_LR_RATIO = 1e-3, (0.9, 0.98), 1e-8, 0.01, 0.1


def special_ids(manifest: dict) -> dict:
    return {"pad_token_id": manifest.get("pad_token_id")}


def reference_loop(args, manifest: dict) -> dict:
    """A bare PyTorch loop: forward, backward, clip, AdamW step, LR schedule."""
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or len(os.sched_getaffinity(0))))
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


def reference_run(args, side: str = "ref") -> dict:
    """A non-app side in a process of its own, so neither side shares a process with the
    other's leftovers (loader workers, spinning OpenMP threads)."""
    python = sys.executable if side == "ref" else str(args.python)
    cmd = [python, __file__, "--side-only", side, *sys.argv[1:]]
    env = {**os.environ, "PYTHONPATH": child_pythonpath()}
    if side == "hf":  # the Trainer's DeepSpeed needs a process group: a world of one
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(args.port + 1))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.exit(f"{side} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _model_and_batches(args, manifest: dict, others: bool = False):
    """The model a side trains and an iterator over the app's batches (as the reference loop
    builds). The model: for an --others side (`others`) with `--others-model stock` and the
    causal objective, the transformers class a user of that tool trains (GPT2LMHeadModel with its
    own loss and its inference cache on, as transformers configures it), built from the same
    config and seed (the same weights); else the app's training model (its chunked loss; for MLM
    always: its batches carry the masked positions only the app's sparse head takes)."""
    config = build_config(args.model, vocab_size=manifest["vocab_size"],
                          special_ids=special_ids(manifest),
                          overrides=parse_overrides(args.model_arg), dropout=args.dropout)
    stock = others and args.others_model == "stock" and args.objective == "clm"
    model = build_model(config, seed=args.seed, for_training=not stock)
    spec = DataSpec(args.data, "train", args.seq_len, args.objective, seed=args.seed)
    loader = build_train_loader(spec, micro_batch=args.micro_batch, global_batch=args.micro_batch,
                                dp_rank=0, dp_size=1, consumed_samples=0,
                                num_workers=args.num_workers)
    return model, loader


class _Batches(torch.utils.data.IterableDataset):
    """The app's micro batches as an iterable DataLoader source (batch_size=None)."""

    def __init__(self, loader):
        self.loader = loader

    def __iter__(self):
        return iter(self.loader)


def _figures(step_times: list[float], waits: list[float] | None, skip: int) -> dict:
    out = {"step_time_ms": 1000 * statistics.mean(step_times[skip:])}
    if waits:
        out["data_wait_pct"] = 100 * sum(waits[skip:]) / sum(step_times[skip:])
    return out


def hf_trainer_loop(args, manifest: dict) -> dict:
    """transformers.Trainer with DeepSpeed ZeRO-0 (ds_configs/zero0.json, its "auto" fields
    filled by the Trainer itself), AdamW from the config, the same schedule and clipping."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    model, loader = _model_and_batches(args, manifest, others=True)
    ds = json.loads((REPO / "ds_configs" / "zero0.json").read_text())
    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            times.append(time.perf_counter() - self.t0)

    class BatchTrainer(Trainer):  # the app's batches, as they come
        def get_train_dataloader(self):
            return torch.utils.data.DataLoader(_Batches(loader), batch_size=None)

    with tempfile.TemporaryDirectory(prefix="bench-hf-") as tmp:
        targs = TrainingArguments(
            output_dir=tmp, max_steps=args.steps, per_device_train_batch_size=args.micro_batch,
            learning_rate=LR, adam_beta1=BETAS[0], adam_beta2=BETAS[1], adam_epsilon=EPS,
            weight_decay=WEIGHT_DECAY, lr_scheduler_type="cosine_with_min_lr",
            lr_scheduler_kwargs={"min_lr_rate": MIN_LR_RATIO},
            warmup_steps=max(1, args.steps // 20),
            max_grad_norm=1.0, logging_steps=args.log_every, report_to=[], save_strategy="no",
            deepspeed=ds, use_cpu=True, dataloader_num_workers=0, seed=args.seed,
            disable_tqdm=True)
        BatchTrainer(model=model, args=targs, callbacks=[Clock()]).train()
    return _figures(times, None, args.log_every)


def lightning_loop(args, manifest: dict) -> dict:
    """A Lightning loop: LightningModule.training_step, AdamW and the same LambdaLR schedule,
    gradient_clip_val 1.0, CPU, no logger, checkpoints or progress bar."""
    import lightning as L

    model, loader = _model_and_batches(args, manifest, others=True)
    times: list[float] = []
    warmup = max(1, args.steps // 20)

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model

        def training_step(self, batch, i):
            loss = self.model(**batch).loss
            if i % args.log_every == args.log_every - 1:
                loss.item()  # a sync at log steps, as the app
            return loss

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.model.parameters(), lr=LR, betas=BETAS, eps=EPS,
                                    weight_decay=WEIGHT_DECAY)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule_fn(
                warmup_steps=warmup, total_steps=args.steps, min_lr_ratio=MIN_LR_RATIO))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    class Clock(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, i):
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, module, outputs, batch, i):
            times.append(time.perf_counter() - self.t0)

    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=args.steps,
                        gradient_clip_val=1.0, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[Clock()], num_sanity_val_steps=0)
    batches = torch.utils.data.DataLoader(_Batches(loader), batch_size=None)
    trainer.fit(Module(), train_dataloaders=batches)
    return _figures(times, None, args.log_every)


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


def model_arguments(p: argparse.ArgumentParser) -> None:
    """The flags every step benchmark shares: data, model and batch geometry."""
    p.add_argument("--data", type=Path, required=True)
    p.add_argument("--model", default="bert-tiny")
    p.add_argument("--model-arg", action="append", default=[])
    p.add_argument("--objective", default="mlm")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=16)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_arguments(p)
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
    p.add_argument("--others", default="", help="more sides, comma-separated: hf, lightning")
    p.add_argument("--python", type=Path, default=Path(sys.executable),
                   help="interpreter for --others (with accelerate and lightning installed)")
    p.add_argument("--others-model", choices=("stock", "app"), default="stock",
                   help="the model --others train for a causal LM: stock = transformers' own class "
                        "and loss, as users of the HF Trainer or Lightning run it (default); app "
                        "= the app's training model (chunked loss, no cache)")
    p.add_argument("--side-only", help=argparse.SUPPRESS)
    args = p.parse_args()
    manifest = load_manifest(args.data)
    if args.side_only:
        loops = {"ref": reference_loop, "hf": hf_trainer_loop, "lightning": lightning_loop}
        print(json.dumps(loops[args.side_only](args, manifest)))
        return

    sides = ["ref", "app", *[o for o in args.others.split(",") if o]]
    got: dict[str, list[dict]] = {side: [] for side in sides}
    for i in range(args.repeats):
        for side in (sides if i % 2 == 0 else sides[::-1]):
            got[side].append(app_run(args) if side == "app" else reference_run(args, side))
            last = got[side][-1]
            print(f"repeat {i + 1} {side}: {last['step_time_ms']:.1f} ms/step"
                  + (f", data wait {last['data_wait_pct']:.2f}%" if "data_wait_pct" in last
                     else ""), flush=True)
    ref, app = got["ref"], got["app"]
    ref_ms = statistics.median(r["step_time_ms"] for r in ref)
    app_ms = statistics.median(r["step_time_ms"] for r in app)
    result = {
        "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores, "
                   f"torch {torch.__version__}",
        "model": args.model, "model_args": args.model_arg, "seq_len": args.seq_len,
        "micro_batch": args.micro_batch, "steps": args.steps, "num_workers": args.num_workers,
        "reference_head": "full" if args.full_head else "same as the app",
        "others_model": args.others_model if args.objective == "clm" else "app",
        "reference_step_time_ms": round(ref_ms, 2), "app_step_time_ms": round(app_ms, 2),
        "ratio_app_over_reference": round(app_ms / ref_ms, 3),
        "app_data_wait_pct": round(statistics.median(r["data_wait_pct"] for r in app), 3),
        "reference_data_wait_pct": round(statistics.median(r["data_wait_pct"] for r in ref), 3),
    }
    for side in sides[2:]:
        ms = statistics.median(r["step_time_ms"] for r in got[side])
        result[f"{side}_step_time_ms"] = round(ms, 2)
        result[f"ratio_app_over_{side}"] = round(app_ms / ms, 3)  # < 1: the app is faster
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
