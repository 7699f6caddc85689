"""Soak: a long two-rank run with frequent checkpoints, watched from outside for leaks.

Starts `app train` on 2 ranks through the real `deepspeed` launcher (bert-tiny on a dataset
prepared from Python's standard library unless --data is given), checkpointing every
--save-every steps, and samples every rank's resident memory (VmRSS) and open file descriptors
from /proc while it runs, plus the files in the temporary directories before and after.

Pass: after warm-up (the first --warmup fraction of the run), each rank's RSS stays within 5% of
its post-warm-up median at every sample, each rank's fd count ends where it was after warm-up,
nothing appears in the run's TMPDIR after warm-up, and none of the run's /dev/shm names (its
all-reduce buffers, torch's shared tensors) is left. The figures go to JSON and a PNG; the verdict
is the last line.

    python bench/soak.py --steps 2000 --save-every 50 --out /tmp/soak
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHM = Path("/dev/shm")


def rank_pids(out: Path) -> list[int]:
    """pids of the rank processes writing to `out` (their command line carries it)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ranks = any(a == b"-m" and b == b"app" for a, b in zip(argv, argv[1:]))
        if ranks and str(out).encode() in argv:  # not the launchers (`--module app`)
            pids.append(int(proc.name))
    return sorted(pids)


def sample(pid: int) -> tuple[float, int] | None:
    """(RSS in MiB, open fds) of one process; None once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    rss_kb = [int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")]
    return (rss_kb[0] / 1024, fds) if rss_kb else None  # none: exiting


def files_in(root: Path) -> set[str]:
    return {str(p) for p in root.iterdir()} if root.is_dir() else set()


def ours_in_shm(name: str, port: int) -> bool:
    """/dev/shm names the run's processes make: DeepSpeed's all-reduce buffers (by the run's
    port) and torch's shared tensors; other users' files there are not the run's."""
    base = Path(name).name
    return base.startswith("torch_") or f"_{port}_" in base


