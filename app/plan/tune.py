"""`python -m app tune <app train arguments>`: measure, on this machine, with real steps.

1. The largest micro batch that runs for each requested ZeRO stage: a search over short real
   runs (app.plan.probe, one process group each, so an out-of-memory failure or a budget overrun
   costs that probe only). The planner (app.plan.memory) seeds it: the first probe runs micro batch
   1 and calibrates the planner's runtime term, the second tries the planned maximum, then the
   search doubles or bisects until the gap is within ~6%.
2. Then, at that micro batch, the smallest `--num-workers` whose data wait stays under 1% of
   the step time (`perf/data_wait_pct`).

It prints a line per probe and the result with the measurements behind it, and writes
OUT/ds_config.json, OUT/train.args (the flags that use it, one per line, for
`./launch.sh -- $(cat OUT/train.args) --out RUN_DIR`) and OUT/tune.json (every probe).
Ctrl-C (or SIGTERM) stops the running probe's whole process group and removes the probes'
directories; the outputs are written atomically at the very end, so nothing half-written stays.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Callable

from app import config as config_mod
from app.config import TrainConfig
from app.data.sources import read_sources
from app.plan.memory import CPU, GPU, GiB, Workload, ZeroSetup
from app.plan.probe import ProbeResult, interrupt_on_term, remove_shm_buffers, run_probe
from app.runtime.device import accelerator_memory_bytes, usable_cores
from app.runtime.dist import free_port
from data_tools import output
from data_tools.errors import UserError
from data_tools.manifest import MANIFEST
from data_tools.output import check_apart, write_json_atomic, write_text_atomic

# Flags tune sets on every probe (the user's values of these are not passed through).
PROBE_FLAGS = {"out", "micro_batch", "num_workers", "max_steps", "log_every", "eval_every",
               "eval_samples", "save_every", "resume", "overwrite", "wandb", "zero", "ds_config",
               "grad_accum", "global_batch", "max_tokens", "stop_at_step", "stage_to",
               "local_rank"}
PINNED = {"data", "model", "seq_len"}
# Flags the written run flags leave out (tune's choices replace them; --out is the user's).
OUTPUT_SKIP = {"out", "micro_batch", "num_workers", "zero", "ds_config", "local_rank"}
SEARCH_TOLERANCE = 16  # stop bisecting when the gap is at most 1/16 of the largest that ran
UP_FROM_GUESS = (1.125, 1.25, 1.5, 2.0)  # the steps up from a planner's guess that ran


@dataclass(frozen=True)
class TuneSettings:
    """tune's own flags (the rest are `app train` flags, passed to every probe)."""

    stages: tuple[int, ...]
    """ZeRO stages to try (--zero 0,3); empty when --ds-config is given."""
    ranks: int
    """Ranks per probe (the deepspeed launcher starts them when more than one)."""
    mem_bytes: int
    """Memory budget per rank, enforced on every probe."""
    max_micro_batch: int
    """Upper end of the search."""
    max_workers: int
    data_wait_pct: float
    """Target: data wait below this share of the step time."""
    probe_steps: int
    probe_timeout: float
    out: Path
    cpu: bool
    """Probes run on the CPU: the watchdog enforces the budget on each rank's resident memory."""


