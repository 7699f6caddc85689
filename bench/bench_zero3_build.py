"""Peak per-rank memory while building a model: unpartitioned (what ZeRO 0-2 build) against
ZeRO-3's partitioned build (`deepspeed.zero.Init`, app/runtime/zero3_init.py `partitioned`).

    python bench/bench_zero3_build.py --model bert-120m --ranks 2

Each build runs in its own job of the real `deepspeed` launcher. Each rank reports the rise of
its peak resident memory over the build (VmHWM, reset through /proc/self/clear_refs after the
imports and the process group) and the parameter bytes it holds afterwards. glibc is told to
serve large blocks by mmap (MALLOC_MMAP_THRESHOLD_), so freed tensors leave the resident set and
the peak is what was live at once. Prints a markdown table and the ratios ZeRO-3 / unpartitioned.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _measure(build) -> dict[str, float]:
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    base = _status("VmRSS")
    model = build()
    peak = _status("VmHWM") - base
    held = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() if hasattr(p, "ds_tensor")
               else p.numel() * p.element_size()
               for p in {id(p): p for p in model.parameters()}.values())
    del model
    gc.collect()
    return {"peak_rise_gb": peak / 2**30, "params_held_gb": held / 2**30}


def rank_main(model_name: str, build: str) -> None:
    import torch

    from app.models.build import build_model, count_parameters
    from app.models.presets import build_config
    from app.runtime.device import detect
    from app.runtime.dist import barrier, init_distributed, shutdown

    torch.set_num_threads(1)
    rank = init_distributed(detect()).rank
    config = build_config(model_name, vocab_size=30522, special_ids={"pad_token_id": 0},
                          overrides={}, dropout=0.0, attn_implementation="eager")
    ds = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    holder = {}

    def make():
        holder["model"] = build_model(config, seed=0, for_training=True,
                                      zero3_config=ds if build == "zero3" else None)
        return holder["model"]

    result = _measure(make)
    print("RESULT " + json.dumps({"rank": rank, "build": build,
                                  "parameters": count_parameters(holder["model"]), **result}),
          flush=True)
    barrier()
    shutdown()


def launch(model: str, ranks: int, build: str) -> list[dict]:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
           "MALLOC_MMAP_THRESHOLD_": "131072"}
    proc = subprocess.run([shutil.which("deepspeed"), "--num_gpus", str(ranks),
                           "--no_local_rank", "--master_port", str(port), __file__,
                           "--rank-main", build, "--model", model],
                          env=env, capture_output=True, text=True)
    decoder, rows = json.JSONDecoder(), []
    for piece in proc.stdout.split("RESULT ")[1:]:  # the ranks' lines may interleave
        rows.append(decoder.raw_decode(piece)[0])
    if proc.returncode or len(rows) != ranks:
        raise SystemExit(f"{build} build failed:\n{proc.stderr[-3000:]}")
    return sorted(rows, key=lambda r: r["rank"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bert-120m")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rank-main", choices=("plain", "zero3"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_main:
        rank_main(args.model, args.rank_main)
        return 0
    rows = {build: launch(args.model, args.ranks, build) for build in ("plain", "zero3")}
    print(f"{args.model}: {rows['plain'][0]['parameters'] / 1e6:.1f}M parameters, "
          f"{args.ranks} ranks")
    print("| rank | build | peak RSS rise (GB) | parameters held (GB) |")
    print("| --- | --- | --- | --- |")
    for build, name in (("plain", "unpartitioned (ZeRO 0-2)"), ("zero3", "ZeRO-3, zero.Init")):
        for r in rows[build]:
            print(f"| {r['rank']} | {name} | {r['peak_rise_gb']:.3f} | "
                  f"{r['params_held_gb']:.3f} |")

    def worst(build: str, key: str) -> float:
        return max(r[key] for r in rows[build])

    peak = worst("zero3", "peak_rise_gb") / worst("plain", "peak_rise_gb")
    held = worst("zero3", "params_held_gb") / worst("plain", "params_held_gb")
    print(f"ZeRO-3 / unpartitioned, the largest rank: peak build memory {peak:.2f}x, "
          f"parameters held {held:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
