"""bench/gpu_mfu.py: the one command of a first GPU run, kept working on CPU (`--cpu --quick`, as
the acceptance check runs it: the ratio last, the JSON, the host-sync sites), and its parts that
read what a GPU run writes (a profiler trace's busy %, NCCL's transport lines) on fixed inputs."""
from __future__ import annotations

import json
import re
import subprocess

import pytest

from bench import gpu_mfu
from tests.helpers import REPO, clean_env, python


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
    busy = gpu_mfu.busy_from_trace(trace, steps=1, step_ms=0.75)
    assert busy["of"] == "device" and busy["span_pct"] == pytest.approx(60.0)
    assert busy["work_ms"] == pytest.approx(0.6) and busy["busy_pct"] == pytest.approx(80.0)
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
    busy = gpu_mfu.busy_from_trace(trace, steps=1, step_ms=1.0)
    assert busy["span_pct"] == pytest.approx(100.0 * (100 + 200 + 50) / 500)
    assert busy["span_ms"] == pytest.approx(0.5) and busy["wall_ms"] == pytest.approx(1.0)
    assert busy["sync_calls"] == {"cudaDeviceSynchronize": {"count": 1, "ms": 0.25}}


def test_busy_on_a_cpu_trace_is_the_span_threads_ops():
    trace = {"traceEvents": [
        _event(gpu_mfu.SPAN, "user_annotation", 0, 100),
        _event("aten::addmm", "cpu_op", 10, 30), _event("aten::mm", "cpu_op", 20, 10),
        _event("aten::copy_", "cpu_op", 60, 20),
        _event("aten::copy_", "cpu_op", 0, 100, tid=2),  # a loader thread: not the step's
    ]}
    busy = gpu_mfu.busy_from_trace(trace, steps=2, step_ms=0.05)
    assert busy["span_pct"] == pytest.approx(50.0) and busy["of"] == "cpu"
    assert busy["work_ms_per_step"] == pytest.approx(0.025)
    assert busy["busy_pct"] == pytest.approx(50.0)
    with pytest.raises(ValueError, match="annotation"):
        gpu_mfu.busy_from_trace({"traceEvents": trace["traceEvents"][1:]}, 2, 0.05)


def _steps_trace(steps: int, work: float, gap: float) -> dict:
    """`steps` steps of `work` us of device work each (two kernels, back to back) with `gap` us
    of device idle after each, inside the annotation (host and device side)."""
    events, t = [], 1000.0
    for _ in range(steps):
        events += [_event("gemm", "kernel", t, work / 2, tid=7),
                   _event("ln", "kernel", t + work / 2, work / 2, tid=7)]
        t += work + gap
    events.append(_event(gpu_mfu.SPAN, "gpu_user_annotation", 1000, t - gap - 1000, tid=7))
    events.append(_event(gpu_mfu.SPAN, "user_annotation", 990, t - 990 + 50))
    return {"traceEvents": events}


