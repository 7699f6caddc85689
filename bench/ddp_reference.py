"""Plain PyTorch DDP over gloo, the reference the app's data parallelism is measured against: the
app's model (app.models, the same preset and --model-arg overrides), its batches (app.data.loader,
the same samples per rank and step), its optimizer (AdamW on
app.runtime.param_groups.optimizer_groups, the same betas, eps and weight decay) and clipping
(1.0), without DeepSpeed. DDP reduces the gradients in
buckets during backward (bucket_cap_mb scaled to the model: its fp32 gradients over `--buckets`,
so a small model still gets several buckets to overlap, where DDP's default of 25 MB would make
one). Start it with torch.distributed.run (env://), one process a rank:

    torchrun --nproc-per-node 2 bench/ddp_reference.py --data D --model bert-tiny --steps 20
    python bench/netsim.py ddp --nodes 2 --rate 200mbit -- --data D --model bert-tiny ...

`--allreduce-only` times one raw all-reduce of a flat fp32 tensor the size of the gradients
instead (no model step): what bench/netsim.py calibrate sets the link rate by. Rank 0 writes
`--out` (JSON: tokens/s, step times, losses; or the all-reduce times).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from app.config import TrainConfig  # noqa: E402


def build(args: argparse.Namespace):
    """(model, its parameter count) as app train builds it: same preset, overrides, padding,
    seed and dropout."""
    from app.models.build import build_model
    from app.models.presets import build_config, parse_overrides
    from data_tools.manifest import load_manifest

    manifest = load_manifest(args.data)
    cfg = build_config(args.model, vocab_size=int(manifest["vocab_size"]),
                       special_ids={"pad_token_id": manifest.get("pad_token_id")},
                       overrides=parse_overrides(args.model_arg), dropout=args.dropout,
                       pad_vocab_to=TrainConfig.pad_vocab_to)
    model = build_model(cfg, seed=TrainConfig.seed, for_training=True)
    return model, sum(p.numel() for p in model.parameters())


def batches(args: argparse.Namespace, rank: int, world: int):
    """This rank's micro batches, exactly as app train's loader hands them at world `world`."""
    from app.data.loader import DataSpec, build_train_loader

    spec = DataSpec(args.data, "train", args.seq_len, "mlm", seed=TrainConfig.seed,
                    mask_prob=TrainConfig.mask_prob)
    return iter(build_train_loader(spec, micro_batch=args.micro_batch,
                                   global_batch=args.micro_batch * world, dp_rank=rank,
                                   dp_size=world, consumed_samples=0, num_workers=0))


def train(args: argparse.Namespace, rank: int, world: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from app.runtime.param_groups import optimizer_groups

    model, n_params = build(args)
    bucket_mb = max(0.01, n_params * 4 / 2**20 / args.buckets)
    ddp = DDP(model, bucket_cap_mb=bucket_mb)
    opt = torch.optim.AdamW(optimizer_groups(model, TrainConfig.weight_decay), lr=args.lr,
                            betas=(TrainConfig.beta1, TrainConfig.beta2), eps=TrainConfig.eps)
    data = batches(args, rank, world)
    times, losses = [], []
    for _ in range(args.steps):
        batch = next(data)
        t0 = time.perf_counter()
        loss = ddp(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
    return {"n_params": n_params, "bucket_cap_mb": round(bucket_mb, 3), "step_s": times,
            "losses": losses, **throughput(times, args, world)}


def throughput(times: list[float], args: argparse.Namespace, world: int) -> dict:
    """As app bench reads a run: intervals of a tenth of the steps, the first left out (warm-up),
    the median interval's tokens/s."""
    every = max(1, len(times) // 10)
    intervals = [sum(times[i:i + every]) / every for i in range(0, len(times) - every + 1, every)]
    steady = intervals[1:] or intervals
    step = statistics.median(steady)
    return {"step_time_ms": step * 1000,
            "tokens_per_sec": world * args.micro_batch * args.seq_len / step}


def allreduce(args: argparse.Namespace, world: int) -> dict:
    """Median seconds of one all-reduce of the model's fp32 gradients' bytes, one flat tensor."""
    _, n_params = build(args)
    flat = torch.ones(n_params)
    times = []
    for _ in range(args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(flat)
        times.append(time.perf_counter() - t0)
    steady = times[2:] or times
    return {"n_params": n_params, "bytes": n_params * 4, "allreduce_s": times,
            "allreduce_ms": statistics.median(steady) * 1000}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, required=True, help="dataset (data_tools prepare)")
    p.add_argument("--model", default="bert-tiny", help="an app preset (MLM: bert-*)")
    p.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="config override, as app train's (repeatable)")
    p.add_argument("--seq-len", type=int, default=TrainConfig.seq_len)
    p.add_argument("--micro-batch", type=int, default=TrainConfig.micro_batch)
    p.add_argument("--dropout", type=float, default=None)
    p.add_argument("--lr", type=float, default=TrainConfig.lr)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--buckets", type=int, default=8,
                   help="gradient buckets: bucket_cap_mb = the fp32 gradients' MB / this "
                        "(default 8)")
    p.add_argument("--allreduce-only", action="store_true",
                   help="time one raw all-reduce of the gradients' size instead of training")
    p.add_argument("--out", type=Path, help="JSON written by rank 0")
    args = p.parse_args(argv)
    if args.steps < 2 or args.buckets < 1:
        p.error("--steps at least 2, --buckets at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    result = allreduce(args, world) if args.allreduce_only else train(args, rank, world)
    dist.barrier()  # every rank past its last collective
    result.update(world=world, micro_batch=args.micro_batch, seq_len=args.seq_len)
    if rank == 0:
        shown = {k: v for k, v in result.items() if not isinstance(v, list)}
        print(f"ddp_reference: {json.dumps(shown)}", flush=True)
        if args.out:
            args.out.write_text(json.dumps(result, indent=1) + "\n")
    leave_without_teardown()


def leave_without_teardown() -> NoReturn:
    """Exit 0 now, without destroying the gloo group: a barrier followed by the group's teardown
    can still abort a rank (SIGABRT from gloo's loop thread or a joinable thread destroyed while
    a peer's last transfer drains: pytorch/gloo#155, open), seen here on slow shaped links, once
    with a barrier before the teardown too. The kernel closes the sockets; the peers, past the
    same barrier, need nothing more from them."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
