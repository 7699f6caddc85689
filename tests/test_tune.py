"""`app tune`: the search as math, the probes' process handling, and real tuning runs on CPU."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from app.plan.probe import group_pids, kill_group, rank_pids, remove_shm_buffers, run_probe
from app.plan.tune import (
    SEARCH_TOLERANCE,
    fit_global_batch,
    next_micro_batch,
    pick_workers,
    train_flags,
)
from tests.helpers import REPO, check, clean_env, default_sigint, metrics, run_app
from tests.test_plan import run_fresh

# -- the search -----------------------------------------------------------------------------------


def search(truth: int, cap: int, guess: int | None) -> tuple[list[int], int]:
    """Run next_micro_batch against a machine where micro batches <= truth fit."""
    ran, failed, probed = set(), set(), []
    while (m := next_micro_batch(ran, failed, cap, guess)) is not None:
        assert m not in probed and len(probed) < 30
        assert not failed or m < min(failed)  # never above a known failure
        assert m > max(ran, default=0)  # never below a known success
        probed.append(m)
        (ran if m <= truth else failed).add(m)
    return probed, max(ran, default=0)


@pytest.mark.parametrize("truth", [1, 2, 5, 20, 181, 700, 5000])
@pytest.mark.parametrize("guess", [None, 1, 0.5, 0.9, 1.0, 1.1, 3.0])
@pytest.mark.parametrize("cap", [64, 1024])
def test_search_finds_the_largest_within_tolerance(truth, guess, cap):
    g = None if guess is None else max(1, int(truth * guess))
    probed, found = search(truth, cap, g)
    best = min(truth, cap)
    assert probed[0] == 1 and found <= best
    assert best - found <= max(1, found // SEARCH_TOLERANCE)


def test_a_good_guess_takes_few_probes():
    assert search(181, 1024, 181)[0] == [1, 181, 204, 192]  # 1, the guess, +12.5%, bisect
    assert search(1000, 128, 900)[0] == [1, 128]  # the cap is below the guess: done
    # a guess 15-20% low (a loaded CPU's noisy peaks): +12.5%, +25%, then bisect, where
    # doubling went to 28 and took three bisections to come back (8 probes)
    assert search(15, 64, 12)[0] == [1, 12, 14, 18, 16, 15]


def test_nothing_fits():
    assert search(0, 1024, 50) == ([1], 0)


def test_pick_workers():
    assert pick_workers({0: 2.5, 1: 0.4, 2: 0.1}, 1.0) == 1
    assert pick_workers({0: 0.3}, 1.0) == 0
    assert pick_workers({0: 5.0, 1: 3.0}, 1.0) is None


def test_fit_global_batch():
    assert fit_global_batch(128, None, 2) == 128
    assert fit_global_batch(100, 512, 2) == 64  # 256 per rank: the largest divisor <= 100
    assert fit_global_batch(7, 96, 4) == 6


def test_train_flags_are_the_non_defaults(tmp_path):
    values = {"data": tmp_path, "out": tmp_path / "o", "model": "bert-tiny", "seq_len": 128,
              "micro_batch": 4, "lr": 1e-3, "dropout": 0.0, "gradient_checkpointing": True,
              "model_arg": ["num_hidden_layers=1"], "zero": 2}
    assert train_flags(values, {"out", "micro_batch", "zero"}) == [
        "--data", str(tmp_path.resolve()), "--model", "bert-tiny",
        "--model-arg", "num_hidden_layers=1", "--seq-len", "128", "--dropout", "0.0",
        "--gradient-checkpointing"]  # lr is the default: left out; seq-len always in


# -- probes: process groups, the watchdog, failures (fake ranks, no torch) -------------------------

FAKE_RANK = textwrap.dedent("""
    import os, sys, time
    mb = int(sys.argv[1])
    block = bytearray(mb * 2**20)  # resident: touched below
    for i in range(0, len(block), 4096):
        block[i] = 1
    if os.fork() == 0:  # a "loader worker": same command line, must not count as a rank
        time.sleep(60)
        os._exit(0)
    if sys.argv[2] == "oom":
        print("RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB", flush=True)
        sys.exit(1)
    if sys.argv[2] == "error":
        print("python -m app train: error: --data x: no such directory", flush=True)
        sys.exit(2)
    time.sleep(float(sys.argv[2]))
