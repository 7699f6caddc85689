"""bench/gpu_mfu.py: the one command of a first GPU run, kept working on CPU (`--cpu --quick`, as
the acceptance check runs it: the ratio last, the JSON, the host-sync sites), and its parts that
read what a GPU run writes (a profiler trace's busy %, NCCL's transport lines) on fixed inputs."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from bench import gpu_mfu
from tests.helpers import REPO, clean_env


def test_union_counts_overlaps_once_and_clips_to_the_span():
    spans = [(5, 7), (0, 2), (1, 3), (3, 4), (10, 12), (6, 6.5)]
    assert gpu_mfu.union_length(spans) == 4 + 2 + 2  # [0,4] [5,7] [10,12]
    assert gpu_mfu.union_length(spans, lo=1.5, hi=11) == 2.5 + 2 + 1
    assert gpu_mfu.union_length([]) == 0


def _event(name, cat, ts, dur, tid=1):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 1, "tid": tid}


def test_busy_is_the_union_of_kernels_over_the_annotated_span():
    trace = {"traceEvents": [
        _event(gpu_mfu.SPAN, "user_annotation", 1000, 1000),
        _event("gemm", "kernel", 900, 300, tid=7),  # starts before the span: clipped to 200
        _event("gemm", "kernel", 1100, 200, tid=7),  # overlaps it: [1000, 1300], 300
        _event("copy", "gpu_memcpy", 1500, 100, tid=8),
        _event("ln", "kernel", 1550, 250, tid=7),  # overlaps the copy: [1500, 1800], 300
        _event("cudaStreamSynchronize", "cuda_runtime", 1850, 120),
        _event("cudaDeviceSynchronize", "cuda_runtime", 5000, 10),  # after the span
        _event("aten::mm", "cpu_op", 1000, 900),  # ignored when the trace has device work
    ]}
    busy = gpu_mfu.busy_from_trace(trace)
    assert busy["of"] == "device" and busy["busy_pct"] == pytest.approx(60.0)
    assert busy["wall_ms"] == pytest.approx(1.0)
    assert busy["sync_calls"] == {"cudaStreamSynchronize": {"count": 1, "ms": 0.12}}


def test_busy_spans_the_device_side_of_the_annotation_when_the_trace_has_it():
    """The host span opens before its first kernel runs (the queue ahead of it) and closes after
    a sync: the device side of the span (first to last device work launched in it) is the
    window; the host span still bounds the sync calls and gives the wall time."""
    trace = {"traceEvents": [
        _event(gpu_mfu.SPAN, "user_annotation", 1000, 1000),
        _event(gpu_mfu.SPAN, "gpu_user_annotation", 1200, 500, tid=7),
        _event("gemm", "kernel", 1100, 200, tid=7),  # the warm-up's tail: [1200, 1300] counts
        _event("gemm", "kernel", 1400, 200, tid=7),
        _event("ln", "kernel", 1650, 50, tid=7),
        _event("cudaDeviceSynchronize", "cuda_runtime", 1700, 250),
    ]}
    busy = gpu_mfu.busy_from_trace(trace)
    assert busy["busy_pct"] == pytest.approx(100.0 * (100 + 200 + 50) / 500)
    assert busy["wall_ms"] == pytest.approx(1.0)
    assert busy["sync_calls"] == {"cudaDeviceSynchronize": {"count": 1, "ms": 0.25}}


def test_busy_on_a_cpu_trace_is_the_span_threads_ops():
    trace = {"traceEvents": [
        _event(gpu_mfu.SPAN, "user_annotation", 0, 100),
        _event("aten::addmm", "cpu_op", 10, 30), _event("aten::mm", "cpu_op", 20, 10),
        _event("aten::copy_", "cpu_op", 60, 20),
        _event("aten::copy_", "cpu_op", 0, 100, tid=2),  # a loader thread: not the step's
    ]}
    assert gpu_mfu.busy_from_trace(trace)["busy_pct"] == pytest.approx(50.0)
    with pytest.raises(ValueError, match="annotation"):
        gpu_mfu.busy_from_trace({"traceEvents": trace["traceEvents"][1:]})


NCCL_LOG = """\
gpu1:811:811 [0] NCCL INFO NET/Plugin: Could not find: libnccl-net.so
gpu1:811:811 [0] NCCL INFO NET/IB : No device found.
gpu1:811:811 [0] NCCL INFO NET/Socket : Using [0]eth0:10.1.2.3<0>
gpu1:811:811 [0] NCCL INFO Using network Socket
gpu1:811:902 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read
gpu1:811:902 [0] NCCL INFO Channel 01/0 : 0[0] -> 1[1] via P2P/CUMEM/read
gpu1:812:903 [1] NCCL INFO Channel 00/0 : 1[1] -> 0[0] via SHM/direct/direct
gpu1:812:903 [1] NCCL INFO Channel 00/0 : 2[0] -> 1[1] [receive] via NET/IB/0/GDRDMA
gpu1:812:903 [1] NCCL INFO Connected all rings
"""


def test_nccl_transports_from_an_info_log():
    found = gpu_mfu.nccl_transports(NCCL_LOG.splitlines())
    assert found == {"via": ["NET/IB/GDRDMA", "P2P/CUMEM", "SHM"], "net": ["Socket"]}
    assert gpu_mfu.nccl_transports(["NCCL INFO Bootstrap : Using eth0"]) == {"via": [], "net": []}
    line = gpu_mfu.nccl_line({"mb": 256, "world": 2, "transport": found,
                              "bfloat16": {"bus_gbs": 361.2}, "float32": {"bus_gbs": 370.9}})
    assert "bus 361 GB/s bf16, 371 GB/s fp32" in line and "P2P/CUMEM" in line


def test_the_sync_counter_finds_the_call_sites_on_cpu():
    import torch
    from deepspeed.accelerator import get_accelerator

    t = torch.ones(3)
    with gpu_mfu.Syncs(gpu=False) as syncs:
        for _ in range(3):
            get_accelerator().synchronize()
        syncs.set_phase("log")
        t.sum().item(), float(t[0]), t.tolist()
    t.sum().item()  # after: not counted, and the wrappers are gone
    here = "tests/test_gpu_mfu.py"
    step, log = syncs.sites["step"], syncs.sites["log"]
    assert sum(step.values()) == 3 and all(k.startswith(f"synchronize {here}:") for k in step)
    assert sum(log.values()) == 3 and all(k.startswith(f"read {here}:") for k in log)


def test_a_sync_warning_raised_inside_the_mode_switch_is_the_switchs(monkeypatch):
    """On a GPU each window counted one sync-debug warning raised inside torch's
    set_sync_debug_mode itself (the H200 runs): counted under "switch", not as a step's."""
    import warnings

    import torch

    message = "called a synchronizing CUDA operation"
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode",
                        lambda mode: warnings.warn(message) if mode == "warn" else None)
    with gpu_mfu.Syncs(gpu=True) as syncs:
        warnings.warn(message)  # a step's
        syncs.set_phase("log")
        warnings.warn(message)
    assert sum(syncs.sites["switch"].values()) == 1
    assert sum(syncs.sites["step"].values()) == 1 == sum(syncs.sites["log"].values())
    assert all(k.startswith("sync-debug tests/test_gpu_mfu.py:") for k in syncs.sites["step"])


