"""One measurement for `app tune`: a short real `app train` run in its own process group.

A probe is a separate process (or the deepspeed launcher and its ranks) in a new session, so an
out-of-memory failure, a budget overrun or Ctrl-C never leaves the tuner unusable: the whole
group is terminated, then killed (or killed at once: `term`), and reaped before `run_probe`
returns. On CPU there is no device OOM, so a watchdog enforces the memory budget on each rank's
resident memory; on an accelerator the real OOM error is the boundary (and the run's reported
peak is checked too). The measurements come back through the run's metrics.jsonl, not through
trainer internals.

On CPU the peak is each rank's VmHWM (app.runtime.device.peak_rss_bytes) as watched here while
the probe runs (the budget is enforced on it then), not the run's `sys/max_mem_gb`, which is the
same figure but read only at log intervals and lost with a killed rank.
"""
from __future__ import annotations

import ctypes
import json
import os
import re
import signal
import subprocess
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

from app.runtime.device import peak_rss_bytes

GiB = 2 ** 30
OOM_MARKERS = ("out of memory", "outofmemoryerror", "cannot allocate memory",
               "can't allocate memory", "memoryerror", "std::bad_alloc")


@dataclass(frozen=True)
class ProbeResult:
    """What one probe measured (per rank figures are the maximum over ranks)."""

    ok: bool
    """Ran its steps within the memory budget."""
    reason: str
    """"ok", "over budget", "out of memory", "timeout" (or "timeout: <the line>") or "failed: <the
    error line>"."""
    peak_bytes: int | None
    """Peak memory of the worst rank: its VmHWM on CPU, the run's `sys/max_mem_gb` otherwise."""
    step_time_ms: float | None
    """Last logged window (steady state: later than the first step)."""
    data_wait_pct: float | None
    tokens_per_sec: float | None
    seconds: float
    """Wall time of the probe, start-up included."""


def run_probe(cmd: Sequence[str], run_dir: Path, *, budget_bytes: int | None, timeout: float,
              watch_rss: bool, env: dict[str, str] | None = None, poll: float = 0.1,
              rank_module: str = "app", term: bool = True) -> ProbeResult:
    """Run `cmd` (an `app train` into `run_dir`) and report what it measured.

    With `watch_rss`, the processes started as `python -m <rank_module>` (not their forked
    loader workers) are the ranks whose resident memory must stay within `budget_bytes`
    (None: no budget; the peak is still recorded). `term`: a probe that is stopped (over budget,
    timed out, Ctrl-C) gets SIGTERM first, for a starter with clean-up of its own to do
    (launch.sh, the simulated cluster); without it the group is killed at once.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    log_path = run_dir.parent / f"{run_dir.name}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True, preexec_fn=_die_with_parent)
        try:
            verdict, watched = _watch(proc, budget_bytes, timeout,
                                      rank_module if watch_rss else None, poll)
            watched = watched if watch_rss else None
        finally:
            kill_group(proc, term=term)  # also on Ctrl-C: nothing outlives the probe
    seconds = time.monotonic() - started
    if verdict is None:
        verdict = "ok" if proc.returncode == 0 else _failure(proc.returncode, log_path)
    return _result(verdict, run_dir, watched, budget_bytes, seconds)


def _watch(proc: subprocess.Popen, budget: int | None, timeout: float, rank_module: str | None,
           poll: float) -> tuple[str | None, int]:
    """Wait for the probe; stop it on a budget overrun (CPU) or timeout. (verdict, peak RSS)"""
    deadline = time.monotonic() + timeout
    peak = 0
    ranks: list[int] = []
    polls = 0
    while proc.poll() is None:
        if rank_module:
            # The ranks' VmHWM is read every poll; the group is scanned for them (all of /proc,
            # ~4 ms a scan with a hundred processes: ~2.4 CPU-s a minute of probe at 0.1 s)
            # until one is there, then once a second for a launcher's later ones. VmHWM is a
            # high-water mark: a rank found a second late has the same peak.
            if not ranks or polls % max(1, round(1 / poll)) == 0:
                ranks = rank_pids(proc.pid, rank_module)
            polls += 1
            peak = max([peak] + [peak_rss_bytes(p) for p in ranks])
            if budget is not None and peak > budget:
                return "over budget", peak
        if time.monotonic() > deadline:
            return "timeout", peak
        time.sleep(poll)
    return None, peak


def _result(verdict: str, run_dir: Path, watched: int | None, budget: int | None,
            seconds: float) -> ProbeResult:
    last = last_train_record(run_dir / "metrics.jsonl") if verdict == "ok" else None
    if verdict == "ok" and last is None:
        verdict = "failed: the run logged no training step"
    reported = int(last["sys/max_mem_gb"] * GiB) if last and last.get("sys/max_mem_gb") else None
    peak = watched or reported  # on CPU the watched VmHWM: see the module docstring
    if verdict == "ok" and peak is not None and budget is not None and peak > budget:
        verdict = "over budget"
    get = (lambda k: last.get(k)) if last else (lambda k: None)
    return ProbeResult(ok=verdict == "ok", reason=verdict, peak_bytes=peak,
                       step_time_ms=get("perf/step_time_ms"),
                       data_wait_pct=get("perf/data_wait_pct"),
                       tokens_per_sec=get("perf/tokens_per_sec"), seconds=seconds)


def last_train_record(path: Path) -> dict | None:
    """The last metrics.jsonl record with training figures (None if there is none)."""
    if not path.is_file():
        return None
    last = None
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "perf/step_time_ms" in record:
            last = record
    return last


# The cause of a failure, most telling first: the app's one-line error, launch.sh's, a hung rank,
# then the last line of a Python traceback (`SomeError: ...`); other ranks' "lost a peer" and
# the launchers' summaries come after them in the log and say less.
CAUSES = (re.compile(r"python -m app \w+: error: "), re.compile(r"launch\.sh: error: "),
          re.compile(r"rank \d+: no progress for "),
          re.compile(r"^([A-Za-z_][\w.]*)?(Error|Exception|Interrupt)\b: "))
# A wait that gave up (a collective, the rendezvous store, a launcher's `timeout`): the run timed
# out, whatever signal ended it afterwards.
TIMED_OUT = re.compile(r"\btimed out\b|collective operation timeout|DistStoreError|"
                       r"\btimeout: sending signal\b", re.IGNORECASE)
RANK_TAG = re.compile(r"^\[node[0-9?]+ rank[0-9?]+\] ")


def _failure(returncode: int, log_path: Path) -> str:
    """Classify a failed probe from its exit status and log: "out of memory", "timeout: " and
    the line that says what timed out, or "failed: " and the line that names the cause (without
    launch.sh's rank tag). A hung rank stays "failed:" with the watchdog's line."""
    text = log_path.read_text(errors="replace")
    if any(m in text.lower() for m in OOM_MARKERS):
        return "out of memory"
    lines = [RANK_TAG.sub("", ln.strip()) for ln in text.splitlines() if ln.strip()]
    cause = next((found[0] for c in CAUSES if (found := [ln for ln in lines if c.search(ln)])),
                 None)
    timed_out = [ln for ln in lines if TIMED_OUT.search(ln)]
    if timed_out and (cause is None or TIMED_OUT.search(cause)):
        return f"timeout: {cause or timed_out[0]}"  # a SIGKILL after it is not the kernel's
    hung = cause is not None and CAUSES[2].search(cause)
    if returncode in (-signal.SIGKILL, 137) and not hung:
        return "out of memory"  # SIGKILL that we did not send: the kernel's OOM killer
    if cause is not None:
        return f"failed: {cause}"
    errors = [ln for ln in lines if "error" in ln.lower() and not ln.startswith("[20")]
    return f"failed: {(errors or lines or ['exit status %d' % returncode])[-1]}"


def _die_with_parent() -> None:
    """In the child: get SIGKILL if the tuner dies without cleaning up (Linux prctl)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def group_pids(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat and stat[2] == pgid and stat[0] != "Z":
                out.append(int(entry))
    return out


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, pgid) of a process, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[1]), int(fields[2])
    except (OSError, IndexError, ValueError):
        return None


