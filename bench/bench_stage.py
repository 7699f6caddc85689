"""Benchmark: `data_tools stage` (hash while copying, fsync, rename) against `cp -r` of the files.

Target (issue 4): staging with verification reaches >= 0.8x the throughput of a plain `cp -r`,
measured in the same run on the same disks. `cp` does not fsync, so `cp -r && sync` is measured
too. Before every measurement the source files are evicted from the page cache (sync, then
posix_fadvise DONTNEED on each: cold reads, without dropping the caches of others sharing the
machine) and the destination is removed. Orders alternate between repetitions; medians reported.

    python bench/bench_stage.py [--dir /tmp/bench_stage] [--gb 1.0] [--reps 3] [--workers 1 4]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from data_tools.indexed import ShardWriter  # noqa: E402
from data_tools.manifest import (  # noqa: E402
    dataset_fingerprint,
    file_checksum,
    tokenizer_fingerprint,
    write_manifest,
)


def make_dataset(root: Path, total_bytes: int, shards: int = 8) -> None:
    """Random uint16 tokens in `shards` Megatron shards (1M-token documents), manifest last."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["a tiny corpus for a tiny tokenizer"] * 10,
                            trainers.BpeTrainer(vocab_size=100, show_progress=False,
                                                special_tokens=["[UNK]", "[EOS]"]))
    (root / "tokenizer").mkdir(parents=True)
    tok.save(str(root / "tokenizer" / "tokenizer.json"))
    rng = np.random.default_rng(0)
    doc_tokens = 1 << 20
    docs = max(1, total_bytes // shards // (2 * doc_tokens))
    shard_list = []
    for i in range(shards):
        name = f"train_{i:05d}"
        w = ShardWriter(root / name, np.uint16)
        for _ in range(docs):
            w.add_document(rng.integers(0, 30000, size=doc_tokens, dtype=np.uint16))
        w.finalize()
        shard_list.append({"name": name, "documents": docs, "tokens": w.num_tokens,
                           "bin_bytes": (root / f"{name}.bin").stat().st_size,
                           "idx_bytes": (root / f"{name}.idx").stat().st_size,
                           "bin_checksum": file_checksum(root / f"{name}.bin"),
                           "idx_checksum": file_checksum(root / f"{name}.idx")})
    tj = root / "tokenizer" / "tokenizer.json"
    manifest = {"format": "dspretrain-dataset", "format_version": 1, "dtype": "uint16",
                "vocab_size": 30000, "eod_token_id": 1, "checksum_algorithm": "xxh3_128",
                "tokenizer": {"dir": "tokenizer", "kind": "bpe",
                              "fingerprint": tokenizer_fingerprint(root / "tokenizer"),
                              "files": [{"name": tj.name, "bytes": tj.stat().st_size,
                                         "checksum": file_checksum(tj)}]},
                "splits": {"train": {"documents": docs * shards,
                                     "tokens": sum(s["tokens"] for s in shard_list),
                                     "shards": shard_list}}}
    manifest["fingerprint"] = dataset_fingerprint(manifest)
    write_manifest(root, manifest)


def evict(root: Path) -> None:
    """Cold-read the source next time: write back everything, then drop these files' pages."""
    os.sync()
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def timed(cmd: list[str] | str, shell: bool = False) -> float:
    t = time.perf_counter()
    subprocess.run(cmd, check=True, shell=shell, cwd=REPO, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, default=Path("/tmp/bench_stage"))
    p.add_argument("--gb", type=float, default=1.0, help="dataset size in GB")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--keep", action="store_true", help="keep the source dataset for a re-run")
    args = p.parse_args()

    src = args.dir / "src"
    if not (src / "dataset.json").exists():
        shutil.rmtree(src, ignore_errors=True)
        make_dataset(src, int(args.gb * 1e9))
    nbytes = sum(f.stat().st_size for f in src.rglob("*") if f.is_file())
    nfiles = sum(1 for f in src.rglob("*") if f.is_file())
    out = args.dir / "out"

    def cp() -> float:
        return timed(["cp", "-r", str(src), str(out)])

    def cp_sync() -> float:
        return timed(f"cp -r '{src}' '{out}' && sync", shell=True)

    def stage(workers: int):
        # with its progress bar (to /dev/null), as users run it
        return lambda: timed([sys.executable, "-m", "data_tools", "stage",
                              "--workers", str(workers), "--src", str(src), "--dst", str(out)])

    def read_only() -> float:  # the floor of any copy: reading the source once
        return timed(f"cat '{src}'/*.bin > /dev/null", shell=True)

    cases = {"cat *.bin > /dev/null": read_only, "cp -r": cp, "cp -r && sync": cp_sync}
    cases.update({f"stage --workers {w}": stage(w) for w in args.workers})
    times: dict[str, list[float]] = {k: [] for k in cases}
    load = os.getloadavg()  # others' jobs on the same machine skew every figure
    for rep in range(args.reps):
        order = list(cases) if rep % 2 == 0 else list(reversed(cases))
        for name in order:
            shutil.rmtree(out, ignore_errors=True)
            evict(src)
            times[name].append(cases[name]())
    shutil.rmtree(out, ignore_errors=True)
    if not args.keep:
        shutil.rmtree(src, ignore_errors=True)

    ref = statistics.median(times["cp -r"])
    ref_sync = statistics.median(times["cp -r && sync"])
    print(f"machine: {platform.platform()}, {os.cpu_count()} CPUs, "
          f"python {platform.python_version()}")
    print(f"data: {nbytes / 1e6:.0f} MB in {nfiles} files, "
          f"source evicted from page cache before each run, {args.reps} reps, "
          f"load average before {load[0]:.1f}, after {os.getloadavg()[0]:.1f}")
    rows = []
    for name, ts in times.items():
        med = statistics.median(ts)
        rows.append({"case": name, "seconds": round(med, 3), "MB_per_s": round(nbytes / 1e6 / med),
                     "vs_cp": round(ref / med, 2), "vs_cp_sync": round(ref_sync / med, 2),
                     "all_seconds": [round(t, 3) for t in ts]})
    print("| case | median s | MB/s | x cp -r | x cp -r && sync |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| `{r['case']}` | {r['seconds']} | {r['MB_per_s']} | {r['vs_cp']} | "
              f"{r['vs_cp_sync']} |")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