@pytest.mark.slow
def test_gloo_bus_bandwidth_over_two_processes(tmp_path):
    b = gpu_mfu.bus_bandwidth(2, tmp_path, mb=1, backend="gloo")
    assert b["world"] == 2 and b["transport"] is None
    assert all(b[d]["bus_gbs"] > 0 and b[d]["ms"] > 0 for d in ("bfloat16", "float32"))


@pytest.mark.slow
def test_cpu_quick_prints_the_ratio_last_and_writes_the_json(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_mfu.py"), "--cpu", "--quick",
                           "--out", str(tmp_path)], cwd=REPO, env=clean_env(),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert re.fullmatch(r"app / plain = \d+\.\d{3} x \(bert-tiny, seq 128 x micro 16, cpu fp32\)",
                        lines[-1]), lines[-1]
    assert any(re.match(r"  (PASS|FAIL) ratio ", line) for line in lines)
    doc = json.loads((tmp_path / "gpu_mfu.json").read_text())
    (r,) = doc["models"]
    assert doc["mode"] == "cpu" and r["model"] == "bert-tiny" and r["ratio"] > 0
    assert f"{r['ratio']:.3f}" in lines[-1]
    assert {v["name"] for v in r["verdicts"]} == {"ratio", "busy", "data wait", "host syncs"}
    # the log step syncs (the timing window's synchronize, the figures' one read to the host)
    log_sites = r["syncs"]["log_sites"]
    assert any(s.startswith("synchronize ") for s in log_sites), log_sites
    assert any(s.startswith("read app/") for s in log_sites), log_sites
    assert 0 < r["busy"]["app"]["busy_pct"] <= 100 and r["busy"]["app"]["of"] == "cpu"
    assert (tmp_path / "trace-bert-tiny-app.json").exists()
    assert 0 <= r["data_wait_pct"] < 100 and r["setup"]["precision"] == "fp32"


@pytest.mark.slow
def test_gpu_check_runs_the_checks_asked_for():
    """`--only` reruns a part of bench/gpu_check.sh (what a short GPU lease cut off): an unknown
    name is refused with exit 2; `--only probe` prints the probe's lines and trains nothing."""
    def check(*args):
        return subprocess.run(["bash", "bench/gpu_check.sh", *args], cwd=REPO, env=clean_env(),
                              capture_output=True, text=True, timeout=300)
    bad = check("--cpu", "--only", "probe,bogus")
    assert bad.returncode == 2 and "unknown check 'bogus'" in bad.stderr, bad.stderr
    ok = check("--cpu", "--only", "probe")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    checks = [line.split()[:2] for line in ok.stdout.splitlines()
              if line.split()[:1] and line.split()[0] in ("PASS", "FAIL", "SKIP", "INFO")]
    assert checks == [["INFO", "flash-attn"], ["INFO", "FusedAdam"]], ok.stdout
