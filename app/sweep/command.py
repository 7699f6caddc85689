"""`python -m app bench --data DIR --out DIR --sweep world=1,2 zero=0,3 model=A,B --steps N`:
the scaling sweep, the paper's Figure 1 for the machine or cluster at hand.

Each configuration of the sweep (app/sweep/configs.py: the cartesian product, one thread count
and loader worker count per rank for all) is a short real `app train` started through
`launch.sh`, so a sweep over nodes (`--hostfile`) runs exactly as training does. Its figures are
read from the run's metrics.jsonl (app/sweep/results.py); nothing is timed here.

    OUT/sweep.json            what was asked (configurations, steps, data, train arguments)
    OUT/results/<config>.json one file a configuration, written atomically when it is done
    OUT/runs/<config>/        its run directory (metrics.jsonl, summary.json, config.json)
    OUT/runs/<config>.log     its launcher's output (the error line of a failure comes from it)
    OUT/results.csv, results.md, throughput.png, scaling_efficiency.png, memory.png

Resumable: a sweep stopped in any way (Ctrl-C, SIGTERM, SIGKILL, a lost machine) continues with
the same command where it stopped: configurations with a results file are not run again; the
interrupted one starts over (processes a killed sweep left behind carry its tag in their
environment and are stopped first). A configuration that fails (out of memory, a crash, a bad
flag, a timeout) is recorded with its error line and the sweep goes on (`--retry-failed` runs
those again). A different sweep into the same OUT is refused (`--overwrite` starts it over,
removing only what bench wrote there).
"""
from __future__ import annotations

import argparse
import fcntl
import os
import platform
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import app
from app.config import TrainConfig
from app.plan.probe import interrupt_on_term, kill_tagged, remove_shm_buffers, run_probe
from app.runtime.dist import free_port
from app.sweep import configs as sweep
from app.sweep import results as bench_results
from app.sweep.configs import Config
from data_tools import output
from data_tools.errors import Parser, UserError
from data_tools.schema import read_json

KIND, COMMAND = "benchmark sweep", "app bench"
SWEEP, RESULTS, RUNS, LOCK = "sweep.json", "results", "runs", ".bench.lock"
TABLES = ("results.csv", "results.md")
TAG = "DSPRETRAIN_BENCH"  # in the environment of every process a configuration starts
LAUNCH = Path(app.__file__).resolve().parent.parent / "launch.sh"
NETSIM = LAUNCH.parent / "bench" / "netsim.py"  # the simulated cluster a `rate` key runs on
# app train flags bench sets for every run (or a sweep key does): not accepted after `--`
OWN_FLAGS = {"--data", "--out", "--model", "--zero", "--ds-config", "--micro-batch", "--seq-len",
             "--num-workers", "--max-steps", "--max-tokens", "--stop-at-step", "--log-every",
             "--eval-every", "--eval-samples", "--save-every", "--resume", "--overwrite",
             "--wandb", "--global-batch", "--stage-to", "--local_rank", "--local-rank"}


class _Once(argparse.Action):
    """Store a list flag that may be given once: argparse's default keeps only the last of two
    `--sweep`s, so the first one's keys would vanish without a word."""

    def __call__(self, parser, namespace, values, option_string=None):
        seen = f"_{self.dest}_given"
        if getattr(namespace, seen, False):
            parser.error(f"{option_string} given twice: put every key in one {option_string}")
        setattr(namespace, seen, True)
        setattr(namespace, self.dest, values)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", type=Path, required=True, metavar="DIR",
                   help="dataset directory (made by data_tools prepare)")
    p.add_argument("--out", type=Path, required=True, metavar="DIR",
                   help="where results.csv, results.md, the plots and the runs go")
    p.add_argument("--sweep", nargs="+", default=[], metavar="KEY=V1,V2", action=_Once,
                   help=f"the values to sweep; keys: {', '.join(sweep.KEYS)} (defaults: world=1 "
                        f"zero=0 model=bert-tiny micro_batch=32, seq_len as app train; threads "
                        f"and workers per rank: what the most ranks per node leave each rank; "
                        f"rate=200mbit,1gbit runs on the simulated cluster, bench/netsim.py, "
                        f"one rank a node unless nodes=N; root only)")
    p.add_argument("--steps", type=int, default=20, metavar="N",
                   help="optimizer steps a configuration runs; the first log interval (a tenth "
                        "of them) is warm-up, left out of the figures (default 20)")
    p.add_argument("--hostfile", type=Path, metavar="FILE",
                   help="DeepSpeed hostfile for world sizes beyond this box (launch.sh's)")
    p.add_argument("--timeout", type=float, default=1800.0, metavar="S",
                   help="seconds before a configuration counts as failed (default 1800)")
    p.add_argument("--retry-failed", action="store_true",
                   help="run the configurations recorded as failed again")
    p.add_argument("--overwrite", action="store_true",
                   help="start over in an OUT that holds another sweep (only bench's files go)")
    p.add_argument("train_args", nargs=argparse.REMAINDER, metavar="-- TRAIN_ARGS",
                   help="app train flags for every configuration, after `--` (e.g. -- "
                        "--model-arg num_hidden_layers=4 --dropout 0)")