def next_micro_batch(ran: set[int], failed: set[int], cap: int, guess: int | None) -> int | None:
    """The next micro batch to probe, or None when the search is done. Pure.

    1 first (does it run at all; calibrates the planner), then the planner's `guess`. With no
    failure yet: up from a confirmed guess by 12.5%, then 25%, 50%, then doubling (a planner
    that is 20% low costs two probes more, not a double and three bisections back down), else
    double; below a failed guess: down by 12.5%, then 25% steps (three at most); otherwise
    bisect (on a log scale while the bounds are more than 2x apart). Done when nothing runs, at
    the cap, or when the gap is within 1/SEARCH_TOLERANCE.
    """
    if not ran and not failed:
        return 1
    lo = max(ran, default=0)
    hi = min(failed, default=cap + 1)
    if lo == 0 or lo >= cap or hi - lo <= max(1, lo // SEARCH_TOLERANCE):
        return None
    guess = None if guess is None else min(max(guess, 1), cap)
    if guess is not None and lo < guess < hi and guess not in ran | failed:
        return guess
    if hi > cap:
        factor = 2.0
        if guess is not None and lo >= guess:  # the guess ran: how many steps above it so far
            factor = UP_FROM_GUESS[min(sum(1 for m in ran if m > guess), len(UP_FROM_GUESS) - 1)]
        return min(cap, max(lo + 1, math.ceil(lo * factor)))
    if guess is not None and lo == 1 and hi <= guess and len(failed) <= 3:  # step down
        down = int(hi * (0.875 if hi == guess else 0.75))
        if down > lo:
            return down
    if hi > 2 * lo:
        return max(lo + 1, int(math.sqrt(lo * hi)))  # far apart: bisect on a log scale
    return (lo + hi) // 2


def pick_workers(waits: dict[int, float], target_pct: float) -> int | None:
    """The smallest worker count whose data wait is under target (None: none measured is)."""
    good = [w for w, pct in waits.items() if pct < target_pct]
    return min(good) if good else None


def fit_global_batch(micro: int, global_batch: int | None, ranks: int) -> int:
    """The largest micro batch <= `micro` that divides the user's --global-batch over ranks."""
    if not global_batch:
        return micro
    per_rank = global_batch // ranks
    return max((m for m in range(1, micro + 1) if per_rank % m == 0), default=1)


def train_flags(values: dict[str, Any], skip: set[str]) -> list[str]:
    """`app train` flags for the TrainConfig values in `values` that differ from the defaults,
    and always the data, model and sequence length (a default may change). Pure."""
    out: list[str] = []
    for f in fields(TrainConfig):
        if f.name in skip or f.name not in values:
            continue
        value = values[f.name]
        default = f.default_factory() if callable(f.default_factory) else f.default
        if value is None or value is False or (value == default and f.name not in PINNED):
            continue
        flag = "--" + f.name.replace("_", "-")
        if value is True:
            out.append(flag)
        elif isinstance(value, list):
            for item in value:
                out += [flag, str(item)]
        else:
            out += [flag, str(Path(value).resolve()) if isinstance(value, Path) else str(value)]
    return out


@dataclass
class Probe:
    """One probe's settings and what it measured."""

    label: str
    """The ZeRO setup ("ZeRO-0" or the --ds-config file name)."""
    micro_batch: int
    workers: int
    result: ProbeResult

    def as_dict(self) -> dict[str, Any]:
        r = self.result
        return {"setup": self.label, "micro_batch": self.micro_batch, "num_workers": self.workers,
                "ok": r.ok, "reason": r.reason,
                "peak_gb": None if r.peak_bytes is None else round(r.peak_bytes / GiB, 4),
                "step_time_ms": r.step_time_ms, "data_wait_pct": r.data_wait_pct,
                "tokens_per_sec": r.tokens_per_sec, "seconds": round(r.seconds, 1)}


@dataclass(frozen=True)
class Candidate:
    """A ZeRO setup to try: its label, the train flags that select it, its ds config."""

    label: str
    flags: tuple[str, ...]
    ds_config: dict[str, Any]
    setup: ZeroSetup


class Prober:
    """Runs numbered probes into one directory; hands each finished one to `report`."""

    def __init__(self, base_flags: list[str], settings: TuneSettings, probes_dir: Path,
                 report: Callable[[int, Probe], None]):
        self.base_flags, self.settings, self.dir = base_flags, settings, probes_dir
        self.report = report
        self.done: list[Probe] = []

    def __call__(self, cand: Candidate, micro: int, workers: int, steps: int,
                 log_every: int) -> Probe:
        s = self.settings
        run_dir = self.dir / f"{len(self.done) + 1:02d}-mb{micro}-w{workers}"
        flags = [*self.base_flags, *cand.flags, "--out", str(run_dir), "--micro-batch",
                 str(micro), "--num-workers", str(workers), "--max-steps", str(steps),
                 "--log-every", str(log_every), "--eval-samples", "1", "--wandb", "disabled",
                 "--resume", "never"]
        env = {**os.environ, "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}
        # The batch search settles memory (workers 0); loader workers are processes of their
        # own, so a worker probe is not stopped for a rank's few MB of noise at the edge.
        budget = s.mem_bytes if workers == 0 else None
        port = free_port()
        try:
            # Killed at once when stopped: SIGTERM would have `app train` finish its start-up or
            # step and save a checkpoint (app/faults/preemption.py), seconds of CPU and of memory
            # over the budget for a run whose outcome is settled. Every process of the probe is
            # in its group; the shared-memory buffers are removed below.
            result = run_probe(probe_command(flags, s.ranks, port), run_dir, budget_bytes=budget,
                               timeout=s.probe_timeout, watch_rss=s.cpu, env=env, term=False)
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)  # checkpoints of a probe are of no use
            if s.ranks > 1 and s.cpu:
                remove_shm_buffers(port)
        probe = Probe(cand.label, micro, workers, result)
        self.done.append(probe)
        self.report(len(self.done), probe)
        return probe


def probe_command(flags: list[str], ranks: int, port: int) -> list[str]:
    """`python -m app train FLAGS`, through the deepspeed launcher for more than one rank."""
    if ranks == 1:
        return [sys.executable, "-m", "app", "train", *flags]
    return [sys.executable, "-m", "app.runtime.runner", "--num_gpus", str(ranks),
            "--master_port", str(port), "--no_local_rank", "--module", "app", "train", *flags]


def progress_line(n: int, p: Probe, budget: int) -> str:
    r = p.result
    parts = [f"probe {n}: {p.label} micro batch {p.micro_batch}, {p.workers} worker(s): "
             f"{r.reason}"]
    if r.peak_bytes is not None:
        parts.append(f"peak {r.peak_bytes / GiB:.2f} of {budget / GiB:.2f} GB")
    if r.step_time_ms is not None:
        parts.append(f"{r.step_time_ms:,.0f} ms/step")
    if r.data_wait_pct is not None:
        parts.append(f"data wait {r.data_wait_pct:.2f}%")
    return ", ".join(parts) + f" ({r.seconds:.0f} s)"


def search_micro_batch(probe: Prober, cand: Candidate, settings: TuneSettings,
                       planner) -> list[Probe]:
    """Probes (workers 0) until `next_micro_batch` is done; `planner(probe_at_1)` -> guess."""
    ran: set[int] = set()
    failed: set[int] = set()
    guess = None
    out = []
    while (micro := next_micro_batch(ran, failed, settings.max_micro_batch, guess)) is not None:
        p = probe(cand, micro, 0, steps=settings.probe_steps, log_every=1)
        out.append(p)
        if p.result.ok:
            ran.add(micro)
        elif micro == 1 and p.result.reason.startswith("failed"):
            raise UserError(f"tune: {cand.label} does not train at micro batch 1: "
                            f"{p.result.reason[len('failed: '):]}")
        else:
            failed.add(micro)
        if micro == 1 and p.result.ok:
            guess = planner(cand, p.result)
    return out


def search_workers(probe: Prober, cand: Candidate, best: Probe,
                   settings: TuneSettings) -> dict[int, float]:
    """Data wait (%) per worker count, from 0 (the batch search's own probe) upwards until one
    is under the target."""
    waits = {}
    if best.result.data_wait_pct is not None:
        waits[0] = best.result.data_wait_pct
    for workers in range(1, settings.max_workers + 1):
        if pick_workers(waits, settings.data_wait_pct) is not None:
            break
        # 4 steps, logged in windows of 2: the last window starts after the workers' warm-up
        p = probe(cand, best.micro_batch, workers, steps=4, log_every=2)
        if p.result.ok and p.result.data_wait_pct is not None:
            waits[workers] = p.result.data_wait_pct
    return waits


def planner_guess(info, work: Workload, cpu: bool, budget: int):
    """A function (candidate, probe at micro batch 1) -> the planner's largest micro batch, with
    its runtime term calibrated on that probe (None when the planner cannot say)."""
    from app.plan.memory import calibrate_runtime, max_micro_batch, plan_memory

    def guess(cand: Candidate, first: ProbeResult) -> int | None:
        if info is None or first.peak_bytes is None:
            return None
        device = CPU if cpu else GPU
        planned = plan_memory(info.shape, info.size, cand.setup, work, device)
        device = replace(device, runtime_bytes=calibrate_runtime(first.peak_bytes, planned))
        return max_micro_batch(info.shape, info.size, cand.setup, work, device, budget) or None

    return guess


@dataclass(frozen=True)
class TuneResult:
    """What tune found, with the probes behind it."""

    chosen: Candidate
    best: Probe
    """The chosen setup's probe at its largest micro batch (workers 0)."""
    per_setup: dict[str, Probe | None]
    """Each tried setup's best probe (None: not even micro batch 1 ran)."""
    micro_batch: int
    """The micro batch to run (the largest that ran, fitted to --global-batch if given)."""
    workers: int
    waits: dict[int, float]
    probes: list[Probe]
    capped: bool
    """The search stopped at --max-micro-batch, not at a failure."""


def tune(cands: list[Candidate], settings: TuneSettings, probe: Prober, planner,
         global_batch: int | None) -> TuneResult:
    """Search each setup's largest micro batch, pick the fastest, then the loader workers."""
    per_setup: dict[str, Probe | None] = {}
    for cand in cands:
        probes = search_micro_batch(probe, cand, settings, planner)
        ran = [p for p in probes if p.result.ok]
        per_setup[cand.label] = max(ran, key=lambda p: p.micro_batch) if ran else None
    fitting = [c for c in cands if per_setup[c.label] is not None]
    if not fitting:
        first = probe.done[0].result
        raise UserError(f"tune: micro batch 1 does not fit in {settings.mem_bytes / GiB:.2f} GB "
                        f"per rank with any of {', '.join(c.label for c in cands)} "
                        f"({first.reason}; peak {_gb(first.peak_bytes)} GB); raise --mem-gb, try "
                        f"--zero 3, --gradient-checkpointing or a shorter --seq-len")
    chosen = max(fitting, key=lambda c: per_setup[c.label].result.tokens_per_sec or 0.0)
    best = per_setup[chosen.label]
    micro = fit_global_batch(best.micro_batch, global_batch, settings.ranks)
    if micro != best.micro_batch:  # measure the loader at the batch that will run
        best = probe(chosen, micro, 0, steps=settings.probe_steps, log_every=1)
    waits = search_workers(probe, chosen, best, settings)
    workers = pick_workers(waits, settings.data_wait_pct)
    if workers is None:
        workers = min(waits, key=waits.get) if waits else 0
    return TuneResult(chosen, best, per_setup, micro, workers, waits, list(probe.done),
                      capped=best.micro_batch >= settings.max_micro_batch)


def _gb(n: int | None) -> str:
    return "?" if n is None else f"{n / GiB:.2f}"


def report_lines(res: TuneResult, settings: TuneSettings) -> list[str]:
    """The result and the measurements behind it, for the console. Pure."""
    b = res.best.result
    failed = [p for p in res.probes if p.label == res.chosen.label and not p.result.ok
              and p.micro_batch > res.best.micro_batch]
    if res.capped:
        why = f"the search cap, --max-micro-batch {settings.max_micro_batch}"
    elif failed:
        nxt = min(failed, key=lambda p: p.micro_batch)
        why = f"{nxt.micro_batch} did not: {nxt.result.reason}"
    else:
        why = "the largest that ran"
    lines = [f"largest micro batch: {res.best.micro_batch} with {res.chosen.label} ({why}); "
             f"peak {_gb(b.peak_bytes)} of {settings.mem_bytes / GiB:.2f} GB per rank, "
             f"{b.step_time_ms or 0:,.0f} ms/step, {b.tokens_per_sec or 0:,.0f} tokens/s"]
    for label, p in res.per_setup.items():
        if label != res.chosen.label:
            lines.append(f"  {label}: " + (f"largest micro batch {p.micro_batch}, "
                                           f"{p.result.tokens_per_sec or 0:,.0f} tokens/s"
                                           if p else "micro batch 1 does not fit"))
    if res.micro_batch != res.best.micro_batch:
        lines.append(f"micro batch to run: {res.micro_batch} (divides --global-batch)")
    waits = ", ".join(f"{w} worker(s) {pct:.2f}%" for w, pct in sorted(res.waits.items()))
    met = pick_workers(res.waits, settings.data_wait_pct) is not None
    lines.append(f"loader workers: {res.workers} (data wait {'under' if met else 'NOT under'} "
                 f"{settings.data_wait_pct:g}% of the step time; measured: {waits or 'nothing'})")
    return lines


class _Redefined:
    """Hands `app train`'s flags to the parser, except those tune defines its own way."""

    def __init__(self, parser: argparse.ArgumentParser, skip: set[str]):
        self.parser, self.skip = parser, skip

    def add_argument(self, *names: str, **kwargs: Any) -> None:
        if not self.skip.intersection(names):
            self.parser.add_argument(*names, **kwargs)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`app train`'s flags (passed to every probe) with --out optional and --zero a list,
    plus tune's own; no --config (a run's file would aim tune's --out at the run)."""
    config_mod.add_arguments(_Redefined(parser, {"--out", "--zero", "--config"}))
    a = parser.add_argument
    a("--out", type=Path, metavar="DIR",
      help="where to write ds_config.json, train.args and tune.json (default runs/tune-MODEL)")
    a("--zero", type=_stages, metavar="N[,N...]",
      help="ZeRO stage(s) to try, e.g. 0,3 (default 0; or --ds-config FILE)")
    a("--ranks", type=int, default=1, metavar="N",
      help="ranks per probe, started by the deepspeed launcher when more than 1 (default 1)")
    a("--mem-gb", type=float, metavar="G", help="memory budget per rank in GiB, enforced on "
      "every probe (default: the accelerator's memory; on CPU a quarter of RAM, at most half of "
      "what is available, shared by the ranks)")
    a("--max-micro-batch", type=int, metavar="N",
      help="upper end of the search (default 1024; 128 on CPU, where steps are compute-bound "
           "long before memory runs out)")
    a("--max-workers", type=int, metavar="N",
      help="most loader workers to try (default: the cores per rank, at most 8)")
    a("--data-wait-pct", type=float, default=1.0, metavar="F",
      help="data-wait target, %% of step time (default 1)")
    a("--probe-steps", type=int, default=3, metavar="N",
      help="optimizer steps per batch-size probe (default 3)")
    a("--probe-timeout", type=float, default=600.0, metavar="S",
      help="seconds before a probe counts as failed (default 600)")


def _stages(text: str) -> tuple[int, ...]:
    try:
        stages = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected N or N,N,... (0-3)") from None
    if not stages or any(s not in (0, 1, 2, 3) for s in stages):
        raise argparse.ArgumentTypeError(f"{text!r}: ZeRO stages are 0, 1, 2 and 3")
    return stages


def memory_info() -> tuple[int, int]:
    """(MemTotal, MemAvailable) of this host in bytes, from /proc/meminfo."""
    values = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            values[key] = int(rest.split()[0]) * 1024
    return values["MemTotal"], values.get("MemAvailable", values["MemTotal"])


def default_budget(cpu: bool, ranks: int) -> int:
    if cpu:
        total, available = memory_info()
        return int(min(total / 4, available / 2) / ranks)
    return accelerator_memory_bytes()


def settings_from_args(args: argparse.Namespace, cpu: bool, model: str) -> TuneSettings:
    for name in ("ranks", "max_micro_batch", "max_workers", "probe_steps"):
        value = getattr(args, name)
        if value is not None and value < (2 if name == "probe_steps" else 1):
            raise UserError(f"--{name.replace('_', '-')} {value}: too small")
    for name in ("mem_gb", "probe_timeout", "data_wait_pct"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            raise UserError(f"--{name.replace('_', '-')} {value}: must be positive")
    if args.zero is not None and args.ds_config is not None:
        raise UserError("--zero and --ds-config are exclusive")
    mem = int(args.mem_gb * GiB) if args.mem_gb else default_budget(cpu, args.ranks)
    return TuneSettings(
        stages=() if args.ds_config else (args.zero or (0,)), ranks=args.ranks, mem_bytes=mem,
        max_micro_batch=args.max_micro_batch or (128 if cpu else 1024),
        max_workers=args.max_workers or max(1, min(8, usable_cores() // args.ranks)),
        data_wait_pct=args.data_wait_pct, probe_steps=args.probe_steps,
        probe_timeout=args.probe_timeout, out=args.out or Path("runs") / f"tune-{model}",
        cpu=cpu)


def candidates(args: argparse.Namespace, settings: TuneSettings, hidden: int) -> list[Candidate]:
    """The setups to try: each --zero stage's ds_configs file, or the --ds-config file."""
    from app.plan.inputs import setup_from_ds
    from app.runtime.ds_config import load_ds_config, zero_config_path

    if args.ds_config:
        path = Path(args.ds_config).resolve()
        ds = load_ds_config(path)
        return [Candidate(path.name, ("--ds-config", str(path)), ds,
                          setup_from_ds(ds, hidden, path))]
    out = []
    for stage in settings.stages:
        path = zero_config_path(stage)
        ds = load_ds_config(path)
        out.append(Candidate(f"ZeRO-{stage}", ("--zero", str(stage)), ds,
                             setup_from_ds(ds, hidden, path)))
    return out


def planner_inputs(cfg: TrainConfig, ranks: int, cpu: bool):
    """(the model as the planner sees it, the workload of one rank) for the search's guess."""
    from app.models.presets import parse_overrides
    from app.plan.inputs import describe_model, dropout_flags
    from app.telemetry.flops import head_fraction
    from data_tools.manifest import load_manifest

    manifest = load_manifest(cfg.data)
    info = describe_model(cfg.model_name, vocab_size=int(manifest["vocab_size"]),
                          overrides=parse_overrides(cfg.model_arg))
    hidden, attn = ((cfg.dropout > 0,) * 2 if cfg.dropout is not None
                    else dropout_flags(info.config))
    precision = cfg.precision if cfg.precision != "auto" else ("fp32" if cpu else "bf16")
    work = Workload(seq_len=cfg.seq_len, micro_batch=1, precision=precision, world=ranks,
                    devices_per_node=ranks, checkpointing=cfg.gradient_checkpointing,
                    head_fraction=head_fraction(cfg.objective or info.objective, cfg.mask_prob),
                    hidden_dropout=hidden, attention_dropout=attn,
                    eager_attention=cfg.attn == "eager")
    return info, work


def write_outputs(res: TuneResult, settings: TuneSettings, base_values: dict[str, Any]
                  ) -> list[Path]:
    """OUT/ds_config.json, OUT/tune.json, then OUT/train.args (last: it names the config).

    Each is written atomically, with Ctrl-C and SIGTERM held back until all three are."""
    out = settings.out
    ds = dict(res.chosen.ds_config, train_micro_batch_size_per_gpu=res.micro_batch)
    flags = train_flags(base_values, OUTPUT_SKIP) + [
        "--ds-config", str((out / "ds_config.json").resolve()),
        "--micro-batch", str(res.micro_batch), "--num-workers", str(res.workers)]
    summary = {"setup": res.chosen.label, "micro_batch": res.micro_batch,
               "largest_micro_batch": res.best.micro_batch, "capped": res.capped,
               "num_workers": res.workers, "data_wait_pct": res.waits,
               "budget_gb": round(settings.mem_bytes / GiB, 3), "ranks": settings.ranks,
               "probes": [p.as_dict() for p in res.probes], "train_flags": flags}
    paths = [out / "ds_config.json", out / "tune.json", out / "train.args"]
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        write_json_atomic(paths[0], ds)
        write_json_atomic(paths[1], summary)
        write_text_atomic(paths[2], "".join(f"{f}\n" for f in flags))
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
    return paths


OUTPUT_FILES = ("ds_config.json", "tune.json", "train.args")  # write_outputs' three


def check_out(out: Path, cfg: TrainConfig) -> None:
    """--out holds tune's three files: never a dataset (its dataset.json marks it), nor inside
    or around one of --data's (compared as files: output.check_apart), and each file through
    the output gate (output.claim_file): one that is there is replaced only when an earlier
    tune wrote it (its tune.json beside it), never a file of the user's."""
    inputs = [("--data", p) for p in read_sources(cfg.data).paths]
    check_apart(out, inputs)
    if (out / MANIFEST).exists():
        raise UserError(f"--out {out}: a dataset directory (it holds {MANIFEST}); choose a "
                        f"directory of its own for tune's files")
    for name in OUTPUT_FILES:
        output.claim_file(out / name, "--out", ours=lambda _: tune_made(out),
                          what="file of an earlier `app tune`", inputs=inputs)


def tune_made(out: Path) -> bool:
    """Whether `out` holds an earlier tune's files: its tune.json, with tune's own keys."""
    try:
        report = json.loads((out / "tune.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(report, dict) and {"setup", "probes", "train_flags"} <= report.keys()


def run(args: argparse.Namespace) -> int:
    from app.runtime.device import detect

    values = {k: v for k, v in vars(args).items() if k != "func"}
    stages = args.zero or (0,)
    cfg = TrainConfig.from_args(argparse.Namespace(**{**values, "zero": None if args.ds_config
                                                      else stages[0], "out": Path("tune-out")}))
    cpu = detect().is_cpu
    settings = settings_from_args(args, cpu, cfg.model_name)
    info, work = planner_inputs(cfg, settings.ranks, cpu)
    cands = candidates(args, settings, info.shape.hidden)
    check_out(settings.out, cfg)
    created = [d for d in (settings.out, *settings.out.parents) if not d.exists()]
    with interrupt_on_term():
        settings.out.mkdir(parents=True, exist_ok=True)
        probes_dir = Path(tempfile.mkdtemp(prefix=".probes-", dir=settings.out))
        try:
            print(f"tune: {cfg.model_name}, seq-len {cfg.seq_len}, {settings.ranks} rank(s), "
                  f"{settings.mem_bytes / GiB:.2f} GB per rank, micro batch up to "
                  f"{settings.max_micro_batch}, {', '.join(c.label for c in cands)}",
                  file=sys.stderr, flush=True)
            prober = Prober(train_flags(values, PROBE_FLAGS), settings, probes_dir,
                            lambda n, p: print(progress_line(n, p, settings.mem_bytes),
                                               file=sys.stderr, flush=True))
            res = tune(cands, settings, prober,
                       planner_guess(info, work, cpu, settings.mem_bytes), cfg.global_batch)
            paths = write_outputs(res, settings, values)
        finally:
            shutil.rmtree(probes_dir, ignore_errors=True)
            for d in created:  # directories tune made, if it leaves nothing in them
                if d.is_dir() and not any(d.iterdir()):
                    d.rmdir()
    print("\n".join(report_lines(res, settings)))
    args_file = paths[2]
    ranks = f"--procs-per-node {settings.ranks} " if settings.ranks > 1 else ""
    print(f"wrote {paths[0]}, {args_file} and {paths[1]}\n"
          f"run: ./launch.sh {ranks}-- $(cat {args_file}) --out RUN_DIR")
    return 0
