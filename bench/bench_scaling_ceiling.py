"""What this machine gives data parallelism before any communication: the same single-threaded
work in 1 process, then in 2 processes at once (no process group, no all-reduce), alternating.

The ratio (2 x one process's time per iteration / the concurrent processes' time) is the most 2
ranks of 1 thread can reach against 1 rank of 1 thread here: with 2 cores all one's own, 2.0; what
it falls short by is the machine (shared caches and memory bandwidth, the hypervisor, other
users' load), not the app. `app bench --sweep world=1,2` measures the app against it.

    python bench/bench_scaling_ceiling.py --work step --model bert-tiny --micro-batch 16
    python bench/bench_scaling_ceiling.py --work gemm
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench._forking import fork_call, wait_exit  # noqa: E402


def one(args: argparse.Namespace) -> float:
    """Median seconds per iteration of the work, one thread, in this process."""
    import torch

    torch.set_num_threads(1)
    if args.work == "gemm":
        a, b = torch.randn(512, 512), torch.randn(512, 512)

        def work():
            for _ in range(20):
                a @ b
    else:
        from app.models.build import build_model
        from app.models.presets import build_config, parse_overrides

        cfg = build_config(args.model, vocab_size=args.vocab, special_ids={"pad_token_id": 0},
                           overrides=parse_overrides(args.model_arg))
        model = build_model(cfg, seed=0, for_training=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(5, args.vocab, (args.micro_batch, args.seq_len), generator=g)
        masked = max(1, int(0.15 * args.seq_len))
        pos = torch.randint(0, args.seq_len, (args.micro_batch, masked), generator=g)
        labels = torch.randint(5, args.vocab, (args.micro_batch, masked), generator=g)

        def work():  # the app's step on one rank: forward, backward, clip, AdamW
            loss = model(input_ids=ids, mlm_positions=pos, mlm_labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
    times = []
    for _ in range(args.iters):
        t0 = time.perf_counter()
        work()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[3:])


def busy_cores(seconds: float) -> float:
    """Cores busy with anything (other users included) over `seconds`, from /proc/stat."""
    def read():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
        return sum(v) - v[3] - v[4], sum(v)
    b1, t1 = read()
    time.sleep(seconds)
    b2, t2 = read()
    import os
    return len(os.sched_getaffinity(0)) * (b2 - b1) / max(t2 - t1, 1)


def start(args: argparse.Namespace) -> tuple[int, int]:
    """A process of its own running `one(args)`: its pid and the read end of its figure. A fork of
    this one, which has imported nothing of the work's (it does that itself, as a fresh
    interpreter would); where the parent has them already (a test's warm process), the child skips
    the imports, which are no part of what it times."""
    r, w = os.pipe()

    def measure() -> None:
        os.close(r)
        err = os.dup(2)
        quiet = os.open(os.devnull, os.O_WRONLY)
        os.dup2(quiet, 2)  # the libraries' warnings: a traceback only goes to our stderr
        try:
            os.write(w, json.dumps(one(args)).encode())
        except BaseException:
            os.write(err, traceback.format_exc().encode())
            raise SystemExit(1) from None

    pid = fork_call(measure)
    os.close(w)
    return pid, r


def finish(pid: int, r: int) -> float:
    with os.fdopen(r) as f:
        text = f.read()
    code = wait_exit(pid)
    if code != 0 or not text:
        raise SystemExit(f"bench_scaling_ceiling: a measuring process failed (exit {code})")
    return json.loads(text)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", choices=("step", "gemm"), default="step")
    p.add_argument("--model", default="bert-tiny")
    p.add_argument("--model-arg", action="append", default=[])
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()

    def run(n: int) -> list[float]:
        started = [start(args) for _ in range(n)]
        return [finish(pid, r) for pid, r in started]

    ratios = []
    for i in range(args.repeats):
        load = busy_cores(2.0)
        results = {}
        for n in ((1, 2) if i % 2 == 0 else (2, 1)):
            results[n] = run(n)
        ratio = 2 * results[1][0] / max(results[2])  # the slower of the two sets a step's pace
        ratios.append(ratio)
        print(f"repeat {i + 1}: 1 process {1000 * results[1][0]:.1f} ms/iter, 2 processes "
              f"{', '.join(f'{1000 * t:.1f}' for t in results[2])} ms/iter: ratio {ratio:.3f} "
              f"(busy cores before: {load:.2f})", flush=True)
    print(json.dumps({"work": args.work, "model": args.model, "micro_batch": args.micro_batch,
                      "seq_len": args.seq_len, "ratio_median": round(statistics.median(ratios), 3),
                      "ratios": [round(r, 3) for r in ratios]}))


if __name__ == "__main__":
    main()
