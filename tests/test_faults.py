"""Never lose a run, with real processes and faults injected behind test-only switches
(app/faults/injection.py): a NaN and a spike from a poisoned batch (rollback, skip, recovery),
SIGTERM on one of two ranks (a checkpoint, exit 75, an exact resume), SIGKILL of one of two ranks
(resume, bit-identical weights), a process killed in the middle of a save (the previous checkpoint
used), ids past the vocabulary (one line naming the shard), and a hung rank (the watchdog names it).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import (
    REPO,
    TINY,
    check,
    clean_env,
    error_lines,
    free_port,
    launch,
    metrics,
    python,
    run_app,
)

pytestmark = pytest.mark.slow

COMMON = [*TINY, "--log-every", "5", "--save-every", "10", "--dropout", "0", "--lr", "2e-3"]


def losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["train/loss"] for r in metrics(run) if "train/loss" in r}


@pytest.fixture(scope="module")
def clean(mlm_dataset, tmp_path_factory):
    run = tmp_path_factory.mktemp("clean") / "run"
    check(run_app("train", "--data", mlm_dataset, "--out", run, *COMMON, "--max-steps", "40"))
    return run


def test_a_nan_batch_rolls_back_skips_it_and_recovers(mlm_dataset, clean, tmp_path):
    run = tmp_path / "run"
    proc = check(run_app("train", "--data", mlm_dataset, "--out", run, *COMMON,
                         "--max-steps", "40",
                         env=clean_env(DSPRETRAIN_TEST_POISON="23:nan")))
    assert "non-finite loss at step 24" in proc.stderr and "rolling back" in proc.stderr
    events = [r for r in metrics(run) if "event" in r]
    assert [e["event/step"] for e in events] == [24] and events[0]["event"] == "rolling back"
    skipped = [json.loads(line) for line in
               (run / "skipped_batches.jsonl").read_text().splitlines()]
    assert [s["global_batch"] for s in skipped] == [23] and len(skipped[0]["samples"]) == 4
    assert skipped[0]["positions"] == [92, 96]
    final, reference = losses(run)[40], losses(clean)[40]
    assert np.isfinite(final) and abs(final - reference) < 0.25 * reference, (final, reference)
    # the cool-down: the first steps after the rollback ran at a tenth of the schedule's LR
    lrs = {r["step"]: r["train/lr"] for r in metrics(run) if "train/lr" in r}
    clean_lrs = {r["step"]: r["train/lr"] for r in metrics(clean) if "train/lr" in r}
    assert lrs[25] < 0.2 * clean_lrs[25]


def test_a_spike_is_skipped_under_the_skip_policy(mlm_dataset, tmp_path):
    run = tmp_path / "run"
    proc = check(run_app("train", "--data", mlm_dataset, "--out", run, *COMMON,
                         "--max-steps", "40", "--on-anomaly", "skip",
                         env=clean_env(DSPRETRAIN_TEST_POISON="27:spike")))
    assert "loss spike at step 28" in proc.stderr and "skipping its batch" in proc.stderr
    assert "rolled back" not in proc.stderr
    assert json.loads((run / "skipped_batches.jsonl").read_text())["global_batch"] == 27
    # a later run from an earlier checkpoint of this directory skips batch 27 too
    from app.data.order import rank_positions
    from app.rundir import read_skipped

    skip = read_skipped(run)
    positions = rank_positions(26 * 4, 4, 0, 1, skip)
    assert [next(positions) for _ in range(8)] == [104, 105, 106, 107, 112, 113, 114, 115]


def test_stop_policy_stops_with_the_evidence(mlm_dataset, tmp_path):
    proc = run_app("train", "--data", mlm_dataset, "--out", tmp_path / "run", *COMMON,
                   "--max-steps", "40", "--on-anomaly", "stop",
                   env=clean_env(DSPRETRAIN_TEST_POISON="25:nan"))
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "stopped: non-finite loss at step 26" in proc.stderr


def _launch(args: list, env: dict) -> subprocess.Popen:
    launcher = str(Path(sys.executable).parent / "deepspeed")
    port = free_port()
    proc = subprocess.Popen([launcher, "--num_gpus", "2", "--no_local_rank", "--master_port",
                             str(port), "--module", "app", *map(str, args)], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    proc.master_port = port
    return proc


def _shm_left(*procs: subprocess.Popen | subprocess.CompletedProcess) -> list[Path]:
    """DeepSpeed's /dev/shm all-reduce buffers of these jobs (their `master_port`) still there
    (app.runtime.dist unlinks them once the group is up, so not even a killed rank leaves its
    ~70 MB behind)."""
    return [p for proc in procs
            for p in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{proc.master_port}_*")]


def _ranks(out: Path) -> list[int]:
    """pids of the rank processes of the run writing to `out` (rank 0 first)."""
    found = subprocess.run(["pgrep", "-f", "--", f"-m app train .*--out {out}( |$)"],
                           capture_output=True, text=True).stdout.split()
    return sorted(int(p) for p in found)


def _wait_for_step(run: Path, step: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (run / "metrics.jsonl").is_file() and any(
                r.get("step", 0) >= step for r in metrics(run)):
            return
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.2)
    raise AssertionError(f"no step {step} in {timeout} s")


# One uninterrupted 2-rank run that both the SIGTERM and the SIGKILL runs are compared with:
# every flag the same (--log-every 1: the SIGTERM comparison is step by step), so one run serves
# both, and the runs compared with it differ from it only in the fault (and, for the SIGTERM run,
# --save-every, which changes no weight). The faults hit ranks of the real launcher; the reference
# run and the resumes are not what these tests test, so they are forked from the warm process with
# the launcher's environment (tests/helpers.py `launch`): the same code, threads and losses.
TWO_RANK = ["train", *COMMON, "--log-every", "1", "--max-steps", "30"]


@pytest.fixture(scope="module")
def two_rank_full(mlm_dataset, tmp_path_factory):
    """The 2-rank reference run (its rendezvous port kept: its shm buffers are checked too)."""
    full = tmp_path_factory.mktemp("two_rank") / "full"
    proc = check(launch(*TWO_RANK, "--data", mlm_dataset, "--out", full))
    return full, proc


@pytest.mark.multirank
def test_sigterm_on_one_rank_checkpoints_and_resumes_exactly(mlm_dataset, two_rank_full):
    full, _ = two_rank_full
    cut = full.parent / "cut"
    args = [*TWO_RANK, "--data", mlm_dataset, "--out", cut, "--save-every", "1000"]
    proc = _launch(args, clean_env())
    _wait_for_step(cut, 12, proc)
    os.kill(_ranks(cut)[-1], signal.SIGTERM)  # one rank only: they agree to stop together
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 75, out[-3000:]
    assert "a stop signal at step" in out
    tag = (cut / "checkpoints" / "latest").read_text()
    stopped_at = int(tag.removeprefix("global_step"))
    assert 12 <= stopped_at < 30
    check(launch(*args))
    a, b = losses(full), losses(cut)
    assert all(a[s] == pytest.approx(b[s], rel=1e-5) for s in range(stopped_at + 1, 31))


@pytest.mark.multirank
def test_sigkill_of_a_rank_then_resume_gives_bit_identical_weights(mlm_dataset, two_rank_full,
                                                                   tmp_path):
    full, first = two_rank_full
    crash = tmp_path / "crash"
    args = [*TWO_RANK, "--data", mlm_dataset, "--out", crash]
    killed = _launch(args, clean_env())
    _wait_for_step(crash, 17, killed)
    os.kill(_ranks(crash)[-1], signal.SIGKILL)
    killed.communicate(timeout=300)
    assert killed.returncode != 0  # the launcher ended the job: no hung peer
    resumed = check(launch(*args))
    assert _shm_left(first, killed, resumed) == []
    for name, run in (("full", full), ("crash", crash)):
        check(run_app("export", run, "--out", tmp_path / f"hf_{name}"))
    from safetensors.torch import load_file

    a, b = (load_file(tmp_path / f"hf_{n}" / "model.safetensors") for n in ("full", "crash"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_killed_in_the_middle_of_a_save_resumes_from_the_previous_checkpoint(mlm_dataset,
                                                                             tmp_path):
    run = tmp_path / "run"
    args = ["train", "--data", mlm_dataset, "--out", run, *COMMON, "--max-steps", "30"]
    proc = run_app(*args, env=clean_env(DSPRETRAIN_TEST_DIE_IN_SAVE="20"))
    assert proc.returncode == 137
    assert (run / "checkpoints" / "latest").read_text() == "global_step10"
    assert (run / "checkpoints" / "global_step20").is_dir()  # what the save left
    proc = check(run_app(*args))
    assert "global_step20: an interrupted save" in proc.stderr
    assert "resumed from" in proc.stderr and "at step 10" in proc.stderr
    assert (run / "checkpoints" / "latest").read_text() == "global_step30"


@pytest.mark.multirank
def test_ids_past_the_vocabulary_are_one_line_naming_the_shard(mlm_dataset, tmp_path):
    import shutil

    data = Path(shutil.copytree(mlm_dataset, tmp_path / "data"))
    shard = data / "train_00000.bin"
    ids = np.memmap(shard, dtype=np.uint16, mode="r+")
    ids[::500] = 65535
    ids.flush()
    # two ranks with a loader worker each, forked with the launcher's environment (the data
    # check is under test, not the launcher)
    proc = launch("train", "--data", data, "--out", tmp_path / "r", *TINY, "--max-steps", "5",
                  "--num-workers", "1", timeout=600)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [ln for ln in error_lines(proc.stderr) if ": error: " in ln]
    assert lines and all(f"{shard}: token id 65535 in sample" in ln for ln in lines), lines


def test_a_shard_cut_short_under_a_running_job_is_one_line_and_a_checkpoint(mlm_dataset,
                                                                           tmp_path):
    """Before: reading the memory-mapped pages past the new end of the file was a SIGBUS: "Bus
    error", no message, no checkpoint. Each read asks the mapped file's size first (one fstat):
    the run stops with one line naming the shard, its last whole step saved (one rank)."""
    data = Path(shutil.copytree(mlm_dataset, tmp_path / "data"))
    shard, run = data / "train_00000.bin", tmp_path / "run"
    args = ["train", "--data", data, "--out", run, *TINY, "--max-steps", "200", "--log-every", "1",
            "--eval-every", "0"]
    # the run is a fork of the warm process (the cut file is under test, not the interpreter's
    # start), waited on in a thread while this one cuts the shard under it
    with ThreadPoolExecutor(1) as pool:
        job = pool.submit(run_app, *args, timeout=600,
                          env=clean_env(DSPRETRAIN_TEST_SLOW_LOADER="0:0.3"))
        deadline = time.time() + 300
        while not ((run / "metrics.jsonl").is_file() and metrics(run)) and \
                time.time() < deadline and not job.done():
            time.sleep(0.2)
        os.truncate(shard, shard.stat().st_size // 20)
        proc = job.result()
    err = proc.stderr
    assert proc.returncode == 2 and "Traceback" not in err, (proc.returncode, err[-3000:])
    lines = [ln for ln in error_lines(err) if ": error: " in ln]
    assert len(lines) == 1 and f"{shard}:" in lines[0] and "truncated under the running job" \
        in lines[0], err[-3000:]
    assert "first: once the data is whole, the same command resumes from it" in lines[0]
    latest = (run / "checkpoints" / "latest").read_text()
    assert latest in lines[0] and (run / "checkpoints" / latest / "manifest.json").is_file()


@pytest.mark.multirank
def test_a_hung_rank_is_named_by_the_watchdog(mlm_dataset, tmp_path):
    """The app's watchdog on the hung rank names it, prints its threads' stacks and exits 124;
    the launcher (here its stand-in, tests/zygote.py: SIGTERM to the other ranks) ends the job."""
    proc = launch("train", "--data", mlm_dataset, "--out", tmp_path / "r", *TINY,
                  "--max-steps", "30", "--hang-timeout", "4",
                  env=clean_env(DSPRETRAIN_TEST_HANG="1:6"), timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "rank 1: no progress for" in out and "exit 124" in out
    assert "hang_here" in out  # where it hangs: the stacks of its threads


def test_a_build_lock_left_by_a_killed_process_does_not_hang_the_next_start(tmp_path):
    """torch's JIT build lock is a bare file; a rank killed while loading DeepSpeed's ops leaves
    it, and without app.runtime.ops.load_op every later start on the node would wait for ever."""
    from torch.utils.cpp_extension import _get_build_directory

    from app.runtime.ops import _own_extensions_dir

    _own_extensions_dir()  # the directory the app builds in (TORCH_EXTENSIONS_DIR from now on)
    code = ("from app.runtime.ops import load_op; load_op('ShareMemCommBuilder');"
            "load_op('FusedAdamBuilder'); print('loaded')")
    # built and cached: a fork of the warm process, which has loaded both where they are built
    # (on a fresh machine the fork builds them)
    check(python("-c", code, timeout=600))
    # the locks go into a copy of the built ops: another test's start (a pytest-xdist worker's)
    # would clear one left in the shared directory, and say so in its own stderr
    own = tmp_path / "extensions"
    shutil.copytree(os.environ["TORCH_EXTENSIONS_DIR"], own, symlinks=True)
    env = clean_env(TORCH_EXTENSIONS_DIR=str(own))
    locks = []
    for name in ("deepspeed_shm_comm", "fused_adam"):
        assert Path(_get_build_directory(name, verbose=False)).name == name  # torch's layout
        locks.append(own / name / "lock")
        locks[-1].touch()  # what a process killed inside torch's build leaves behind
    # one fresh process finds both (a fork of the warm process has the ops loaded already and
    # would never look at a lock)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    check(proc)
    assert "loaded" in proc.stdout
    for lock in locks:
        assert not lock.exists()
        assert f"removing {lock}, a build lock left by a process killed" in proc.stderr