""")


@pytest.fixture
def fake(tmp_path):
    (tmp_path / "fakerank.py").write_text(FAKE_RANK)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}

    def probe(mb: int, mode: str, budget_mb: int = 10_000, timeout: float = 30):
        # the test's directory on the command line: what no_process_mentions looks for (not
        # "fakerank": another run's fakes on the box are not this test's)
        cmd = [sys.executable, "-m", "fakerank", str(mb), mode, str(tmp_path)]
        return run_probe(cmd, tmp_path / f"run-{mb}-{mode}", budget_bytes=budget_mb * 2**20,
                         timeout=timeout, watch_rss=True, env=env, rank_module="fakerank")
    return probe


def no_process_mentions(text: str) -> bool:
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    return False
        except (OSError, ValueError):
            continue
    return True


def test_watchdog_stops_a_rank_over_budget(fake, tmp_path):
    started = time.monotonic()
    r = fake(200, "30", budget_mb=100)
    assert not r.ok and r.reason == "over budget" and r.peak_bytes > 100 * 2**20
    assert time.monotonic() - started < 15  # stopped, not waited for
    assert no_process_mentions(str(tmp_path))  # the worker went with the group


def test_probe_failures_are_classified(fake):
    assert fake(10, "oom").reason == "out of memory"
    r = fake(10, "error")
    assert r.reason == "failed: python -m app train: error: --data x: no such directory"
    assert fake(10, "30", timeout=1).reason == "timeout"
    # a clean exit without metrics is no measurement
    assert fake(10, "0").reason.startswith("failed: the run logged no training step")


def test_ctrl_c_during_a_probe_kills_its_group(fake, tmp_path):
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, interrupt)
    # once the probe runs (3 s: under load 1.5 s can land inside subprocess.Popen, before
    # run_probe holds a process to stop; one such run left the fake rank behind)
    signal.setitimer(signal.ITIMER_REAL, 3)
    try:
        with pytest.raises(KeyboardInterrupt):
            fake(10, "60")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert no_process_mentions(str(tmp_path))


def test_ranks_are_not_their_workers(tmp_path):
    (tmp_path / "fakerank.py").write_text(FAKE_RANK)
    proc = subprocess.Popen([sys.executable, "-m", "fakerank", "1", "30"],
                            env={**os.environ, "PYTHONPATH": str(tmp_path)},
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while len(group_pids(proc.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(group_pids(proc.pid)) == 2  # the rank and its forked worker
        assert rank_pids(proc.pid, "fakerank") == [proc.pid]
    finally:
        kill_group(proc)
    assert group_pids(proc.pid) == []


def test_a_probes_shm_buffers_are_removed(tmp_path):
    uid = os.getuid()
    names = [f"deepspeed_allreduce_buffer_{uid}_127.0.0.1_{port}_{rank}"
             for port, rank in ((1234, 0), (1234, 1), (12345, 0))]
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    remove_shm_buffers(1234, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == names[2:]


# -- real tuning on CPU ----------------------------------------------------------------------------

def tune_args(dataset: Path, out: Path, *extra: str) -> list[str]:
    return ["tune", "--data", str(dataset), "--out", str(out), "--model", "bert-tiny",
            "--seq-len", "64", *extra]


def tune_cmd(dataset: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "app", *tune_args(dataset, out, *extra)]


@pytest.mark.slow
def test_search_survives_running_out_of_a_small_budget(mlm_dataset, tmp_path):
    # the budget: what micro batch 1 takes on this machine, plus room for a few dozen samples
    check(run_fresh("train", "--data", mlm_dataset, "--out", tmp_path / "one", "--model",
                    "bert-tiny", "--seq-len", "64", "--micro-batch", "1", "--max-steps", "3",
                    "--log-every", "1", "--eval-samples", "1", "--wandb", "disabled",
                    "--num-workers", "0"))
    base = max(m["sys/max_mem_gb"] for m in metrics(tmp_path / "one") if "sys/max_mem_gb" in m)
    budget = base + 40 / 1024
    out = tmp_path / "tuned"
    # tune forked from the warm process: its probes, the subject, are real processes all the same
    # (exec'd: each rank's VmHWM is its own, not the warm process's)
    proc = run_app(*tune_args(mlm_dataset, out, "--mem-gb", f"{budget:.4f}",
                              "--max-micro-batch", "64", "--max-workers", "1"), timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "tune.json").read_text())
    probes = [p for p in report["probes"] if p["num_workers"] == 0]  # the batch search
    over = [p for p in probes if p["reason"] == "over budget"]
    assert over, probes  # the search did hit the limit and went on
    best = report["largest_micro_batch"]
    assert 1 < best < 64
    assert all(p["micro_batch"] > best for p in over)
    chosen = [p for p in probes if p["micro_batch"] == best and p["ok"]]
    assert chosen and all(p["peak_gb"] <= budget for p in chosen)
    assert "probe 1:" in proc.stderr and "micro batch" in proc.stdout \
        and "worker" in proc.stdout
    assert not list(out.glob(".probes-*")) and no_process_mentions(str(out))
    # the outputs run as they are
    ds = json.loads((out / "ds_config.json").read_text())
    assert ds["train_micro_batch_size_per_gpu"] == best
    args = (out / "train.args").read_text().split("\n")[:-1]
    assert args[args.index("--micro-batch") + 1] == str(best)
    check(run_app("train", *args, "--out", tmp_path / "run", "--max-steps", "1",
                  "--eval-samples", "1", "--wandb", "disabled"))


def wait_for_probe(out: Path, n: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    """Until probe n's `app train` runs: exec'd, its command line naming its run directory
    (before that, a signal can land inside Popen, before run_probe holds a process to stop)."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        logs = list(out.glob(f".probes-*/{n:02d}-mb*.log"))  # made just before the probe starts
        if logs and not no_process_mentions(str(logs[0])[:-len(".log")]):
            return
        time.sleep(0.2)
    raise AssertionError(f"probe {n} never ran")


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_leaves_nothing_behind(mlm_dataset, tmp_path, sig):
    out = tmp_path / "tuned"
    # Ctrl-C after a probe has ended (its log and run directory made and handled) and in the
    # next; SIGTERM in the first, which saves a whole probe (~7 CPU-s): the stop is the same
    # KeyboardInterrupt (interrupt_on_term), the finished probe is what the other adds
    ended = 1 if sig == signal.SIGINT else 0
    proc = subprocess.Popen(tune_cmd(mlm_dataset, out, "--max-micro-batch", "64"), cwd=REPO,
                            env=clean_env(), stderr=subprocess.PIPE, text=True,
                            preexec_fn=default_sigint)
    try:
        if ended:
            for line in proc.stderr:
                if line.startswith(f"probe {ended}:"):
                    break
        wait_for_probe(out, ended + 1, proc)
        time.sleep(1)  # into the probe's start-up (its imports take seconds)
        assert proc.poll() is None and not no_process_mentions(str(out))
        proc.send_signal(sig)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130
    assert no_process_mentions(str(out))
    assert not out.exists()  # tune made it, and took it away again