def test_busy_is_the_device_work_a_step_over_the_unprofiled_step():
    """The H200 runs of 2026-11-29 failed the busy verdict at 65.3 and 55.6 % of the profiled span
    while the app's unprofiled step (62 ms) was as before: the profiler slowed the host to 93-107
    ms a step, and the device, fed by it, idled between ~60 ms of work a step. The judged figure
    is the device work a step over the unprofiled step, which host gaps under the profiler do not
    move; a device that idles in the real step (its unprofiled step longer than its work) fails."""
    stretched = gpu_mfu.busy_from_trace(_steps_trace(5, 59_600, 35_000), 5, step_ms=61.95)
    assert stretched["span_pct"] < 70 and stretched["work_ms_per_step"] == pytest.approx(59.6)
    assert stretched["busy_pct"] == pytest.approx(100 * 59.6 / 61.95)
    waits = gpu_mfu.busy_from_trace(_steps_trace(5, 59_600, 100), 5, step_ms=66.0)
    assert waits["span_pct"] > 99 and waits["busy_pct"] == pytest.approx(100 * 59.6 / 66.0)
    # the profiler's own device cost can make the work a step longer than a real step: capped
    assert gpu_mfu.busy_from_trace(_steps_trace(5, 63_000, 0), 5, step_ms=61.95)["busy_pct"] == 100

    def judged(busy):
        r = _result("NVIDIA H200", 0.876, busy["busy_pct"])
        r["busy"]["app"].update(busy)
        ok, name, detail = gpu_mfu.verdicts(r)[1]
        assert name == "busy" and "(plain 97.0 %, span 97.0 %" in detail, detail
        return ok, detail

    ok, detail = judged(stretched)
    assert ok, detail
    assert f"{stretched['busy_pct']:.1f} % of the app's unprofiled step (59.60 ms" in detail
    assert f"{stretched['span_pct']:.1f} % of the profiled span" in detail
    ok, detail = judged(waits)  # ~6 ms a step waiting in training: below the floor
    assert ok is False, detail


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
    # two processes forked from a fork of the warm process (spawned, each imported this module's
    # app and DeepSpeed afresh, ~6 s apiece); not from pytest's, which has threads
    measure = ("import json, sys; from pathlib import Path; from bench import gpu_mfu; "
               "print(json.dumps(gpu_mfu.bus_bandwidth(2, Path(sys.argv[1]), mb=1, "
               "backend='gloo', start_method='fork')))")
    proc = python("-c", measure, tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    b = json.loads(proc.stdout.splitlines()[-1])
    assert b["world"] == 2 and b["transport"] is None
    assert all(b[d]["bus_gbs"] > 0 and b[d]["ms"] > 0 for d in ("bfloat16", "float32"))


@pytest.fixture(scope="module")
def cpu_quick(tmp_path_factory):
    """One `bench/gpu_mfu.py --cpu --quick --json` run (1-2 minutes) for the tests that read it
    (the acceptance check's command)."""
    out = tmp_path_factory.mktemp("gpu_mfu")
    # 2 rounds, not quick's 6 (~55 -> ~34 s of the suite): the block stays quick's 5 steps, a
    # multiple of the 5 warm-up steps, so the app's log windows (one a block) are the timed blocks
    # and the two data-wait figures add up the same steps (within 1e-4 points in 5 runs here). With
    # 3-step blocks (da68dc7) the windows straddled the blocks: 0.66 against 0.14 %, and 0.21
    # against 0.08 %.
    proc = python(REPO / "bench" / "gpu_mfu.py", "--cpu", "--quick", "--rounds", "2", "--out", out,
                  "--json", out / "short" / "cpu.json", timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc, out


@pytest.mark.slow
def test_cpu_quick_prints_the_ratio_last_and_writes_the_json(cpu_quick):
    proc, tmp_path = cpu_quick
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert re.fullmatch(r"app / plain = \d+\.\d{3} x \(bert-tiny, seq 128 x micro 16, cpu fp32\)",
                        lines[-1]), lines[-1]
    # no baseline is recorded for a CPU: the ratio and busy % are shown, not judged
    assert any(re.match(r"  SKIP ratio .*no recorded baseline for cpu, bert-tiny", line)
               for line in lines), lines
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
def test_cpu_quick_json_has_each_models_mfu_and_both_sides_ms(cpu_quick):
    """--json FILE: {"models": {NAME: {"mfu", "app_ms", "plain_ms", ...}}}, the figures of the
    full gpu_mfu.json in short (MFU null on CPU: no peak known there)."""
    _, out = cpu_quick
    short = json.loads((out / "short" / "cpu.json").read_text())["models"]
    (r,) = json.loads((out / "gpu_mfu.json").read_text())["models"]
    assert list(short) == ["bert-tiny"]
    m = short["bert-tiny"]
    assert m["app_ms"] == r["app"]["ms_per_step"] > 0 and m["plain_ms"] == r["plain"]["ms_per_step"]
    assert m["mfu"] is None and m["ratio"] == r["ratio"]
    assert (m["attention"], m["packing"], m["compile"]) == ("sdpa", "concat", False)


def test_short_json_and_the_baseline_key_of_another_attention():
    """The short form from a result, MFU as a fraction; a run with another attention or packing
    than the recorded SDPA on concat windows matches no baseline (not judged)."""
    r = _result("NVIDIA H200", 0.9, 96.0)
    r["app"] = {"mfu": 0.31, "ms_per_step": 61.7, "tokens_per_sec": 5e5}
    r["plain"] = {"mfu": 0.27, "ms_per_step": 70.3}
    r["setup"].update(attention="sdpa", packing="concat")
    m = gpu_mfu.short_json([r])["models"]["bert-120m"]
    assert (m["mfu"], m["app_ms"], m["plain_ms"]) == (0.31, 61.7, 70.3)
    assert gpu_mfu.baseline_key(r) in gpu_mfu.BASELINES
    r["setup"].update(attention="flex", packing="doc-packed")
    assert gpu_mfu.baseline_key(r) not in gpu_mfu.BASELINES
    assert any(ok is None and name == "ratio" for ok, name, _ in gpu_mfu.verdicts(r))


def test_doc_packed_with_a_decoder_is_refused_in_one_line():
    proc = python(REPO / "bench" / "gpu_mfu.py", "--cpu", "--packing", "doc-packed",
                  "--models", "gpt-tiny", timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == \
        "gpu_mfu.py: error: --packing doc-packed: encoder models only (gpt-tiny given)"
    args = gpu_mfu.parse_args(["--cpu", "--packing", "doc-packed", "--attn", "flex"])
    assert gpu_mfu.models_for(args) == ["bert-tiny"] and args.attn == "flex"


@pytest.mark.slow
def test_cpu_quick_data_wait_is_the_apps_own_over_the_same_steps(cpu_quick):
    """The data wait % is the timed blocks' waits over the timed blocks' time, beside the app's own
    log of the same steps (its windows inside the blocks). It used to take the waits of the steps
    the sync count and the profiles ran after them too (review gpu-path-2 M-4): 2.2x the app's
    own with --quick on a GPU, where the H100 and H200 runs failed the 1 % verdict for it. Both
    figures add up the same steps' waits and differ only in where a block's clock and a window's
    stop, so within 1.3x of each other; or within 0.5 points where the waits are a few hundredths
    of a percent of a step (an idle box), where a ratio of two such figures is noise: half the
    verdict's 1 % limit, so agreement to 0.5 points still leaves the verdict meaning the same."""
    _, out = cpu_quick
    doc = json.loads((out / "gpu_mfu.json").read_text())
    (r,), g = doc["models"], doc["geometry"]
    first, last = r["data_wait_steps"]
    assert (first, last) == (g["warmup"] + 1, g["warmup"] + g["rounds"] * g["block"])
    ours, logged = r["data_wait_pct"], r["logged_data_wait_pct"]
    assert logged is not None and ours > 0 and logged > 0
    assert max(ours / logged, logged / ours) <= 1.3 or abs(ours - logged) <= 0.5, (ours, logged)
    assert f"{ours:.2f} % of the app's time in the timed blocks (its own log of the same steps: " \
           f"{logged:.2f} %" in next(v["detail"] for v in r["verdicts"] if v["name"] == "data wait")


def _result(device: str, ratio: float, busy: float, zero: int = 1, micro: int = 64) -> dict:
    return {"model": "bert-120m", "seq_len": 512, "micro_batch": micro, "ratio": ratio,
            "compile": False, "data_wait_pct": 0.5, "logged_data_wait_pct": 0.5,
            "setup": {"device": device, "precision": "bf16", "zero": zero},
            "busy": {"app": {"busy_pct": busy, "of": "device", "span_pct": busy,
                             "work_ms_per_step": 60.0, "step_ms": 6000 / busy},
                     "plain": {"busy_pct": 97.0, "span_pct": 97.0}},
            "syncs": {"per_ordinary_step": 0, "log_sites": {}}}


def test_ratio_and_busy_are_judged_against_the_recorded_baseline():
    """m-6: a limit of 1.03 x against a measured 0.86-0.88 let a 17 % regression pass, and busy
    >= 95 % against a measured 95.8 % would flap. Now each is judged against what the same
    device, model and setup recorded (gpu_mfu.BASELINES, within SLACK), and not at all where
    nothing is recorded."""
    def judged(r):
        return {name: ok for ok, name, _ in gpu_mfu.verdicts(r)}

    h200 = "NVIDIA H200"
    assert judged(_result(h200, 0.90, 94.0)) == {"ratio": True, "busy": True, "data wait": True,
                                                 "host syncs": True}
    most = 0.879 * (1 + gpu_mfu.SLACK["ratio"])  # the one recorded H200 ZeRO-1 run, + 5 %
    assert judged(_result(h200, most - 1e-3, 94.0))["ratio"]
    assert not judged(_result(h200, most + 1e-3, 94.0))["ratio"]  # 1.03 x passed this
    least = 95.7 - gpu_mfu.SLACK["busy_pct"]  # the lowest of the three 2026-11-29 runs, - 3
    assert judged(_result(h200, 0.90, least + 0.1))["busy"]
    assert not judged(_result(h200, 0.90, least - 0.1))["busy"]
    assert not judged(_result(h200, 0.90, 65.3))["busy"]  # that day's span figure as a step's
    h100 = judged(_result("NVIDIA H100 80GB HBM3", 0.86, 50.0))
    assert h100["ratio"] and h100["busy"] is None  # no busy % recorded in the current form
    for other in (_result("NVIDIA H200 NVL", 0.5, 50.0), _result(h200, 2.0, 10.0, micro=32)):
        assert judged(other)["ratio"] is None and judged(other)["busy"] is None
        detail = gpu_mfu.verdicts(other)[0][2]
        assert "no recorded baseline" in detail and "not judged" in detail, detail
    zero2 = _result(h200, 0.97, 44.6, zero=2)  # ZeRO-2: <= 0.968 + 5 %; its busy % not recorded
    zero2["setup"].update(optimizer="torch.optim.AdamW", fused=True, attention="sdpa")
    zero2["busy"]["app"].update(sync_calls={}, wall_ms=1.0)
    zero2.update({side: {"ms_per_step": 1.0, "tokens_per_sec": 1.0, "mfu": None}
                  for side in ("app", "plain")})
    lines = gpu_mfu.report(zero2)
    assert any(line.startswith("  PASS ratio ") for line in lines), lines
    assert any(line.startswith("  SKIP busy ") for line in lines), lines


@pytest.mark.slow
def test_gpu_check_runs_the_checks_asked_for():
    """`--only` reruns a part of bench/gpu_check.sh (what a short GPU lease cut off): an unknown
    name is refused with exit 2; `--only probe` prints the probe's lines and trains nothing, and
    at one rank says that nothing between ranks is checked (review gpu-path-2 M-6)."""
    def check(*args):
        return subprocess.run(["bash", "bench/gpu_check.sh", *args], cwd=REPO, env=clean_env(),
                              capture_output=True, text=True, timeout=300)
    bad = check("--cpu", "--only", "probe,bogus")
    assert bad.returncode == 2 and "unknown check 'bogus'" in bad.stderr, bad.stderr
    bad = check("--cpu", "--jobs", "0")
    assert bad.returncode == 2 and "--jobs 0: a positive number" in bad.stderr, bad.stderr
    ok = check("--cpu", "--only", "probe")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    checks = [line.split()[:2] for line in ok.stdout.splitlines()
              if line.split()[:1] and line.split()[0] in ("PASS", "FAIL", "SKIP", "INFO")]
    assert checks == [["INFO", "flash-attn"], ["INFO", "FusedAdam"]], ok.stdout
    assert "1 rank: no collective between ranks checked" in ok.stdout, ok.stdout
