"""What a checkpoint's manifest costs (app/checkpoint/manifest.py): hashing a tag's files after the
save, and verifying them before the load, against the save and the load themselves, in one run.

The state is that of a model of `--params` parameters trained with Adam in fp32 (weights and two
moments, 12 bytes a parameter), in two files as DeepSpeed writes them (model states, optimizer
states). A save is `torch.save` of both files plus `os.sync()` (the bytes on disk, as a preemption
needs them); the manifest hashes the files just written (xxh3_64 over the mapped bytes, from the
page cache, as in a real save); a load is `torch.load` of both, the verify the same hashing again.
Both hash a tag's files several at once, as the app does (`manifest.checksums`); "one at a
time" is the same hashing file after file (as before), for the gain.

    python bench/bench_manifest.py --params 120e6 --repeats 3 [--dir /nvme/tmp]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from app.checkpoint import manifest  # noqa: E402


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def one_round(tag: Path, model: dict, optim: dict) -> dict[str, float]:
    files = {tag / "mp_rank_00_model_states.pt": model,
             tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt": optim}

    def save() -> None:
        for path, state in files.items():
            torch.save(state, path)
        os.sync()

    out = {"save": timed(save), "manifest": timed(lambda: manifest.own_entries(tag, 0))}
    out["load"] = timed(lambda: [torch.load(p, weights_only=True) for p in files])
    out["verify"] = timed(lambda: manifest.checksums(list(files)))
    out["serial"] = timed(lambda: [manifest.checksum(p) for p in files])
    for p in files:
        p.unlink()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=float, default=120e6, help="model parameters (default 120e6)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    args = p.parse_args()
    n = int(args.params)
    model = {"module": torch.randn(n)}
    optim = {"exp_avg": torch.randn(n), "exp_avg_sq": torch.rand(n)}
    gb = 12 * n / 1e9
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        rounds = [one_round(Path(d), model, optim) for _ in range(args.repeats)]
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    print(f"{n / 1e6:.0f}M parameters, {gb:.2f} GB a tag, median of {args.repeats}:")
    print(f"  save {med['save']:.2f} s, manifest {med['manifest']:.2f} s "
          f"({gb / med['manifest']:.1f} GB/s): {med['manifest'] / med['save']:.1%} of the save")
    print(f"  load {med['load']:.2f} s, verify {med['verify']:.2f} s: "
          f"{med['verify'] / med['load']:.1%} of the load (one file at a time: "
          f"{med['serial']:.2f} s, {med['serial'] / med['load']:.1%}; "
          f"{manifest.HASH_THREADS} hashing threads at most)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