def _runs_module(pid: int, module: str) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return False
    return any(a == b"-m" and b == module.encode() for a, b in zip(argv, argv[1:]))


def rank_pids(pgid: int, module: str = "app") -> list[int]:
    """The training processes of a probe (`python -m app`): not the launcher, and not the
    loader workers they fork (same command line, but a rank for a parent)."""
    pids = [p for p in group_pids(pgid) if _runs_module(p, module)]
    parents = {p: (_stat(p) or ("", 0, 0))[1] for p in pids}
    return [p for p in pids if parents[p] not in parents]


def kill_group(proc: subprocess.Popen, grace: float = 5.0, term: bool = True) -> None:
    """Terminate the probe's whole process group, kill what is left after `grace`, reap.
    Without `term`, kill it at once."""
    pgid = proc.pid
    for sig in (signal.SIGTERM, signal.SIGKILL) if term else (signal.SIGKILL,):
        if proc.poll() is not None and not group_pids(pgid):
            break
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and (proc.poll() is None or group_pids(pgid)):
            time.sleep(0.05)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass


def tagged_pids(name: str, value: str) -> list[int]:
    """Live processes of this user whose environment holds NAME=VALUE: a run started with that
    variable set is its launcher, ranks and loader workers, whatever process group each is in."""
    needle = f"{name}={value}".encode()
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                found = needle in f.read().split(b"\0")
        except OSError:  # gone, or another user's
            continue
        stat = _stat(int(entry))
        if found and stat and stat[0] != "Z":
            out.append(int(entry))
    return out


def kill_tagged(name: str, value: str, wait: float = 10.0) -> list[int]:
    """SIGKILL every process `tagged_pids` finds until a look finds none (or `wait` s pass); the
    pids killed. Each look kills what it finds: a process killed while it forked (launch.sh
    starting DeepSpeed's runner) leaves a child the look before missed, which would go on."""
    killed: list[int] = []
    deadline = time.monotonic() + wait
    while (pids := tagged_pids(name, value)) and time.monotonic() < deadline:
        for pid in pids:
            if pid not in killed:
                killed.append(pid)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    return killed


def remove_shm_buffers(port: int, shm_dir: Path = Path("/dev/shm")) -> None:
    """Unlink the shared-memory all-reduce buffers of a multi-rank CPU run that used `port`.

    DeepSpeed's CPU backend (ops/csrc/cpu/comm/shm.cpp) creates one 66 MB buffer per rank,
    named deepspeed_allreduce_buffer_<uid>_<address>_<port>_<rank>, and never unlinks it: every
    2-rank CPU run leaves 132 MB of RAM behind in /dev/shm.
    """
    for path in shm_dir.glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"):
        path.unlink(missing_ok=True)


@contextmanager
def interrupt_on_term() -> Iterator[None]:
    """SIGTERM and SIGHUP (e.g. `timeout`, a closed terminal) stop the command running probes
    (`app tune`, `app bench`) as Ctrl-C does, so the running probe is stopped and its files
    removed. Here, beside the probes, so that neither command imports the other."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    old = {s: signal.signal(s, interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
