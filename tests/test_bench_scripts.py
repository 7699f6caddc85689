"""The bench/ scripts import the app's internals and nothing else runs them: every name they import
from app/ and data_tools/ exists (the imports inside functions too), every script starts and prints
its usage, and the cheap ones measure something tiny for real. A module moved or a function renamed
fails here, not in the next benchmarking session."""
from __future__ import annotations

import ast
import importlib
import json
import subprocess
from pathlib import Path

import pytest

from tests.helpers import REPO, python

# bench/_NAME.py: a module the scripts share, not a script
SCRIPTS = sorted(p.name for p in (REPO / "bench").glob("*.py") if not p.name.startswith("_"))
OURS = ("app", "data_tools", "bench")


def bench(script: str, *args, timeout: int = 300) -> subprocess.CompletedProcess:
    """`python bench/SCRIPT ARGS` in its own process, as a user runs it (a fork of the warm
    process: tests/helpers.py `python`)."""
    return python(REPO / "bench" / script, *args, timeout=timeout)


def ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def imported_names(path: Path) -> list[tuple[str, str | None]]:
    """(module, name) for each `from app|data_tools|bench... import name` in the file, at any
    depth; (module, None) for `import app...`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 \
                and (node.module or "").split(".")[0] in OURS:
            found += [(node.module, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(a.name, None) for a in node.names if a.name.split(".")[0] in OURS]
    return found


# scripts that only start the app as processes (their runs below are their check)
PROCESS_ONLY = ("soak.py", "bench_fds.py")


def test_the_scripts_read_the_app_through_imports_this_test_sees():
    assert len(SCRIPTS) >= 9 and all(imported_names(REPO / "bench" / s)
                                     for s in SCRIPTS if s not in PROCESS_ONLY)


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_name_a_script_imports_from_the_app_exists(script):
    missing = []
    for module, name in imported_names(REPO / "bench" / script):
        mod = importlib.import_module(module)
        if name is not None and not hasattr(mod, name):
            try:
                importlib.import_module(f"{module}.{name}")
            except ImportError:
                missing.append(f"{module}.{name}")
    assert not missing, f"bench/{script} imports what no longer exists: {missing}"


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_starts_and_prints_its_usage(script):
    out = ok(bench(script, "--help"))
    assert out.startswith("usage: ") and "--" in out


def test_bench_stage_measures_a_tiny_dataset(tmp_path):
    out = ok(bench("bench_stage.py", "--dir", tmp_path, "--gb", "0.002", "--reps", "1",
                   "--workers", "1"))
    rows = {r["case"]: r for r in json.loads(out.splitlines()[-1])}
    assert set(rows) == {"cat *.bin > /dev/null", "cp -r", "cp -r && sync", "stage --workers 1"}
    assert all(r["seconds"] > 0 for r in rows.values()) and rows["cp -r"]["vs_cp"] == 1.0
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # its source and copies removed


def test_bench_manifest_times_a_tiny_tag(tmp_path):
    out = ok(bench("bench_manifest.py", "--params", "1e5", "--repeats", "1", "--dir", tmp_path))
    assert "of the save" in out and "of the load" in out and not list(tmp_path.iterdir())


def test_bench_loader_measures_a_prepared_dataset(mlm_dataset):
    out = ok(bench("bench_loader.py", "--data", mlm_dataset, "--seq-len", "64",
                   "--micro-batch", "2", "--batches", "3", "--step-ms", "100", "--reps", "1",
                   "--workers", "0"))
    assert "mlm/concat, seq_len 64, micro batch 2" in out
    assert out.splitlines()[-1].startswith("| 0 | ") and out.splitlines()[-1].endswith(" |")


@pytest.mark.slow
def test_bench_scaling_ceiling_times_the_apps_step_in_one_and_two_processes():
    out = ok(bench("bench_scaling_ceiling.py", "--work", "step", "--iters", "5", "--repeats",
                   "1", "--micro-batch", "2", "--seq-len", "32"))
    figures = json.loads(out.splitlines()[-1])
    assert figures["model"] == "bert-tiny" and figures["ratio_median"] > 0


@pytest.mark.slow
def test_bench_engine_build_builds_with_and_without_the_freeze(mlm_dataset, tmp_path):
    """Both sides build the bf16 ZeRO-1 engine in fresh processes with BF16_Optimizer's
    collections; frozen, a collection walks a few thousand objects, not the ~500k imported."""
    out = ok(bench("bench_engine_build.py", "--data", mlm_dataset, "--runs", "1", "--json",
                   tmp_path / "build.json", timeout=600))
    assert "build with/without: " in out and "| frozen |" in out
    median = json.loads((tmp_path / "build.json").read_text())["median"]
    assert median["with"]["collect_calls"] == median["without"]["collect_calls"] > 20
    assert median["with"]["objects_tracked"] < 50_000 < 300_000 < \
        median["without"]["objects_tracked"]


@pytest.mark.slow
def test_bench_step_compares_the_apps_step_with_a_plain_one(mlm_dataset):
    out = ok(bench("bench_step.py", "--data", mlm_dataset, "--seq-len", "32", "--micro-batch",
                   "2", "--block", "1", "--rounds", "2", "--log-every", "1"))
    figures = json.loads(out.splitlines()[-1])
    assert figures["app_ms"] > 0 and figures["plain_ms"] > 0
    assert len(figures["blocks_ms"]["app"]) == len(figures["blocks_ms"]["plain"]) == 2


@pytest.mark.slow
def test_bench_telemetry_prices_the_instrumentation_of_a_step(mlm_dataset):
    out = ok(bench("bench_telemetry.py", "--data", mlm_dataset, "--seq-len", "32",
                   "--micro-batch", "2", "--steps", "2", "--log-every", "1"))
    assert out.splitlines()[-1].startswith("overhead: ") and "% of the step" in out


@pytest.mark.slow
def test_bench_fds_counts_a_two_rank_jobs_descriptors_and_sockets(mlm_dataset, tmp_path):
    out = tmp_path / "fds.json"
    # one sample of the descriptors (after the third step, as each of the default three): the
    # job trains 2 s less
    ok(bench("bench_fds.py", "--sizes", "2", "--ref", "none", "--data", mlm_dataset,
             "--samples", "1", "--json", out, timeout=600))
    rows = {r["ranks"]: r for r in json.loads(out.read_text())["rows"] if r["tree"] == "this"}
    for who in ("rank0", "others"):  # a real job's descriptors: some sockets, and a bound total
        assert 0 < rows[who]["tcp"]["2"] <= rows[who]["fds"]["2"] < 200, rows[who]


@pytest.mark.slow
def test_bench_compile_attn_names_the_attention_the_compiled_graph_holds(tmp_path):
    out = tmp_path / "attn.json"
    # one layer: the same attention op, in a graph that compiles in ~60 % of bert-tiny's time
    ok(bench("bench_compile_attn.py", "--cpu", "--dropout", "0", "0.1", "--mask", "none",
             "--model-arg", "num_hidden_layers=1", "--steps", "1", "--repeats", "1",
             "--out", out))
    rows = {(r["dropout"], r["mode"]): r for r in json.loads(out.read_text())}
    assert rows[0.0, "eager"]["ms"] > 0 and rows[0.0, "compiled"]["ms"] > 0
    # CPU's fused attention has no dropout: with it the compiled graph multiplies the scores
    assert rows[0.0, "compiled"]["attention"] == "flash_attention_for_cpu"
    assert rows[0.1, "compiled"]["attention"] == "math"


@pytest.mark.slow
def test_bench_relink_times_both_loops_on_a_real_engine():
    out = ok(bench("bench_relink.py", "--model", "bert-tiny", "--calls", "2", "--rounds", "1"))
    line = out.splitlines()[-1]
    assert line.startswith("bert-tiny, ZeRO-2, ") and "DeepSpeed's relink" in line


def test_lowcomm_quality_names_each_variant_and_its_synchronous_start(tmp_path, monkeypatch):
    """bench_lowcomm_quality.py: every H with every outer lr and momentum, named whole (a
    momentum of 0.5 is not a file suffix), and --sync-start inside the schedule (in-process:
    nothing trains)."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(
        "bench_lowcomm_quality", REPO / "bench" / "bench_lowcomm_quality.py")
    quality = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(quality)
    base = ["bench_lowcomm_quality.py", "--data", str(tmp_path), "--out", str(tmp_path / "o"),
            "--steps", "100"]
    monkeypatch.setattr(sys, "argv", [*base, "--outer-every", "20,100", "--outer-lr", "1",
                                      "--outer-momentum", "0,0.5", "--", "--model", "bert-tiny"])
    args = quality.parse()
    names = [name for name, _ in quality.variants(args)]
    assert names == ["diloco-H20-lr1-m0", "diloco-H20-lr1-m0.5", "diloco-H100-lr1-m0",
                     "diloco-H100-lr1-m0.5"]
    flags = dict(quality.variants(args))["diloco-H100-lr1-m0.5"]
    assert flags[-6:] == ["--outer-every", "100", "--outer-lr", "1", "--outer-momentum", "0.5"]
    assert args.train_args == ["--model", "bert-tiny"] and args.sync_start == 0
    for bad in (["--sync-start", "100"], ["--outer-lr", "x"]):
        monkeypatch.setattr(sys, "argv", [*base, *bad])
        with pytest.raises(quality.UserError):
            quality.parse()
