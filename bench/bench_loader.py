"""Benchmark: training-loader throughput with 0/1/2 workers, to choose the default --num-workers.

Two measurements per worker count, in the same run:
- "trivial step": the loop only touches each batch (`input_ids.sum()`), so samples/s is the
  loader's ceiling; reported as a ratio against num_workers=0 (the reference, measured first);
- "model step": a small BERT (transformers BertForMaskedLM) forward + backward + SGD step per
  micro batch; reported as step time and the share of wall time spent waiting for data
  (`perf/data_wait_pct`, as the trainer reports it), ratios against num_workers=0.

    python bench/bench_loader.py [--data DIR] [--seq-len 512] [--micro-batch 8] [--batches 200]
                                 [--workers 0 1 2] [--objective mlm] [--packing concat]

Without --data, a synthetic dataset (random BERT-vocabulary ids, 8M tokens, 4 shards) is written
to a temporary directory first.
"""
from __future__ import annotations

import argparse
import itertools
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from app.data import DataSpec, build_train_loader, dataset_stats  # noqa: E402
from data_tools.indexed import ShardWriter  # noqa: E402
from data_tools.manifest import file_checksum, write_manifest  # noqa: E402

VOCAB = 30522
PAD, UNK, CLS, SEP, MASK = 0, 100, 101, 102, 103  # bert-base-uncased ids


def make_dataset(root: Path, tokens: int, shards: int = 4) -> Path:
    """Random documents (50..1000 words + [SEP]) in Megatron shards, manifest last."""
    rng = np.random.default_rng(0)
    entries = []
    for i in range(shards):
        name = f"train_{i:05d}"
        w = ShardWriter(root / name, np.uint16)
        while w.num_tokens < tokens // shards:
            doc = rng.integers(1000, VOCAB, size=int(rng.integers(50, 1000)), dtype=np.uint16)
            w.add_document(np.append(doc, np.uint16(SEP)))
        w.finalize(fsync=False)
        entries.append({"name": name, "documents": w.num_documents, "tokens": w.num_tokens,
                        "bin_bytes": (root / f"{name}.bin").stat().st_size,
                        "idx_bytes": (root / f"{name}.idx").stat().st_size,
                        "bin_checksum": file_checksum(root / f"{name}.bin"),
                        "idx_checksum": file_checksum(root / f"{name}.idx")})
    write_manifest(root, {
        "format": "dspretrain-dataset", "format_version": 1, "dtype": "uint16",
        "vocab_size": VOCAB, "eod_token_id": SEP, "pad_token_id": PAD, "mask_token_id": MASK,
        "cls_token_id": CLS, "unk_token_id": UNK,
        "tokenizer": {"dir": "tokenizer", "fingerprint": "xxh3_128:synthetic", "files": []},
        "checksum_algorithm": "xxh3_128",
        "splits": {"train": {"documents": sum(e["documents"] for e in entries),
                             "tokens": sum(e["tokens"] for e in entries), "shards": entries}}})
    return root


def small_bert(vocab_size: int, seq_len: int) -> torch.nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(vocab_size=vocab_size, hidden_size=128, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=512,
                        max_position_embeddings=max(512, seq_len))
    return BertForMaskedLM(config)


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
    return total / batches, wait / total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path)
    ap.add_argument("--tokens", type=int, default=8_000_000)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--model-batches", type=int, default=30)
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
        model = small_bert(stats["vocab_size"], args.seq_len)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)

        def trivial(batch):
            batch["input_ids"].sum()

        def model_step(batch):
            loss = model(**batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        rows = []
        for workers in args.workers:
            def loader():
                return build_train_loader(spec, micro_batch=args.micro_batch,
                                          global_batch=args.micro_batch, dp_rank=0, dp_size=1,
                                          consumed_samples=0, num_workers=workers)
            t_loader, _ = run(loader(), args.batches, trivial)
            t_model, wait = run(loader(), args.model_batches, model_step)
            rows.append((workers, args.micro_batch / t_loader, t_model, wait))
        ref_sps, ref_step = rows[0][1], rows[0][2]
        print("| num_workers | loader samples/s (trivial step) | ratio | model step ms "
              "| ratio | data wait % |")
        print("| --- | --- | --- | --- | --- | --- |")
        for workers, sps, step_s, wait in rows:
            print(f"| {workers} | {sps:,.0f} | {sps / ref_sps:.2f} | {step_s * 1e3:.1f} | "
                  f"{step_s / ref_step:.2f} | {wait * 100:.1f} |")


if __name__ == "__main__":
    main()