# -- what was asked ------------------------------------------------------------------------------

def train_args(extra: list[str], data: Path) -> list[str]:
    """The `app train` flags after `--`, checked as app train would (one line on a bad one)."""
    extra = extra[1:] if extra[:1] == ["--"] else extra
    for arg in extra:
        name = arg.split("=", 1)[0]
        if name in OWN_FLAGS:
            raise UserError(f"{arg}: app bench sets this flag itself (sweep it with --sweep, "
                            f"or see `python -m app bench --help`)")
    parser = Parser(prog="python -m app bench -- (app train arguments)")
    from app.config import add_arguments as train_flags

    train_flags(parser)
    TrainConfig.from_args(parser.parse_args(["--data", str(data), "--out", "-", *extra]))
    return extra


def plan(args: argparse.Namespace) -> tuple[list[Config], dict[str, Any]]:
    """The configurations and the sweep's identity (sweep.json), every input checked."""
    from app.data.loader import default_num_workers
    from app.runtime.device import usable_cores
    from data_tools.manifest import load_manifest

    if args.steps < 2:
        raise UserError(f"--steps {args.steps}: at least 2 (the first log interval is warm-up)")
    if not args.timeout > 0:
        raise UserError(f"--timeout {args.timeout}: must be positive")
    if not args.sweep:
        raise UserError("--sweep: give at least one KEY=V1,V2 (e.g. world=1,2)")
    values = sweep.parse(args.sweep)
    manifest = load_manifest(args.data)
    extra = train_args(args.train_args, args.data)
    hostfile = args.hostfile.resolve() if args.hostfile else None
    slots = sweep.hostfile_slots(hostfile) if hostfile else None
    env_threads = os.environ.get("OMP_NUM_THREADS")
    configs = sweep.expand(values, slots=slots, cores=usable_cores(),
                           env_threads=int(env_threads) if env_threads
                           and env_threads.isdigit() and int(env_threads) > 0 else None,
                           default_workers=default_num_workers)
    identity = {"configurations": [c.id for c in configs], "steps": args.steps,
                "data": str(args.data.resolve()), "data_fingerprint": manifest["fingerprint"],
                "train_args": extra, "hostfile": None if hostfile is None else str(hostfile)}
    return configs, identity