def prepare_default(work: Path) -> Path:
    """A dataset from Python's standard library (the demo's corpus), made once."""
    data = work / "data"
    if (data / "dataset.json").is_file():
        return data
    stdlib = Path(os.__file__).parent
    corpus = work / "corpus"
    if not corpus.is_dir():
        corpus.mkdir(parents=True)
        for name in ("json", "email", "asyncio", "logging", "unittest"):
            for src in sorted((stdlib / name).glob("*.py")):
                (corpus / f"{name}_{src.stem}.txt").write_bytes(src.read_bytes())
    tok = work / "tok"
    run = [sys.executable, "-m", "data_tools"]
    if not (tok / "tokenizer.json").is_file():
        subprocess.run([*run, "tokenizer", "--input", corpus, "--out", tok, "--kind", "wordpiece",
                        "--vocab-size", "2000"], check=True, cwd=REPO)
    subprocess.run([*run, "prepare", "--input", corpus, "--tokenizer", tok, "--out", data],
                   check=True, cwd=REPO)
    return data


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--save-every", type=int, default=50)
    ap.add_argument("--out", type=Path, default=Path("/tmp/soak"))
    ap.add_argument("--data", type=Path, help="a prepared dataset (default: the stdlib one)")
    ap.add_argument("--interval", type=float, default=2.0, help="seconds between samples")
    ap.add_argument("--warmup", type=float, default=0.1,
                    help="fraction of the steps ignored (start-up, first allocations)")
    ap.add_argument("--tolerance", type=float, default=0.05, help="allowed RSS drift")
    args = ap.parse_args()

    args.out.mkdir(parents=True, exist_ok=True)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    data = args.data or prepare_default(args.out)
    run = args.out / "run"
    if run.exists():
        subprocess.run(["rm", "-rf", str(run)], check=True)
    tmp = Path(tempfile.mkdtemp(prefix="soak_tmp_"))  # the run's TMPDIR: anything left leaked
    shm_before = files_in(SHM)
    env = dict(os.environ, WANDB_MODE="offline", OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false", TMPDIR=str(tmp))
    launcher = str(Path(sys.executable).parent / "deepspeed")
    cmd = [launcher, "--num_gpus", "2", "--no_local_rank", "--master_port", str(port),
           "--module", "app", "train",
           "--data", str(data), "--out", str(run), "--model", "bert-tiny", "--seq-len", "64",
           "--micro-batch", "4", "--max-steps", str(args.steps), "--save-every",
           str(args.save_every), "--keep-last", "2", "--log-every", "50", "--eval-every", "500",
           "--eval-samples", "32", "--wandb", "offline", "--num-workers", "1"]
    log = open(args.out / "soak.log", "w")
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    samples: dict[int, list[tuple[float, float, int]]] = {}
    pids: list[int] = []
    warm: set[str] | None = None
    warm_at = 0.0
    try:
        from tqdm import tqdm
        bar = tqdm(total=args.steps, unit="step", desc="soak")
        while proc.poll() is None:
            if len(pids) < 2:
                pids = rank_pids(run)
            now = time.monotonic() - started
            for rank, pid in enumerate(pids):
                got = sample(pid)
                if got:
                    samples.setdefault(rank, []).append((now, *got))
            step = _last_step(run)
            bar.update(step - bar.n)
            if warm is None and step >= args.warmup * args.steps:
                warm = files_in(tmp)  # what start-up made (torch's caches): not a leak
                warm_at = now
            time.sleep(args.interval)
        bar.close()
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    elapsed = time.monotonic() - started
    if proc.returncode != 0:
        print(f"soak: the run failed with status {proc.returncode}: see {args.out / 'soak.log'}")
        return 1
    new_shm = files_in(SHM) - shm_before
    leaked = sorted((files_in(tmp) - (warm or set())) |
                    {f for f in new_shm if ours_in_shm(f, port)})
    others = sorted(f for f in new_shm if not ours_in_shm(f, port))

    results = {"steps": args.steps, "save_every": args.save_every, "seconds": round(elapsed, 1),
               "checkpoints_written": args.steps // args.save_every, "ranks": {},
               "tmp_files_left": leaked, "other_new_shm_files": others}
    ok = not leaked
    for rank, rows in sorted(samples.items()):
        steady = [r for r in rows if r[0] >= warm_at]  # from the step --warmup x --steps on
        rss = [r[1] for r in steady]
        median = statistics.median(rss)
        drift = max(abs(v - median) for v in rss) / median
        first_half = statistics.median(rss[: len(rss) // 2])
        second_half = statistics.median(rss[len(rss) // 2:])
        fds_start, fds_end, fds_max = steady[0][2], steady[-1][2], max(r[2] for r in steady)
        results["ranks"][rank] = {
            "samples": len(rows), "rss_mib_median": round(median, 1),
            "rss_mib_min": round(min(rss), 1), "rss_mib_max": round(max(rss), 1),
            "rss_max_drift": round(drift, 4),
            "rss_second_half_over_first": round(second_half / first_half, 4),
            "fds_after_warmup": fds_start, "fds_at_end": fds_end, "fds_max": fds_max}
        ok &= drift <= args.tolerance and fds_end <= fds_start
    (args.out / "soak.json").write_text(json.dumps(results, indent=2) + "\n")
    _plot(samples, args.out / "soak.png")
    print(json.dumps(results, indent=2))
    print(f"soak: {'PASS' if ok else 'FAIL'} ({args.steps} steps, {elapsed:.0f} s, "
          f"plot {args.out / 'soak.png'})")
    return 0 if ok else 1


def _last_step(run: Path) -> int:
    try:
        lines = (run / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return 0
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if "step" in record:
            return int(record["step"])
    return 0


def _plot(samples: dict[int, list[tuple[float, float, int]]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for rank, rows in sorted(samples.items()):
        t = [r[0] for r in rows]
        top.plot(t, [r[1] for r in rows], label=f"rank {rank}")
        bottom.plot(t, [r[2] for r in rows], label=f"rank {rank}")
    top.set_ylabel("RSS (MiB)")
    bottom.set_ylabel("open fds")
    bottom.set_xlabel("seconds")
    top.legend()
    top.set_title("soak: 2 ranks, checkpoint every N steps")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