@pytest.mark.slow  # two `app tune` processes
def test_bad_input_is_one_line(mlm_dataset, tmp_path):
    p = run_app("tune", "--data", mlm_dataset, "--zero", "0,7", "--out", tmp_path / "t")
    assert p.returncode == 2 and "Traceback" not in p.stderr and "ZeRO stages" in p.stderr
    p = run_app("tune", "--data", tmp_path / "missing", "--out", tmp_path / "t")
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert not (tmp_path / "t").exists()


@pytest.mark.slow
def test_a_budget_below_one_sample_is_one_line(mlm_dataset, tmp_path):
    p = run_app("tune", "--data", mlm_dataset, "--model", "bert-tiny", "--mem-gb", "0.05",
                "--out", tmp_path / "t")
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "micro batch 1 does not fit" in p.stderr and not (tmp_path / "t").exists()


def test_tune_never_writes_over_a_file_it_did_not_write(mlm_dataset, tmp_path):
    """--out's three files go through the output gate: a ds_config.json of the user's there is
    refused (before: replaced); an earlier tune's files (its tune.json beside them) are not."""
    from types import SimpleNamespace

    from app.plan.tune import check_out
    from data_tools.errors import UserError

    cfg = SimpleNamespace(data=Path(mlm_dataset))
    out = tmp_path / "out"
    out.mkdir()
    (out / "ds_config.json").write_text('{"mine": true}')
    with pytest.raises(UserError, match=r"ds_config\.json: exists and is not a file of an "
                                        r"earlier `app tune`"):
        check_out(out, cfg)
    (out / "tune.json").write_text(json.dumps({"setup": "ZeRO-0", "probes": [],
                                               "train_flags": []}))
    check_out(out, cfg)
    check_out(tmp_path / "new", cfg)
    assert (out / "ds_config.json").read_text() == '{"mine": true}'
