"""`app bench`: the sweep as data (keys, product, placement, resources per rank), the results as
math (figures, scaling efficiency, the files), bad input as one line, and one real sweep through
launch.sh that is killed with SIGKILL, resumed, and records a failing configuration."""
from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.__main__ import main as app_main
from app.plan.probe import _failure, tagged_pids
from app.sweep import command as bench
from app.sweep import configs as sweep
from app.sweep import results as bench_results
from data_tools.errors import UserError
from tests.helpers import REPO, clean_env, run_app, zygote

PNG = b"\x89PNG\r\n\x1a\n"

# -- the sweep ----------------------------------------------------------------------------------


def test_items_parse_in_order_and_bad_ones_name_themselves():
    assert sweep.parse(["world=1,2", "zero=0,3", "model=bert-tiny,gpt-tiny", "micro-batch=8"]) \
        == {"world": [1, 2], "zero": [0, 3], "model": ["bert-tiny", "gpt-tiny"],
            "micro_batch": [8]}
    for item, needle in [("foo=1", "unknown key 'foo'"), ("world=0", "world='0'"),
                         ("world=1.5", "integer"), ("zero=4", "ZeRO stages"),
                         ("model=bert-huge", "unknown preset"), ("world=2,2", "listed twice"),
                         ("world", "KEY=V1,V2"), ("workers=-1", "integer >= 0")]:
        with pytest.raises(UserError, match=needle):
            sweep.parse([item])
    with pytest.raises(UserError, match="given twice"):
        sweep.parse(["world=1", "world=2"])


