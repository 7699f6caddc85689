"""Benchmark: training-loader throughput with 0/1/2 workers, to choose the default --num-workers.

Measurements per worker count, in the same run (median of --reps, worker counts alternating):
- "trivial step": the loop only touches each batch (`input_ids.sum()`), so samples/s is the
  loader's ceiling; reported as a ratio against num_workers=0 (the reference);
- "accelerator step": the step sleeps --step-ms, leaving the CPU free as a GPU step does; the
  share of wall time spent waiting for data (`perf/data_wait_pct`) says whether workers hide
  the loading (the paper's lesson 3: add workers until the accelerator never waits);
- "model step" (--model): a small BERT (BertForMaskedLM) forward + backward + SGD step on the
  CPU itself, where loader workers compete with the step for the cores.

    python bench/bench_loader.py [--data DIR] [--seq-len 512] [--micro-batch 8] [--batches 200]
                                 [--workers 0 1 2] [--step-ms 10] [--reps 3] [--model]

Without --data, a synthetic dataset (random BERT-vocabulary ids, 8M tokens, 4 shards) is written
to a temporary directory first.
"""
from __future__ import annotations

import argparse
import itertools
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from app.data.loader import DataSpec, build_train_loader, dataset_stats  # noqa: E402
from data_tools.indexed import ShardWriter  # noqa: E402
from data_tools.manifest import file_checksum, write_manifest  # noqa: E402

VOCAB = 30522
PAD, UNK, CLS, SEP, MASK = 0, 100, 101, 102, 103  # bert-base-uncased ids


def make_dataset(root: Path, tokens: int, shards: int = 4, vocab: int = VOCAB) -> Path:
    """Random documents (50..1000 words + [SEP]) in Megatron shards, manifest last. `vocab`:
    30522 (BERT's, the default) or 50257 (GPT-2's); uint16 holds either. The tokenizer entry is
    a placeholder: a run on it skips the tokenizer-copy check (bench/gpu_mfu.py)."""
    rng = np.random.default_rng(0)
    entries = []
    for i in range(shards):
        name = f"train_{i:05d}"
        w = ShardWriter(root / name, np.uint16)
        while w.num_tokens < tokens // shards:
            doc = rng.integers(1000, vocab, size=int(rng.integers(50, 1000)), dtype=np.uint16)
            w.add_document(np.append(doc, np.uint16(SEP)))
        w.finalize(fsync=False)
        entries.append({"name": name, "documents": w.num_documents, "tokens": w.num_tokens,
                        "bin_bytes": (root / f"{name}.bin").stat().st_size,
                        "idx_bytes": (root / f"{name}.idx").stat().st_size,
                        "bin_checksum": file_checksum(root / f"{name}.bin"),
                        "idx_checksum": file_checksum(root / f"{name}.idx")})
    write_manifest(root, {
        "format": "dspretrain-dataset", "format_version": 1, "dtype": "uint16",
        "vocab_size": vocab, "eod_token_id": SEP, "pad_token_id": PAD, "mask_token_id": MASK,
        "cls_token_id": CLS, "unk_token_id": UNK,
        "tokenizer": {"dir": "tokenizer", "fingerprint": "xxh3_128:synthetic", "files": []},
        "checksum_algorithm": "xxh3_128", "fingerprint": "xxh3_128:synthetic",
        "splits": {"train": {"documents": sum(e["documents"] for e in entries),
                             "tokens": sum(e["tokens"] for e in entries), "shards": entries}}})
    return root


def small_bert(vocab_size: int, seq_len: int) -> torch.nn.Module:
    from transformers import BertConfig

    from app.models.heads import SparseHeadBertForMaskedLM  # takes the loader's masked positions

    config = BertConfig(vocab_size=vocab_size, hidden_size=128, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=512,
                        max_position_embeddings=max(512, seq_len))
    return SparseHeadBertForMaskedLM(config)


def run(loader, batches: int, step) -> tuple[float, float]:
    """(seconds per micro batch, share of time waiting for data) after a warm-up."""
    it = iter(loader)
    for batch in itertools.islice(it, 5):  # workers start, prefetch queues fill
        step(batch)
    wait = 0.0
    start = time.perf_counter()
    for _ in range(batches):
        t = time.perf_counter()
        batch = next(it)
        wait += time.perf_counter() - t
        step(batch)
    total = time.perf_counter() - start
    del it  # stops the workers before the next measurement
    return total / batches, wait / total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path)
    ap.add_argument("--tokens", type=int, default=8_000_000)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--step-ms", type=float, default=10.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--model", action="store_true", help="also time a small BERT step on the CPU")
    ap.add_argument("--model-batches", type=int, default=10)
    ap.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--objective", default="mlm", choices=["mlm", "clm"])
    ap.add_argument("--packing", default="concat", choices=["concat", "doc"])
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench_loader_") as tmp:
        root = args.data or make_dataset(Path(tmp), args.tokens)
        spec = DataSpec(root, "train", args.seq_len, args.objective, args.packing, seed=1)
        stats = dataset_stats(spec)
        print(f"# machine: {platform.machine()}, {os.cpu_count()} CPUs, "
              f"torch {torch.__version__}, {torch.get_num_threads()} torch threads; "
              f"python {platform.python_version()}")
        print(f"# data: {stats['tokens']:,} tokens, {stats['num_samples']:,} samples, "
              f"{args.objective}/{args.packing}, seq_len {args.seq_len}, "
              f"micro batch {args.micro_batch}")

        def trivial(batch):
            batch["input_ids"].sum()

        def accelerator(batch):
            time.sleep(args.step_ms / 1e3)

        steps = {"trivial": (trivial, args.batches),
                 "accelerator": (accelerator, max(20, int(2000 / args.step_ms)))}
        if args.model:
            model = small_bert(stats["vocab_size"], args.seq_len)
            opt = torch.optim.SGD(model.parameters(), lr=1e-4)

            def model_step(batch):
                batch.pop("tokens", None)  # the telemetry's count of real tokens
                model(**batch).loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            steps["model"] = (model_step, args.model_batches)

        results = {(w, k): [] for w in args.workers for k in steps}
        for rep in range(args.reps):
            order = args.workers if rep % 2 == 0 else args.workers[::-1]
            for workers in order:
                for name, (fn, count) in steps.items():
                    loader = build_train_loader(spec, micro_batch=args.micro_batch,
                                                global_batch=args.micro_batch, dp_rank=0,
                                                dp_size=1, consumed_samples=0,
                                                num_workers=workers)
                    results[workers, name].append(run(loader, count, fn))

        def med(workers, name, i):
            return statistics.median(r[i] for r in results[workers, name])

        ref = args.workers[0]
        head = ("| num_workers | loader samples/s (trivial step) | ratio vs "
                f"{ref} workers | data wait % ({args.step_ms:g} ms accelerator step) |")
        if args.model:
            head += " CPU model step ms | ratio | data wait % (CPU model step) |"
        print(head)
        print("|" + " --- |" * (head.count("|") - 1))
        for workers in args.workers:
            sps = args.micro_batch / med(workers, "trivial", 0)
            ref_sps = args.micro_batch / med(ref, "trivial", 0)
            row = (f"| {workers} | {sps:,.0f} | {sps / ref_sps:.2f} | "
                   f"{med(workers, 'accelerator', 1) * 100:.1f} |")
            if args.model:
                step_s = med(workers, "model", 0)
                row += (f" {step_s * 1e3:.0f} | {step_s / med(ref, 'model', 0):.2f} | "
                        f"{med(workers, 'model', 1) * 100:.1f} |")
            print(row)


if __name__ == "__main__":
    main()
