"""Open file descriptors and sockets per rank, by world size: what the control plane costs.

Runs the app through launch.sh (the real deepspeed launcher, gloo on CPU, bert-tiny) at each world
size on this box, once from this tree and once from a reference commit (`--ref`, default main:
its stop agreement opened a gloo group of its own), samples every rank's /proc/PID/fd while the
loop runs, then stops the job with a SIGTERM (a checkpoint, exit 75). Sockets are split into TCP
(gloo's pairs, the rendezvous store) and Unix ones. From the sizes measured, a straight line per
rank kind (rank 0 also serves the rendezvous store) gives the count at `--extrapolate` ranks.

    python bench/bench_fds.py --sizes 2,4,8 [--ref main] [--data DIR] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

from soak import prepare_default  # noqa: E402

MARK = "BENCH_FDS_MARK"
ARGS = ["--model", "bert-tiny", "--seq-len", "64", "--micro-batch", "2", "--max-steps", "100000",
        "--log-every", "1", "--save-every", "100000", "--eval-samples", "16", "--wandb",
        "disabled", "--num-workers", "0"]


def reference_tree(ref: str, into: Path) -> Path:
    """The files of commit `ref` of this repository, unpacked under `into`."""
    archive = into / "ref.tar"
    subprocess.run(["git", "-C", REPO, "archive", "-o", archive, ref], check=True)
    tree = into / "ref"
    with tarfile.open(archive) as tar:
        tar.extractall(tree, filter="data")
    return tree


def rank_pids(marker: str) -> dict[int, int]:
    """{rank: pid} of the job's python ranks (not their line taggers, nor launch.py)."""
    found = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            raw = (d / "environ").read_bytes().split(b"\0")
            cmd = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        env = dict(e.split(b"=", 1) for e in raw if b"=" in e)
        if env.get(MARK.encode()) == marker.encode() and b"app" in cmd and b"train" in cmd \
                and b"RANK" in env:
            found[int(env[b"RANK"])] = int(d.name)
    return found


def socket_inodes(pid: int, table: str) -> set[str]:
    """Inodes of the sockets in /proc/PID/net/TABLE (tcp, tcp6, unix), the process's netns."""
    inodes = set()
    try:
        lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
    except OSError:
        return inodes
    col = 6 if table == "unix" else 9
    for line in lines:
        parts = line.split()
        if len(parts) > col:
            inodes.add(parts[col])
    return inodes


def fd_counts(pid: int) -> dict[str, int]:
    """This process's descriptors: all, sockets, the sockets that are TCP or Unix, and files in
    /dev/shm (DeepSpeed's CPU all-reduce maps every local rank's buffer: one box only)."""
    links = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            links.append(os.readlink(fd))
        except OSError:
            pass
    sockets = {link[8:-1] for link in links if link.startswith("socket:[")}
    tcp = socket_inodes(pid, "tcp") | socket_inodes(pid, "tcp6")
    return {"fds": len(links), "sockets": len(sockets), "tcp": len(sockets & tcp),
            "unix": len(sockets & socket_inodes(pid, "unix")),
            "shm": sum(link.startswith("/dev/shm/") for link in links)}


def logged_steps(run: Path) -> int:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return 0
    return sum('"train/loss"' in line for line in path.read_text().splitlines())