def log_every(steps: int) -> int:
    """Ten log intervals a run (the first is warm-up); every step for short runs."""
    return max(1, steps // 10)


# -- the output directory ------------------------------------------------------------------------

def open_out(out: Path, data: Path, identity: dict[str, Any], overwrite: bool) -> None:
    """Create OUT, continue the same sweep in it, or (--overwrite) start another over; refuse a
    directory bench did not make."""
    output.check_apart(out, [("--data", data)])
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        if output.marked_as(out) != KIND:
            raise UserError(f"--out {out}: not empty and not a {KIND} made by `{COMMAND}`; "
                            f"choose an empty or new directory (nothing was changed)")
        old = read_json(out / SWEEP) if (out / SWEEP).is_file() else None
        if old is not None and old != identity:
            if not overwrite:
                raise UserError(f"--out {out}: holds another sweep ({differences(old, identity)})"
                                f"; run that command to continue it, or use --overwrite to start "
                                f"this one there, or another --out")
            clear(out)
    output.make_dirs(out)
    if output.marked_as(out) != KIND:
        with output.writing(out):
            output.mark(out, KIND, COMMAND)
    output.write_json_atomic(out / SWEEP, identity)
    output.make_dirs(out / RESULTS)
    output.make_dirs(out / RUNS)


def differences(old: dict[str, Any], new: dict[str, Any]) -> str:
    """What changed between two sweeps, briefly."""
    said = []
    added = [c for c in new["configurations"] if c not in old.get("configurations", [])]
    dropped = [c for c in old.get("configurations", []) if c not in new["configurations"]]
    if added or dropped:
        said.append(f"configurations: {len(added)} new, {len(dropped)} not in this one"
                    + (f", e.g. {(added or dropped)[0]}" if added or dropped else ""))
    for key in ("steps", "data", "data_fingerprint", "train_args", "hostfile"):
        if old.get(key) != new.get(key):
            said.append(f"{key} {old.get(key)} -> {new.get(key)}")
    return "; ".join(said) or "written by another version"


def clear(out: Path) -> None:
    """--overwrite: remove what bench writes, nothing else."""
    with output.writing(out):
        for d in (RESULTS, RUNS):
            shutil.rmtree(out / d, ignore_errors=True)
        for name in (SWEEP, *TABLES, *bench_results.PLOTS):
            (out / name).unlink(missing_ok=True)


def hold_lock(out: Path):
    """One sweep at a time in an OUT: an flock for the life of this process."""
    f = open(out / LOCK, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        raise UserError(f"--out {out}: another `{COMMAND}` is running into it") from None
    return f


# -- one configuration ---------------------------------------------------------------------------

def run_config(c: Config, args: argparse.Namespace, identity: dict[str, Any],
               out: Path) -> dict[str, Any]:
    """Run one configuration through launch.sh; its record for results/<id>.json."""
    run_dir = out / RUNS / c.id
    shutil.rmtree(run_dir, ignore_errors=True)  # what an interrupted attempt left
    port = free_port()
    hostfile = Path(identity["hostfile"]) if identity["hostfile"] else None
    cmd = [*starter(c, hostfile, port, args.timeout), "--",
           "--data", identity["data"], "--out", str(run_dir.resolve()), *c.train_flags(),
           "--max-steps", str(args.steps), "--log-every", str(log_every(args.steps)),
           "--eval-samples", "1", "--save-every", "0", "--wandb", "disabled",
           "--resume", "never", *identity["train_args"]]
    env = {**os.environ, "OMP_NUM_THREADS": str(c.threads), "WANDB_MODE": "disabled",
           "TOKENIZERS_PARALLELISM": "false", "PYTHON": sys.executable,
           TAG: str(out.resolve())}
    load = OtherLoad()
    try:
        result = run_probe(cmd, run_dir, budget_bytes=None, timeout=args.timeout,
                           watch_rss=False, env=env, poll=0.2)
    finally:
        kill_tagged(TAG, str(out.resolve()))  # ranks in the runner's own process group
        if c.rate:  # the namespaces of a netsim that was killed (it removes them on any stop)
            subprocess.run([sys.executable, str(NETSIM), "clean"], capture_output=True)
        if c.procs_per_node > 1:
            remove_shm_buffers(port)
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # of no use, and large
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    record: dict[str, Any] = {"config": c.as_dict(), "seconds": round(result.seconds, 1),
                              "run_dir": str(Path(RUNS) / c.id), "finished_at": now,
                              "other_load_cores": load.cores()}
    if not result.ok:
        status, _, error = result.reason.partition(": ")
        return {**record, "status": status, "error": error or result.reason}
    try:
        figures = bench_results.run_figures(run_dir, c.world)
    except (ValueError, UserError) as e:
        return {**record, "status": "failed", "error": str(e)}
    return {**record, "status": "ok", "error": None, "figures": figures}


def starter(c: Config, hostfile: Path | None, port: int, timeout: float) -> list[str]:
    """What starts the configuration's ranks: launch.sh on this box or the hostfile's nodes, or
    the simulated cluster (bench/netsim.py run, which starts launch.sh --no-ssh in each node)."""
    if not c.rate:
        return ["bash", str(LAUNCH), *c.launch_flags(hostfile, port)]
    if not NETSIM.is_file():
        raise UserError(f"--sweep rate=...: {NETSIM} is missing (the simulated cluster comes "
                        f"with the project's checkout)")
    return [sys.executable, str(NETSIM), "run", "--nodes", str(c.nodes), "--procs-per-node",
            str(c.procs_per_node), "--rate", c.rate, "--threads", str(c.threads),
            "--timeout", str(timeout)]


class OtherLoad:
    """How many of this host's cores other processes kept busy while a configuration ran: the
    host's busy CPU time minus what the run's own processes used (they are reaped by then, so
    their time is in this process's RUSAGE_CHILDREN), over the wall time. On a shared machine
    it says which figures to trust: 2 ranks on 2 cores scale only when nothing else runs."""

    def __init__(self):
        self.start = (time.monotonic(), cpu_busy_seconds(), self._children())

    @staticmethod
    def _children() -> float:
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        return usage.ru_utime + usage.ru_stime

    def cores(self) -> float | None:
        t0, busy0, own0 = self.start
        busy = cpu_busy_seconds()
        wall = time.monotonic() - t0
        if busy is None or busy0 is None or wall <= 0:
            return None
        return round(max(0.0, (busy - busy0) - (self._children() - own0)) / wall, 2)


def cpu_busy_seconds() -> float | None:
    """CPU seconds this host has spent busy since boot, over all its processes and every user
    (/proc/stat: everything but idle and iowait); None where there is no /proc/stat."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


# -- the sweep -----------------------------------------------------------------------------------

def load_results(out: Path, configs: list[Config]) -> dict[str, dict[str, Any]]:
    """The records of configurations already measured (a torn or foreign file: measured again)."""
    done = {}
    for c in configs:
        path = out / RESULTS / f"{c.id}.json"
        try:
            record = read_json(path) if path.is_file() else None
        except UserError:
            record = None
        if isinstance(record, dict) and record.get("config") == c.as_dict():
            done[c.id] = record
    return done


def write_tables(out: Path, configs: list[Config], done: dict[str, dict[str, Any]],
                 header: list[str], with_plots: bool) -> list[dict[str, Any]]:
    table = bench_results.rows(done[c.id] for c in configs if c.id in done)
    output.write_text_atomic(out / TABLES[0], bench_results.csv_text(table))
    output.write_text_atomic(out / TABLES[1], bench_results.markdown(table, header))
    if with_plots:
        for name, data in bench_results.plots(table, configs).items():
            output.write_bytes_atomic(out / name, data)
    return table


def progress(n: int, total: int, c: Config, record: dict[str, Any], row: dict[str, Any] | None,
             eta: str, keys: frozenset[str]) -> str:
    head = f"[{n}/{total}] {c.label(keys | {'world'})}: {record['status']}"
    if record["status"] != "ok" or row is None:
        return f"{head} ({record.get('error')}); {record['seconds']:.0f} s; {eta}"
    f = row
    parts = [f"{f['tokens_per_sec']:,.0f} tokens/s ({f['tokens_per_sec_per_device']:,.0f} a "
             f"device)", f"{f['step_time_ms']:,.1f} ms/step", f"data wait "
             f"{f['data_wait_pct']:.1f}% (slowest rank {f['data_wait_pct_max']:.1f}%)"]
    if f.get("peak_mem_gb") is not None:
        parts.append(f"peak {f['peak_mem_gb']:.2f} GiB/rank")
    if f.get("scaling_efficiency") is not None:
        parts.append(f"scaling efficiency {f['scaling_efficiency']:.2f}")
    if record.get("other_load_cores"):
        parts.append(f"other processes busy on {record['other_load_cores']:.1f} core(s)")
    return f"{head}, {', '.join(parts)}; {record['seconds']:.0f} s; {eta}"


def eta_text(durations: list[float], left: int) -> str:
    if left == 0:
        return "sweep done"
    if not durations:
        return f"{left} left"
    seconds = int(statistics.mean(durations) * left)
    return f"{left} left, ETA {seconds // 60}m{seconds % 60:02d}s"


def header_lines(identity: dict[str, Any]) -> list[str]:
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in _read("/proc/cpuinfo").splitlines()
                if line.startswith("model name")), platform.machine())
    mem = next((int(line.split()[1]) / 2**20 for line in _read("/proc/meminfo").splitlines()
                if line.startswith("MemTotal")), 0.0)
    from app.runtime.device import usable_cores

    return ["# Benchmark sweep", "",
            f"- command: `python -m app {shlex.join(sys.argv[1:])}`",
            f"- machine: {platform.node()}, {cpu}, {usable_cores()} cores, {mem:.0f} GiB RAM; "
            f"Python {platform.python_version()}, torch {torch.__version__}",
            f"- data: {identity['data']}; {identity['steps']} steps a configuration, log every "
            f"{log_every(identity['steps'])}, the first interval left out (warm-up); figures are "
            f"medians over the other intervals",
            f"- written {datetime.now(timezone.utc).isoformat(timespec='seconds')}"]


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def run(args: argparse.Namespace) -> int:
    if not LAUNCH.is_file():
        raise UserError(f"{LAUNCH}: launch.sh is not next to the app package (install the project "
                        f"from its checkout: pip install -e .)")
    configs, identity = plan(args)
    out = args.out
    with interrupt_on_term():
        open_out(out, args.data, identity, args.overwrite)
        lock = hold_lock(out)
        try:
            return sweep_all(args, configs, identity, out)
        finally:
            lock.close()


def sweep_all(args: argparse.Namespace, configs: list[Config], identity: dict[str, Any],
              out: Path) -> int:
    left_over = kill_tagged(TAG, str(out.resolve()))
    if left_over:
        print(f"stopped {len(left_over)} process(es) an interrupted sweep into {out} left "
              f"running", file=sys.stderr, flush=True)
    done = load_results(out, configs)
    if args.retry_failed:
        done = {k: v for k, v in done.items() if v["status"] == "ok"}
    todo = [c for c in configs if c.id not in done]
    keys = sweep.varying(configs)
    print(f"bench: {len(configs)} configuration(s) ({len(configs) - len(todo)} measured "
          f"already), {args.steps} steps each, {configs[0].threads} thread(s) and "
          f"{configs[0].workers} loader worker(s) a rank; results in {out}",
          file=sys.stderr, flush=True)
    header = header_lines(identity)
    durations: list[float] = []
    for i, c in enumerate(todo):
        n = len(configs) - len(todo) + i + 1
        print(f"[{n}/{len(configs)}] {c.label(keys | {'world'})}: running "
              f"({c.nodes} node(s) x {c.procs_per_node} rank(s))", file=sys.stderr, flush=True)
        try:
            record = run_config(c, args, identity, out)
        except KeyboardInterrupt:
            shutil.rmtree(out / RUNS / c.id, ignore_errors=True)
            print(f"bench: interrupted; {n - 1} of {len(configs)} configurations measured; the "
                  f"same command continues", file=sys.stderr, flush=True)
            raise
        output.write_json_atomic(out / RESULTS / f"{c.id}.json", record)
        done[c.id] = record
        durations.append(record["seconds"])
        table = write_tables(out, configs, done, header, with_plots=False)
        row = next((r for r in table if r["run_dir"] == record["run_dir"]), None)
        print(progress(n, len(configs), c, record, row,
                       eta_text(durations, len(todo) - i - 1), keys), flush=True)
    table = write_tables(out, configs, done, header, with_plots=True)
    ok = [r for r in table if r["status"] == "ok"]
    print(f"bench: {len(ok)} of {len(table)} configuration(s) ran; {out / TABLES[0]}, "
          f"{out / TABLES[1]}, {', '.join(bench_results.PLOTS)}", file=sys.stderr, flush=True)
    return 0 if ok else 1
