"""Telemetry a cluster user trusts: the interval figures as math, then a real 2-rank run with one
rank's loader made slow (it must be named), an offline wandb run read back with wandb's own
reader (metrics, config, one id across a resume, no API key anywhere), a plain log without
carriage returns, and report's PNGs for one run and for two."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from app.telemetry import figures as telemetry
from tests.helpers import REPO, TINY, check, clean_env, launch, metrics, run_app

KEY = "0123456789abcdef0123456789abcdef01234567"


def shape(**kw) -> telemetry.RunShape:
    return telemetry.RunShape(**({"global_batch": 8, "seq_len": 100, "world_size": 2,
                                  "flops_per_token": 1e9, "peak_tflops": 100.0} | kw))


def test_interval_figures_by_hand():
    # ROW: wall, data wait, forward, mem, reserved, peak; 4 steps of 8 x 100 tokens
    rows = [[2.0, 0.1, 0.4, 1.0, 1.5, 2.0], [2.2, 1.1, 0.5, 3.0, 3.5, 4.0]]
    f = telemetry.interval(rows, 4, shape())
    assert f["perf/tokens_per_sec"] == pytest.approx(3200 / 2.1)
    assert f["perf/tokens_per_sec_per_device"] == pytest.approx(1600 / 2.1)
    assert f["perf/samples_per_sec"] == pytest.approx(32 / 2.1)
    assert f["perf/step_time_ms"] == pytest.approx(525.0)
    assert (f["perf/step_time_ms_min"], f["perf/step_time_ms_max"]) == pytest.approx((500, 550))
    assert f["perf/data_wait_pct"] == pytest.approx(100 * 1.2 / 4.2)
    assert f["perf/data_wait_pct_max"] == pytest.approx(50.0)
    assert f["perf/slowest_rank"] == 1  # 1.1 s data wait + 0.5 s forward
    assert f["perf/tflops_per_device"] == pytest.approx(1e9 * 1600 / 2.1 / 1e12)
    assert f["perf/mfu"] == pytest.approx(f["perf/tflops_per_device"] / 100.0)
    assert (f["sys/mem_gb"], f["sys/mem_reserved_gb"], f["sys/max_mem_gb"]) == (3.0, 3.5, 4.0)
    assert "perf/mfu" not in telemetry.interval(rows, 4, shape(peak_tflops=None))


def test_model_state_is_the_largest_ranks_when_measured():
    rows = [[2.0, 0.1, 0.4, 1.0, 1.5, 2.0, 0.25], [2.2, 1.1, 0.5, 3.0, 3.5, 4.0, 0.5]]
    assert telemetry.interval(rows, 4, shape())["sys/model_state_gb"] == 0.5
    unmeasured = [r[:6] + [0.0] for r in rows]  # a window that did not end on a log step
    assert "sys/model_state_gb" not in telemetry.interval(unmeasured, 4, shape())


def test_optimizer_ms_is_the_mean_steps_device_time_when_logged():
    # ROW's last column: seconds in engine.step() over the window (4 steps)
    rows = [[2.0, 0.1, 0.4, 1.0, 1.5, 2.0, 0.0, 800.0, 0.2],
            [2.2, 1.1, 0.5, 3.0, 3.5, 4.0, 0.0, 800.0, 0.3]]
    assert telemetry.interval(rows, 4, shape())["perf/optimizer_ms"] == pytest.approx(62.5)
    assert "perf/optimizer_ms" not in telemetry.interval([r[:8] for r in rows], 4, shape())


def test_peak_flops_come_from_the_table_by_the_drivers_name():
    assert telemetry.peak_tflops("NVIDIA H100 80GB HBM3", "bf16", tf32=False) == 989.5
    assert telemetry.peak_tflops("NVIDIA H100 PCIe", "bf16", tf32=False) == 756.5
    assert telemetry.peak_tflops("NVIDIA A100-SXM4-40GB", "fp32", tf32=True) == 156
    assert telemetry.peak_tflops("NVIDIA A100-SXM4-40GB", "fp32", tf32=False) == 19.5
    assert telemetry.peak_tflops("NVIDIA L40S", "bf16", tf32=False) == 362.05
    assert telemetry.peak_tflops(None, "fp32", tf32=False) is None  # CPU: no MFU invented
    assert telemetry.peak_tflops("Some Future GPU", "bf16", tf32=False) is None
    assert telemetry.peak_tflops(None, "fp32", tf32=False, override=50.0) == 50.0


def _launch(*args: str, env: dict) -> subprocess.CompletedProcess:
    """launch.sh with 2 ranks, its output to a file (not a terminal, as under Slurm)."""
    return subprocess.run(["bash", str(REPO / "launch.sh"), "--procs-per-node", "2", "--",
                           *map(str, args)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=900)


@pytest.fixture(scope="module")
def run(mlm_dataset, tmp_path_factory):
    """12 steps on 2 ranks through launch.sh, rank 1's loader slowed, wandb offline with an API
    key set; then resumed to 18 steps on 2 ranks forked from the warm process with the
    launcher's environment (the plain log of launch.sh is the first run's; the resume is what
    the wandb run and the summary read)."""
    root = tmp_path_factory.mktemp("telemetry")
    out = root / "run"
    env = clean_env(WANDB_MODE="offline", WANDB_API_KEY=KEY,
                    DSPRETRAIN_TEST_SLOW_LOADER="1:0.05")
    args = ["--data", mlm_dataset, "--out", out, *TINY, "--wandb", "offline", "--log-every", "4",
            "--eval-every", "6", "--save-every", "6", "--wandb-group", "tests",
            "--wandb-tags", "ci", "telemetry"]
    first = check(_launch(*args, "--max-steps", "18", "--stop-at-step", "12", env=env))
    second = check(launch("train", *args, "--max-steps", "18", procs=2, env=env))
    return out, first.stdout + first.stderr, second.stdout + second.stderr


@pytest.mark.multirank
def test_metrics_are_present_and_sane_and_name_the_slow_rank(run):
    out, log, _ = run
    rows = [r for r in metrics(out) if "train/loss" in r]
    need = {"perf/tokens_per_sec", "perf/tokens_per_sec_per_device", "perf/samples_per_sec",
            "perf/step_time_ms", "perf/step_time_ms_max", "perf/step_time_ms_min",
            "perf/data_wait_pct", "perf/data_wait_pct_max", "perf/slowest_rank",
            "perf/tflops_per_device", "sys/mem_gb", "sys/max_mem_gb", "perf/forward_ms",
            "perf/optimizer_ms"}
    assert need <= set(rows[0]), need - set(rows[0])
    assert "perf/mfu" not in rows[0]  # CPU: no peak to compare with, so no MFU invented
    for r in rows:
        assert r["perf/tokens_per_sec"] > 0 and 0 <= r["perf/data_wait_pct"] <= 100
        assert r["perf/slowest_rank"] == 1  # its loader waits 50 ms a micro batch
        # rank 1 sleeps 50 ms a step in its loader: tens of ms a step of data wait, however slow
        # the box (as a share it shrinks with the step, and a start's first window also holds
        # the start-up: 5.7 % against 2.2 % in one loaded CI run, 45-49 % against ~1 % after)
        assert r["perf/data_wait_pct_max"] > r["perf/data_wait_pct_min"]
        assert r["perf/data_wait_pct_max"] / 100 * r["perf/step_time_ms"] >= 20
        assert r["sys/max_mem_gb"] >= r["sys/mem_gb"] > 0
        # the step's parts are parts of it: an optimizer step runs, and takes less than a step
        assert 0 < r["perf/optimizer_ms"] < r["perf/step_time_ms"]
        assert r["perf/optimizer_ms"] + r["perf/forward_ms"] < r["perf/step_time_ms"]
    assert "run: 2 rank(s) on 1 node(s); global batch 8 samples" in log
    assert "expected: " in log and "no MFU on CPU" in log
    summary = json.loads((out / "summary.json").read_text())
    assert summary["tokens_per_sec_median"] > 0 and summary["peak_mem_gb"] > 0


@pytest.mark.multirank
def test_a_plain_log_has_no_carriage_returns_and_no_key(run):
    out, first, second = run
    assert "\r" not in first + second
    assert sum(1 for line in first.splitlines() if "step " in line and "| loss" in line) == 3
    assert KEY not in first + second
    for path in out.rglob("*"):
        if path.is_file():
            assert KEY.encode() not in path.read_bytes(), path


def _wandb_summary(run_file: Path) -> dict:
    proc = subprocess.run(["wandb", "leet", "inspect", "--summary", "--json", str(run_file)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.multirank
def test_the_offline_wandb_run_holds_metrics_and_config_under_one_id(run):
    out, _, _ = run
    files = sorted(out.glob("wandb/offline-run-*/run-*.wandb"))
    ids = {f.name[len("run-"):-len(".wandb")] for f in files}
    assert len(files) == 2 and len(ids) == 1  # the resume continued the same run
    assert ids == {(out / "wandb" / "run_id").read_text().strip()}
    data = _wandb_summary(files[-1])
    assert {"train/loss", "perf/tokens_per_sec", "perf/step_time_ms_max", "tokens_seen"} <= set(
        data["summary"]), sorted(data["summary"])
    assert data["summary"]["tokens_seen"] == 18 * 8 * 64
    config = data["config"]
    assert config["zero_stage"] == 0 and config["environment"]["world_size"] == 2
    assert config["engine"]["optimizer"] and config["run"]["wandb_group"] == "tests"


@pytest.mark.multirank  # its `run` fixture launches 2 ranks
def test_report_writes_pngs_for_one_run_and_for_two(run, tmp_path):
    out, _, _ = run
    copy = Path(shutil.copytree(out, tmp_path / "again", ignore=shutil.ignore_patterns("wandb")))
    check(run_app("report", out, timeout=300))
    names = {"curves.png", "loss.png", "throughput.png", "data_wait.png", "memory.png"}
    assert names <= {p.name for p in out.iterdir()} and (out / "report.md").is_file()
    both = tmp_path / "both"
    check(run_app("report", out, copy, "--out", both, timeout=300))
    for name in names:
        assert (both / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (both / "report.md").read_text()
    assert "| run |" in table and "| run |" in table and "again" in table