def expand(values, slots=None, cores=8, env_threads=None):
    return sweep.expand(values, slots=slots, cores=cores, env_threads=env_threads,
                        default_workers=lambda local: max(0, min(2, cores // local - 1)))


def test_every_configuration_gets_what_the_most_ranks_per_node_leave_a_rank():
    configs = expand({"world": [2, 1], "zero": [0, 3]}, cores=2)
    assert [(c.zero, c.world) for c in configs] == [(0, 1), (0, 2), (3, 1), (3, 2)]
    assert {(c.threads, c.workers) for c in configs} == {(1, 0)}  # 2 cores / 2 ranks
    assert {(c.threads, c.workers) for c in expand({"world": [1]}, cores=2)} == {(2, 1)}
    assert {c.threads for c in expand({"world": [1, 2]}, env_threads=3)} == {3}
    pinned = expand({"world": [1, 2], "threads": [1, 2], "workers": [0]}, cores=2)
    assert len(pinned) == 4 and {c.workers for c in pinned} == {0}
    c = configs[1]
    assert (c.micro_batch, c.seq_len, c.model) == (32, 128, "bert-tiny")  # 2x app train's batch
    assert c.train_flags()[:4] == ["--model", "bert-tiny", "--zero", "0"]
    assert c.launch_flags(None, 1234) == ["--procs-per-node", "2", "--master-port", "1234"]


def test_world_sizes_fill_the_hostfiles_nodes():
    assert sweep.placement(4, None) == (1, 4)
    assert sweep.placement(2, [8, 8]) == (1, 2)
    assert sweep.placement(16, [8, 8]) == (2, 8)
    for world in (12, 24):
        with pytest.raises(UserError, match=f"world={world}: does not fill whole nodes"):
            sweep.placement(world, [8, 8])
    big = expand({"world": [8, 16]}, slots=[8, 8], cores=64)[1]
    assert big.launch_flags(Path("/h"), 1)[:4] == ["--hostfile", "/h", "--nodes", "2"]
    assert {c.threads for c in expand({"world": [8, 16]}, slots=[8, 8], cores=64)} == {8}


def test_hostfile_slots(tmp_path):
    f = tmp_path / "hosts"
    f.write_text("# cluster\nnode1 slots=8\n\nnode2 slots=8  # spare\n")
    assert sweep.hostfile_slots(f) == [8, 8]
    f.write_text("node1 slots=eight\n")
    with pytest.raises(UserError, match="hosts:1: expected 'hostname slots=N'"):
        sweep.hostfile_slots(f)


# -- the results --------------------------------------------------------------------------------

def record(world, zero, tps, status="ok", **kw):
    c = expand({"world": [world], "zero": [zero], "threads": [1], "workers": [0]})[0]
    figures = {"tokens_per_sec": tps, "tokens_per_sec_per_device": tps / world,
               "step_time_ms": 100.0, "data_wait_pct": 1.0, "data_wait_pct_max": 2.0,
               "peak_mem_gb": 0.5, "model_state_gb": 0.01 / (world if zero == 3 else 1)}
    return {"config": c.as_dict(), "status": status, "error": kw.get("error"), "seconds": 10.0,
            "run_dir": f"runs/{c.id}", **({"figures": figures} if status == "ok" else {})}


def test_scaling_efficiency_is_per_device_throughput_against_the_smallest_world():
    table = bench_results.rows([record(1, 0, 1000.0), record(2, 0, 1900.0),
                                record(4, 0, 3000.0), record(1, 3, 0, "failed", error="boom"),
                                record(2, 3, 800.0), record(4, 3, 1200.0)])
    eff = {(r["zero"], r["world_size"]): r.get("scaling_efficiency") for r in table}
    assert eff[(0, 1)] == 1.0 and eff[(0, 2)] == pytest.approx(0.95)
    assert eff[(0, 4)] == pytest.approx(0.75)
    # ZeRO-3's world 1 failed: its smallest world that ran is the base
    assert eff[(3, 1)] is None and eff[(3, 2)] == 1.0 and eff[(3, 4)] == pytest.approx(0.75)
    text = bench_results.csv_text(table)
    rows = list(csv.DictReader(text.splitlines()))
    assert tuple(rows[0]) == bench_results.COLUMNS
    assert rows[1]["tokens_per_sec"] == "1900.0" and rows[1]["scaling_efficiency"] == "0.9500"
    assert rows[3]["status"] == "failed" and rows[3]["error"] == "boom"
    assert rows[3]["tokens_per_sec"] == ""
    md = bench_results.markdown(table, ["# sweep"])
    assert md.count("\n| ") == 8 and "- world=1 zero=3 model=bert-tiny micro_batch=32: failed: " \
        "boom" in md
    pictures = bench_results.plots(table, [])
    assert set(pictures) == set(bench_results.PLOTS)
    assert all(p.startswith(PNG) and len(p) > 10_000 for p in pictures.values())


def test_figures_leave_the_first_interval_out(tmp_path):
    rows = [{"step": 2, "tokens_seen": 1, "perf/tokens_per_sec": 10.0, "perf/step_time_ms": 900.0,
             "sys/max_mem_gb": 1.5},
            {"step": 3, "tokens_seen": 2, "eval/loss": 5.0}]
    rows += [{"step": s, "tokens_seen": s, "perf/tokens_per_sec": tps,
              "perf/step_time_ms": 1000.0 / tps, "perf/step_time_ms_max": 2000.0 / tps,
              "perf/data_wait_pct": 1.0, "perf/data_wait_pct_max": 3.0,
              "sys/max_mem_gb": 1.0, "sys/model_state_gb": 0.25}
             for s, tps in ((4, 100.0), (6, 200.0), (8, 400.0))]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    f = bench_results.run_figures(tmp_path, world=2)
    assert f["tokens_per_sec"] == 200.0 and f["tokens_per_sec_per_device"] == 100.0
    assert (f["step_time_ms"], f["step_time_ms_min"], f["step_time_ms_max"]) == (5.0, 2.5, 10.0)
    assert f["step_time_ms_slowest_rank"] == 10.0 and f["data_wait_pct_max"] == 3.0
    assert f["peak_mem_gb"] == 1.5 and f["model_state_gb"] == 0.25 and f["mfu"] is None
    assert f["steps_measured"] == 6


def test_a_failure_is_named_by_its_cause(tmp_path):
    log = tmp_path / "run.log"
    log.write_text("[node0 rank0] python -m app train: stopped: rank 0 lost a peer\n"
                   "[node0 rank1] Traceback (most recent call last):\n"
                   "[node0 rank1]   File \"x.py\", line 1, in <module>\n"
                   "[node0 rank1] ValueError: the real cause\n"
                   "[2026-01-01 00:00:00] [ERROR] [launch.py:1] exits with return code = 1\n")
    assert _failure(1, log) == "failed: ValueError: the real cause"
    log.write_text("[node0 rank1] rank 1: no progress for 4 s (--hang-timeout 3) while x\n"
                   "[node0 rank1] Thread 0x1 (most recent call first):\n")
    assert _failure(124, log).startswith("failed: rank 1: no progress for 4 s")


# -- bad input ----------------------------------------------------------------------------------

def test_bad_input_is_one_line_and_changes_nothing(mlm_dataset, tmp_path, one_line_error):
    out = tmp_path / "out"
    base = ["bench", "--data", str(mlm_dataset), "--out", str(out)]
    cases = [(["--sweep", "wrld=1,2"], "unknown key 'wrld'"),
             (["--sweep", "zero=0,7"], "zero='7'"),
             (["--sweep", "world=1", "--steps", "1"], "--steps 1"),
             (["--sweep", "world=1", "--", "--micro-batch", "4"], "sets this flag itself"),
             (["--sweep", "world=1", "--", "--lr", "0"], "--lr 0.0: must be positive")]
    for extra, needle in cases:
        assert app_main(base + extra) == 2
        one_line_error(needle)
    assert app_main(["bench", "--data", str(tmp_path / "nope"), "--out", str(out), "--sweep",
                     "world=1"]) == 2
    one_line_error("nope")
    assert not out.exists()
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("x")
    assert app_main(["bench", "--data", str(mlm_dataset), "--out", str(foreign), "--sweep",
                     "world=1"]) == 2
    one_line_error("not empty and not a benchmark sweep")


def test_another_sweep_into_the_same_out_is_refused_and_overwrite_removes_only_benchs(
        mlm_dataset, tmp_path, one_line_error):
    out = tmp_path / "out"
    identity = {"configurations": ["a"], "steps": 20, "data": "d", "data_fingerprint": "f",
                "train_args": [], "hostfile": None}
    bench.open_out(out, mlm_dataset, identity, overwrite=False)
    (out / "results" / "a.json").write_text("{}")
    (out / "notes.txt").write_text("mine")
    assert app_main(["bench", "--data", str(mlm_dataset), "--out", str(out), "--sweep",
                     "world=1"]) == 2
    one_line_error("holds another sweep", "configurations: 1 new")
    bench.open_out(out, mlm_dataset, {**identity, "steps": 10}, overwrite=True)
    assert (out / "notes.txt").read_text() == "mine" and not (out / "results" / "a.json").exists()
    assert json.loads((out / "sweep.json").read_text())["steps"] == 10


# -- a real sweep --------------------------------------------------------------------------------

def bench_args(data: Path, out: Path) -> list[str]:
    # world 2's rank 1 hangs at step 2; the watchdog fails that configuration after 2 s
    return ["bench", "--data", str(data), "--out", str(out), "--sweep", "world=1,2",
            "seq_len=32", "micro_batch=2", "--steps", "4", "--", "--hang-timeout", "2"]


@pytest.mark.multirank
def test_a_killed_sweep_resumes_and_a_failing_configuration_is_recorded(mlm_dataset, tmp_path):
    out = tmp_path / "sweep"
    env = clean_env(DSPRETRAIN_TEST_HANG="1:2")
    env.pop("OMP_NUM_THREADS")  # bench chooses the threads per rank
    first = out / "results" / "bert-tiny-zero0-world1-mb2-seq32-workers0-threads1.json"
    proc = subprocess.Popen([sys.executable, "-m", "app", *bench_args(mlm_dataset, out)],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    # the warm process the resume forks from, started now (if this worker has none yet) beside
    # world 1's run: started after the kill, its ~50 s on a loaded box let what the killed sweep
    # left run on to world 2's ranks before the resume stopped them
    zygote(env)
    try:  # SIGKILL the sweep once world 2's launch.sh runs: it goes on (starting DeepSpeed's
        # runner) for the resume to stop, and little of world 2's start-up is thrown away (at
        # three of its processes, the runner had imported DeepSpeed and launch.py begun to)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            if first.exists() and tagged_pids(bench.TAG, str(out.resolve())):
                break
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()[0]
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        log = proc.communicate()[0]
    assert "[1/2] world=1: ok" in log and "[2/2] world=2: running" in log, log
    assert len(list((out / "results").glob("*.json"))) == 1
    measured = first.read_bytes()

    # the sweep again (forked from the warm process: its configurations still run through the
    # real launcher, as children of their own)
    again = run_app(*bench_args(mlm_dataset, out), env=env, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "(1 measured already)" in again.stderr
    assert "[1/2]" not in again.stdout + again.stderr  # not run again
    assert first.read_bytes() == measured
    assert not tagged_pids(bench.TAG, str(out.resolve()))  # nothing left running
    rows = list(csv.DictReader((out / "results.csv").read_text().splitlines()))
    assert [(r["world_size"], r["status"]) for r in rows] == [("1", "ok"), ("2", "failed")]
    assert float(rows[0]["tokens_per_sec"]) > 0 and rows[0]["scaling_efficiency"] == "1.0000"
    assert float(rows[0]["peak_mem_gb"]) > 0 and float(rows[0]["model_state_gb"]) > 0
    # rank 1 hangs; rank 0, waiting for it in the all-reduce, may say so first
    assert re.match(r"rank [01]: no progress for \d+ s \(--hang-timeout 2\)", rows[1]["error"])
    assert f"[2/2] world=2: failed ({rows[1]['error']})" in again.stdout
    for name in bench_results.PLOTS:
        assert (out / name).read_bytes().startswith(PNG)
    assert "| 1 | 1 | 0 | bert-tiny | 2 | 32 |" in (out / "results.md").read_text()
    assert not (out / "runs" / rows[0]["run_dir"].split("/")[-1] / "checkpoints").exists()
