"""Preemption through launch.sh: a scheduler signals every process of the job step at once
(launch.sh, DeepSpeed's runner and launch.py, the ranks, their loader workers). A real 2-rank job
with a loader worker a rank, in its own session, signalled the way Slurm does: in the loop it
saves one checkpoint and launch.sh exits 75, and the same command resumes; during start-up it
stops with 75 and nothing written half."""
from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import REPO, TINY, clean_env, launch

LAUNCH = REPO / "launch.sh"
EXIT_PREEMPTED = 75
# The ranks stop 2-3 step boundaries after the signal (app/faults/preemption.py LAG), which
# comes a poll and two pgreps after the third logged step: at 7-14 on a loaded box, the later the
# faster its steps; the "stopped before the end" check keeps that margin on a faster box
MAX_STEPS = 40
pytestmark = pytest.mark.multirank


def cluster_default_nofile() -> None:
    """A soft open-file limit of 1,024 (a common default), the hard one left as it is."""
    resource.setrlimit(resource.RLIMIT_NOFILE,
                       (1024, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))


def train_args(data: Path, out: Path, max_steps: int) -> list[str]:
    """The job's `app train` arguments: a loader worker a rank, a log line every step."""
    return [str(a) for a in ["--data", data, "--out", out, *TINY, "--num-workers", "1",
                             "--model", "bert-tiny", "--max-steps", max_steps,
                             "--save-every", 1000, "--log-every", 1]]


def start_job(data: Path, out: Path, max_steps: int, **env: str) -> subprocess.Popen:
    """launch.sh with 2 ranks and a loader worker each, in a session of its own (setsid), under
    a soft open-file limit of 1,024."""
    return subprocess.Popen(["bash", str(LAUNCH), "--procs-per-node", "2", "--",
                             *train_args(data, out, max_steps)], cwd=REPO,
                            env={**clean_env(), **env},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, preexec_fn=cluster_default_nofile)


def signal_session(sid: int, signum: int) -> int:
    """`kill -SIG $(pgrep -s SID)`: every process of the job at once; how many there were."""
    pids = [int(p) for p in subprocess.run(["pgrep", "-s", str(sid)], capture_output=True,
                                           text=True).stdout.split()]
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass
    return len(pids)


def wait_until(ready, job: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert job.poll() is None, job.stdout.read()[-3000:]
        assert time.monotonic() < deadline, "the job did not get there in time"
        time.sleep(0.2)


def logged_steps(out: Path) -> int:
    path = out / "metrics.jsonl"
    if not path.is_file():
        return 0
    return sum('"train/loss"' in line for line in path.read_text().splitlines())


def tcp_sockets_of_rank(sid: int, rank: int) -> int:
    """TCP sockets the python process of `rank` in session `sid` holds (/proc: fd -> inode)."""
    for pid in subprocess.run(["pgrep", "-s", str(sid)], capture_output=True,
                              text=True).stdout.split():
        proc = Path("/proc", pid)
        try:
            env = proc.joinpath("environ").read_bytes().split(b"\0")
            cmd = proc.joinpath("cmdline").read_bytes().split(b"\0")
            inodes = {os.readlink(fd)[8:-1] for fd in proc.joinpath("fd").iterdir()
                      if os.readlink(fd).startswith("socket:[")}
            tcp = {line.split()[9] for t in ("tcp", "tcp6")
                   for line in proc.joinpath("net", t).read_text().splitlines()[1:]}
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and b"app" in cmd and b"train" in cmd:
            return len(inodes & tcp)
    raise AssertionError(f"no rank {rank} in session {sid}")


def finish(job: subprocess.Popen, sid: int, timeout: float = 180) -> str:
    try:
        text, _ = job.communicate(timeout=timeout)
        return text
    finally:
        signal_session(sid, signal.SIGKILL)  # whatever the job left behind


# The resume does not depend on which signal stopped the job: after TERM the same command goes
# through launch.sh again; after USR1 its ranks are forked from the warm process (tests/helpers.py
# `launch`), the same resume checked without a second launcher chain's start-up (~20 CPU-s)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1], ids=["TERM", "USR1"])
def test_a_signal_to_every_process_of_the_job_saves_and_exits_75(mlm_dataset, tmp_path, signum):
    out = tmp_path / "run"
    job = start_job(mlm_dataset, out, max_steps=MAX_STEPS)
    wait_until(lambda: logged_steps(out) >= 3, job)
    # the stop agreement rides on the job's group: rank 1 holds gloo's pair and listener for
    # the world group and for DeepSpeed's clone of it, and the rendezvous store's client; a group
    # of its own would add a pair and a listener (7 on main)
    assert tcp_sockets_of_rank(job.pid, 1) <= 5
    assert signal_session(job.pid, signum) > 6  # launch.sh, runner, launch.py, 2 ranks, workers
    text = finish(job, job.pid)
    assert job.returncode == EXIT_PREEMPTED, text[-3000:]
    assert "Traceback" not in text
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard > 1024:  # the ranks took what the hard limit allows, and said so
        assert "raised the open-file limit from 1024 to" in text
    tag = (out / "checkpoints" / "latest").read_text().strip()
    stopped_at = int(tag.removeprefix("global_step"))
    assert 3 <= stopped_at < MAX_STEPS and (out / "checkpoints" / tag).is_dir()

    if signum == signal.SIGTERM:
        again = start_job(mlm_dataset, out, max_steps=MAX_STEPS)  # the same command continues
        text = finish(again, again.pid, timeout=600)
        status = again.returncode
    else:
        done = launch("train", *train_args(mlm_dataset, out, MAX_STEPS), procs=2, timeout=600)
        text, status = done.stdout + done.stderr, done.returncode
    assert status == 0, text[-3000:]
    assert f"resumed from {out / 'checkpoints' / tag} at step {stopped_at}" in text
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()
             if '"train/loss"' in line]
    assert steps[-1] == MAX_STEPS and steps.count(stopped_at + 1) == 1


def test_a_signal_during_start_up_stops_cleanly_with_75(mlm_dataset, tmp_path):
    out = tmp_path / "run"
    # start-up held 15 s once planned: the signal lands before the loop however fast the box
    job = start_job(mlm_dataset, out, max_steps=40, DSPRETRAIN_TEST_SLOW_START="15")
    log: list[str] = []

    def planned() -> bool:  # the plan is printed before the run directory and the group
        log.append(job.stdout.readline())
        return "data:" in log[-1]

    wait_until(planned, job)
    signal_session(job.pid, signal.SIGTERM)
    text = "".join(log) + finish(job, job.pid)
    assert job.returncode == EXIT_PREEMPTED, text[-3000:]
    assert "nothing new to save; run the same command again (exit status 75)" in text
    assert "Traceback" not in text
    assert not (out / "checkpoints").exists() and not (out / "metrics.jsonl").exists()
    leftovers = [p.name for p in out.rglob("*") if ".tmp" in p.name] if out.exists() else []
    assert leftovers == []