def measure(tree: Path, world: int, data: Path, work: Path, timeout: float,
            samples: int = 3) -> dict[int, dict]:
    """{rank: max counts over `samples` samples in the loop, a second apart} for one job of
    `world` ranks."""
    marker, run = uuid.uuid4().hex, work / f"run-{tree.name}-{world}"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update({MARK: marker, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"})
    job = subprocess.Popen(["bash", tree / "launch.sh", "--procs-per-node", str(world), "--",
                            "--data", data, "--out", run, *ARGS], cwd=tree, env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while logged_steps(run) < 3:
            if job.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{tree.name}, {world} ranks: no training steps "
                                 f"(exit {job.poll()}): {job.stderr.read()[-2000:]}")
            time.sleep(0.5)
        counts: dict[int, dict] = {}
        for i in range(samples):
            if i:
                time.sleep(1.0)
            for rank, pid in rank_pids(marker).items():
                now = fd_counts(pid)
                old = counts.get(rank, now)
                counts[rank] = {k: max(now[k], old[k]) for k in now}
        os.kill(job.pid, signal.SIGTERM)  # launch.sh stops the job: a checkpoint, exit 75
        job.communicate(timeout=300)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    if len(counts) != world:
        raise SystemExit(f"{tree.name}, {world} ranks: found {len(counts)} rank processes")
    return counts


def line_fit(xs: list[int], ys: list[float]) -> tuple[float, float]:
    """Least-squares a, b of y = a + b x."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - b * mx, b


def summarize(results: dict, sizes: list[int], at: int) -> list[dict]:
    """Per tree and rank kind (rank 0, the others' median): counts by size, slope, extrapolation."""
    rows = []
    for tree, by_size in results.items():
        for kind in ("rank0", "others"):
            row = {"tree": tree, "ranks": kind}
            for key in ("fds", "sockets", "tcp", "unix", "shm"):
                ys = []
                for n in sizes:
                    per = by_size[n]
                    vals = [per[0][key]] if kind == "rank0" else [v[key] for r, v in per.items()
                                                                  if r != 0]
                    ys.append(statistics.median(vals))
                a, b = line_fit(sizes, ys)
                row[key] = dict(zip(map(str, sizes), ys))
                row[f"{key}_per_rank_added"] = round(b, 2)
                row[f"{key}_at_{at}"] = round(a + b * at)
            rows.append(row)
    return rows


def print_table(rows: list[dict], sizes: list[int], at: int) -> None:
    head = ["tree", "ranks"] + [f"{k}@{n}" for k in ("fds", "tcp", "shm") for n in sizes]
    head += ["tcp/rank", f"fds@{at}", f"tcp@{at}", f"fds@{at} less shm"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        cells = [r["tree"], r["ranks"]] + [f"{r[k][str(n)]:g}" for k in ("fds", "tcp", "shm")
                                           for n in sizes]
        cells += [f"{r['tcp_per_rank_added']:g}", str(r[f"fds_at_{at}"]), str(r[f"tcp_at_{at}"]),
                  str(r[f"fds_at_{at}"] - r[f"shm_at_{at}"])]
        print("| " + " | ".join(cells) + " |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="2,4,8", help="world sizes (default 2,4,8)")
    p.add_argument("--ref", default="main", help="the commit compared with (default main); "
                   "'none': this tree only")
    p.add_argument("--data", type=Path, help="a prepared dataset (default: a small stdlib one)")
    p.add_argument("--extrapolate", type=int, default=1024, help="ranks to extrapolate to")
    p.add_argument("--timeout", type=float, default=900, help="seconds for a job to reach step 3")
    p.add_argument("--samples", type=int, default=3, help="samples of each rank's descriptors "
                   "a job, a second apart, the largest kept (default 3)")
    p.add_argument("--json", type=Path, help="write the figures here as well")
    args = p.parse_args()
    if args.samples < 1:
        p.error("--samples: at least 1")
    sizes = [int(s) for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench_fds.") as tmp:
        work = Path(tmp)
        data = args.data or prepare_default(work)
        trees = {"this": REPO}
        if args.ref != "none":
            trees[args.ref] = reference_tree(args.ref, work)
        results: dict[str, dict] = {name: {} for name in trees}
        for n in sizes:  # alternating, so both trees see the same load on the box
            for name, tree in trees.items():
                results[name][n] = measure(tree, n, data, work, args.timeout, args.samples)
                print(f"{name} at {n} ranks: {results[name][n]}", file=sys.stderr, flush=True)
        rows = summarize(results, sizes, args.extrapolate)
    print_table(rows, sizes, args.extrapolate)
    if args.json:
        args.json.write_text(json.dumps({"sizes": sizes, "rows": rows, "raw": {
            t: {n: {str(r): v for r, v in per.items()} for n, per in by.items()}
            for t, by in results.items()}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
