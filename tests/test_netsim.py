"""bench/netsim.py, the simulated cluster: nodes as network namespaces on shaped links, app train
across them through the real launch.sh --no-ssh (gloo over the veths), the same losses as the
same ranks on one node, links that are really shaped, and nothing left behind, also when the tool
is stopped or killed mid-run. The cluster tests need root, `ip` and `tc` (CI runs as root;
tests/run.sh installs iproute2); the unit tests of its parsing and of the sweep's `rate` key
need neither."""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import pytest

from app.sweep import configs as sweep
from data_tools.errors import UserError
from tests.helpers import REPO, clean_env, launch, run_app, train_losses

NETSIM = REPO / "bench" / "netsim.py"


def _load():
    spec = importlib.util.spec_from_file_location("netsim", NETSIM)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


netsim = _load()


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "the simulated cluster needs root (network namespaces, tc)"
    path = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    for tool in ("ip", "tc", "taskset"):
        if not shutil.which(tool, path=path):
            return f"the simulated cluster needs `{tool}` (iproute2, util-linux)"
    return None


needs_cluster = pytest.mark.skipif(_why_not() is not None, reason=_why_not() or "")
TRAIN = ["--model", "bert-tiny", "--seq-len", "32", "--micro-batch", "2", "--log-every", "1",
         "--eval-samples", "4", "--wandb", "disabled", "--num-workers", "0", "--dropout", "0",
         "--save-every", "0"]


def run_netsim(*args, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(NETSIM), *map(str, args)], cwd=REPO,
                          env=clean_env(), capture_output=True, text=True, timeout=timeout)


def ok(proc: subprocess.CompletedProcess) -> str:
    """stdout of a run that exited 0; else its stderr's tail, after the lines that say why a
    rank died (a gloo abort's `what():` sits far above the launchers' tracebacks)."""
    if proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\n" + "\n".join(why_lines(proc.stderr))
                             + f"\n...\n{proc.stderr[-4000:]}")
    return proc.stdout


def why_lines(stderr: str) -> list[str]:
    """The first lines of a failed run's output that say why a rank died."""
    keys = ("what()", "terminate called", "Error", "error:", "SIGABRT")
    return [line for line in stderr.splitlines() if any(k in line for k in keys)][:20]


def namespaces_of(pid: int) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines()
            if line.startswith(f"{netsim.PREFIX}{pid}-")]


def host_links() -> set[str]:
    """The host's own interfaces: netsim adds none (its links live in its namespaces)."""
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return {line.split(":")[1].strip() for line in out.splitlines()}


def processes_naming(text: str) -> list[int]:
    """Processes whose command line holds `text` (a run directory of this test)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if text.encode() in (proc / "cmdline").read_bytes():
                    found.append(int(proc.name))
            except OSError:
                pass
    return found


def train_on(data: Path, out: Path, nodes: int, ppn: int, rate: str, steps: int,
             *extra: str) -> subprocess.CompletedProcess:
    return run_netsim("run", "--nodes", nodes, "--procs-per-node", ppn, "--rate", rate, *extra,
                      "--", "--data", data, "--out", out, "--max-steps", steps, *TRAIN)


def train_here(data: Path, out: Path, ranks: int, steps: int, *extra: str
               ) -> subprocess.CompletedProcess:
    """The reference: the same ranks on this box, no namespace, no link (forked from the warm
    process with the launcher's environment: tests/helpers.py `launch`)."""
    return launch("train", "--data", data, "--out", out, "--max-steps", steps, *TRAIN, *extra,
                  procs=ranks)


def same_losses(a: Path, b: Path) -> None:
    la, lb = train_losses(a), train_losses(b)
    assert la and la.keys() == lb.keys()
    for step in la:
        assert abs(la[step] - lb[step]) <= 1e-5 * max(1.0, abs(la[step])), (step, la, lb)


# -- without a cluster ---------------------------------------------------------------------------

def test_rates_and_delays_read_as_tc_takes_them():
    assert netsim.parse_rate("200mbit") == 200_000_000
    assert netsim.parse_rate("2.5Gbit") == 2_500_000_000
    assert netsim.parse_rate("none") is None
    assert netsim.parse_delay("200us") == pytest.approx(0.2)
    assert netsim.parse_delay("1.5ms") == 1.5
    assert netsim.rate_text(152_000_000) == "152mbit"
    for bad in ("fast", "200", "-1mbit", "0mbit"):
        with pytest.raises(UserError, match="rate"):
            netsim.parse_rate(bad)


def test_the_plans_efficiency_is_read_per_stage_wherever_it_sits():
    by_key = {"stages": {"zero1": {"scaling": [{"nodes": 1, "efficiency": 1.0},
                                               {"nodes": 2, "efficiency": 0.7}]}}}
    by_field = {"stages": [{"zero": 2, "scaling": [{"nodes": 2, "efficiency": 0.6}]}]}
    assert netsim.stage_efficiency(by_key) == {"zero1": 0.7}
    assert netsim.stage_efficiency(by_field) == {"zero2": 0.6}
    assert netsim.stage_efficiency({"scaling": []}) == {}
    planner = {"stages": [  # app plan --json: a list of stages, each with its network section
        {"zero": "ZeRO-0", "zero_stage": 0, "offload": False,
         "network": {"scaling": [{"nodes": 2, "efficiency": 0.5}]}},
        {"zero": "ZeRO-3 + offload", "zero_stage": 3, "offload": True,
         "network": {"scaling": [{"nodes": 2, "efficiency": 0.1}]}}]}
    assert netsim.stage_efficiency(planner) == {"zero0": 0.5}
    planner["stages"][0]["network"]["scaling"][0]["step_ms"] = 1010.0
    assert netsim.stage_efficiency(planner, "step_ms") == {"zero0": 1010.0}


def test_collective_timings_fit_a_latency_and_a_cost_per_mb():
    rows = [{"kind": "all-gather", "bytes": mb * 10**6, "wall_ms": 2 + 7 * mb,
             "cpu_ms": 0.7 * mb} for mb in (1, 2, 4)]
    fit = netsim.collective_fits(rows)["all-gather"]
    assert fit["latency_ms"] == pytest.approx(2) and fit["ms_per_mb"] == pytest.approx(7)
    assert fit["cpu_ms_per_mb"] == pytest.approx(0.7) and fit["cpu_latency_ms"] == \
        pytest.approx(0, abs=1e-9)
    assert "all-reduce" not in netsim.collective_fits(rows)  # not timed: no fit


@pytest.mark.slow
def test_the_plan_is_given_each_stages_own_compute(mlm_dataset):
    """--plan: each stage planned (the real `app plan`) with its own measured 1-node step, a
    stage not measured with ZeRO-0's. The benchmark's widened bert-tiny: plain bert-tiny's
    partitions at 2 ranks are below the reducer's 256 KiB floor, packed into few buckets whose
    reduction hides behind nothing, so the windows below would not move its prediction."""
    runs = [{"system": "zero0", "nodes": 1, "step_time_ms": 100.0},
            {"system": "zero0", "nodes": 1, "step_time_ms": 120.0},
            {"system": "zero1", "nodes": 1, "step_time_ms": 150.0},
            {"system": "ddp", "nodes": 1, "step_time_ms": 90.0}]
    args = argparse.Namespace(plan=True, data=Path(mlm_dataset), model="bert-tiny",
                              model_arg=["hidden_size=256", "num_attention_heads=4",
                                         "intermediate_size=1024"], seq_len=64, micro_batch=4,
                              systems=["zero0", "zero1", "ddp"], outer_every=20)
    rate = 570_000_000
    eff, step = netsim.planned(args, runs, [rate])
    help_text = "--compute-ms --net-gbps --precision --device-kind --vocab-size"
    own = {c: netsim.plan_scaling(args, (c,), rate, help_text)["step_ms"]
           for c in (110.0, 150.0)}
    assert step["570mbit"]["zero0"] == pytest.approx(own[110.0]["zero0"])
    assert step["570mbit"]["zero1"] == pytest.approx(own[150.0]["zero1"])
    assert step["570mbit"]["zero2"] == pytest.approx(own[110.0]["zero2"])
    assert step["570mbit"]["zero1"] > 150 and 0 < eff["570mbit"]["zero1"] < 1
    # without ZeRO-0 (`--systems ddp,zero1`): the stages measured, each with its own
    eff, step = netsim.planned(args, [r for r in runs if r["system"] != "zero0"], [rate])
    assert set(step["570mbit"]) == {"zero1"}
    assert step["570mbit"]["zero1"] == pytest.approx(own[150.0]["zero1"])
    # runs that logged their optimizer step and forward pass: the plan gets those too (medians)
    timed = [{"system": "zero1", "nodes": 1, "step_time_ms": 150.0, "optimizer_ms": o,
              "forward_ms": f} for o, f in ((40.0, 20.0), (50.0, 30.0), (60.0, 25.0))]
    _, step = netsim.planned(args, timed, [rate])
    help_text += " --step-ms --forward-ms"
    parts = netsim.plan_scaling(args, (150.0, 50.0, 25.0), rate, help_text)["step_ms"]
    assert step["570mbit"]["zero1"] == pytest.approx(parts["zero1"])
    assert parts["zero1"] != pytest.approx(own[150.0]["zero1"], rel=1e-3)


def test_a_sweep_rate_runs_each_world_on_the_simulated_cluster():
    def expand(items, slots=None):
        return sweep.expand(sweep.parse(items), slots=slots, cores=2, env_threads=None,
                            default_workers=lambda n: 0)
    one, two = expand(["world=1,2", "rate=200mbit"])
    assert (one.nodes, one.procs_per_node, two.nodes, two.procs_per_node) == (1, 1, 2, 1)
    assert one.threads == two.threads == 1  # the nodes share the box's 2 cores
    assert two.id.endswith("-nodes2-rate200mbit") and one.group == two.group
    four = expand(["world=4", "rate=1gbit", "nodes=2"])[0]
    assert (four.nodes, four.procs_per_node) == (2, 2)
    plain = expand(["world=2"])[0]  # without a rate: as before, same id
    assert plain.rate is None and plain.id == ("bert-tiny-zero0-world2-mb32-seq128-workers0-"
                                               "threads1")
    with pytest.raises(UserError, match="rate=..."):
        expand(["world=2", "nodes=2"])
    with pytest.raises(UserError, match="hostfile"):
        expand(["world=2", "rate=1gbit"], slots=[1, 1])
    with pytest.raises(UserError, match="link rate"):
        sweep.parse(["rate=fast"])


def test_only_a_zero0_run_across_nodes_is_pointed_at_the_plan():
    from app.build import stage_hint

    hint = stage_hint(0, 4)
    assert hint.startswith("network: ZeRO-0 across 4 nodes") and "--nodes 4" in hint
    assert stage_hint(0, 1) is None  # one node: no network between the ranks
    assert stage_hint(1, 4) is None and stage_hint(3, 4) is None


# -- on a cluster --------------------------------------------------------------------------------

@needs_cluster
@pytest.mark.slow
def test_shaped_nodes_train_as_ranks_on_one_node_and_leave_nothing(mlm_dataset, tmp_path):
    """Four simulated nodes of one rank each, every link shaped, train the same losses as four
    ranks on this box (1e-5), and leave no namespace or link behind (two nodes are the same
    path: one cluster of four covers both, a cluster's start-up is ~12 CPU-s a node)."""
    links = host_links()
    proc = train_on(mlm_dataset, tmp_path / "net", 4, 1, "100mbit", 4, "--show-qdiscs")
    shown = ok(proc)
    assert shown.count("qdisc htb 1: root") == 8, shown  # both ends of all four links
    assert "4 rank(s) on 4 node(s)" in proc.stdout + proc.stderr
    assert "network: ZeRO-0 across 4 nodes" in proc.stdout + proc.stderr  # app.build.stage_hint
    local = train_here(mlm_dataset, tmp_path / "local", 4, 4)
    ok(local)
    assert "network: " not in local.stdout + local.stderr
    same_losses(tmp_path / "net", tmp_path / "local")
    assert host_links() == links
    assert leftovers() == []


@needs_cluster
@pytest.mark.slow
def test_two_islands_as_two_nodes_train_as_two_islands_on_one_node(mlm_dataset, tmp_path):
    """--dp-mode diloco: two simulated nodes (an island each, the default: a node's ranks) and
    two islands of one rank on one node (--island-ranks 1) train the same losses (1e-5): the
    islands and their syncs do not depend on where the ranks run."""
    diloco = ("--dp-mode", "diloco", "--outer-every", "2", "--zero", "1")
    ok(run_netsim("run", "--nodes", 2, "--procs-per-node", 1, "--rate", "200mbit", "--",
                  "--data", mlm_dataset, "--out", tmp_path / "net", "--max-steps", 5, *TRAIN,
                  *diloco))
    ok(train_here(mlm_dataset, tmp_path / "local", 2, 5, *diloco, "--island-ranks", "1"))
    same_losses(tmp_path / "net", tmp_path / "local")
    for run in ("net", "local"):
        config = json.loads((tmp_path / run / "config.json").read_text())
        assert config["run"]["island_ranks"] == 1, run
    assert leftovers() == []


def leftovers() -> list[str]:
    """netsim namespaces whose tool is gone (other runs' live clusters are theirs)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    names = [line.split()[0] for line in out.splitlines()]
    return [n for n in names if netsim.NAME.match(n)
            and not netsim.tool_alive(int(netsim.NAME.match(n).group(1)))]


@needs_cluster
@pytest.mark.slow
def test_the_links_are_shaped_to_the_rate(mlm_dataset, tmp_path):
    """One gloo all-reduce between 2 nodes sends its bytes over the link once each way: at
    20 Mbit/s it cannot take less than bytes x 8 / rate (a box under load only slows it)."""
    out = tmp_path / "ar.json"
    # torchrun makes a log directory it never removes (torchelastic_*): in the nodes' TMPDIR,
    # it goes with the cluster (no other test file runs torchrun)
    elastic = set(Path(tempfile.gettempdir()).glob("torchelastic_*"))
    args = ("ddp", "--nodes", 2, "--rate", "20mbit", "--", "--data", mlm_dataset, "--model",
            "bert-tiny", "--steps", "4", "--allreduce-only", "--out", out)
    proc = run_netsim(*args)
    if proc.returncode != 0 and "(SIGABRT)" in proc.stderr:
        # A rank aborted inside gloo in 2 of 3 full CI runs (2026-11-26), in none of 45 runs
        # alone, under load or 3 clusters at once, nor in the suite's first half run alone;
        # ddp_reference.py now skips the group's teardown (pytorch/gloo#155). Once more, and
        # the report says why rather than hiding it.
        warnings.warn("netsim ddp: a rank aborted (SIGABRT), retried once:\n"
                      + "\n".join(why_lines(proc.stderr)))
        proc = run_netsim(*args)
    ok(proc)
    assert set(Path(tempfile.gettempdir()).glob("torchelastic_*")) == elastic
    got = json.loads(out.read_text())
    floor_ms = got["bytes"] * 8 / 20e6 * 1000
    assert got["allreduce_ms"] >= 0.9 * floor_ms, (got["allreduce_ms"], floor_ms)


@needs_cluster
@pytest.mark.slow
def test_the_collectives_probe_times_each_primitive(tmp_path):
    """`netsim.py collectives`: all-reduce, reduce-scatter and all-gather between 2 nodes at a
    rate: bounded below by their bytes over the link (an all-gather sends half the tensor)."""
    proc = subprocess.run([sys.executable, str(NETSIM), "collectives", "--out", str(tmp_path),
                           "--rates", "100mbit", "--sizes-mb", "0.5,2", "--repeats", "2"],
                          cwd=REPO, env=clean_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads((tmp_path / "collectives.json").read_text())["100mbit"]
    rows = {(r["kind"], r["bytes"]): r for r in got["rows"]}
    big = max(b for _, b in rows)
    # ms for `nbytes` over the link, less what htb lets through at once (netsim's `shape`: a
    # burst of 128 KiB at 100 Mbit/s; without it an all-gather of 2 MB measured 71.9 ms against
    # a floor of 0.9 x 80)
    def floor(nbytes: float) -> float:
        return max(0.0, nbytes - 131072) * 8 / 100e6 * 1000
    assert rows[("all-reduce", big)]["wall_ms"] >= 0.9 * floor(big)
    assert rows[("all-gather", big)]["wall_ms"] >= 0.9 * floor(big / 2)
    assert set(got["fit"]) == {"all-reduce", "reduce-scatter", "all-gather"}


def _rank_processes(run_dir: Path) -> int:
    """The app's rank processes (`python -u -m app train ... --out RUN_DIR`) on the nodes."""
    count = 0
    for pid in processes_naming(str(run_dir)):
        try:
            args = Path("/proc", str(pid), "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        count += args[1:5] == [b"-u", b"-m", b"app", b"train"]  # not launch.sh, runner, launch.py
    return count


def _start_long_run(data: Path, run_dir: Path, until_training: bool = True) -> subprocess.Popen:
    """netsim running 2 nodes, waited on until both ranks train (or, with until_training=False,
    until both nodes' rank processes exist: still importing, but the node's whole launcher chain
    is up)."""
    proc = subprocess.Popen([sys.executable, str(NETSIM), "run", "--nodes", "2", "--rate",
                             "100mbit", "--", "--data", str(data), "--out", str(run_dir),
                             "--max-steps", "100000", *TRAIN], cwd=REPO, env=clean_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300

    def started() -> bool:
        if not until_training:
            return _rank_processes(run_dir) >= 2
        metrics_file = run_dir / "metrics.jsonl"
        return metrics_file.is_file() and bool(metrics_file.read_text().strip())

    while not started():
        assert proc.poll() is None and time.monotonic() < deadline, "training never started"
        time.sleep(0.2)  # both ranks train flat out from their first step until the signal
    assert len(namespaces_of(proc.pid)) == 3  # the switch and two nodes
    return proc


def scratch_of(pid: int) -> list[Path]:
    """The directories netsim `pid` made in the temp directory (its nodes' TMPDIR)."""
    return sorted(Path(tempfile.gettempdir()).glob(f"netsim-{pid}-*"))


@needs_cluster
@pytest.mark.slow
def test_a_stopped_or_killed_tool_leaves_nothing_behind(mlm_dataset, tmp_path):
    """SIGTERM: the tool removes its namespaces, processes and directory itself. SIGKILL:
    they stay, and `clean` removes them, the directory with what the nodes made in it."""
    links = host_links()
    stopped = _start_long_run(mlm_dataset, tmp_path / "term")
    scratch = scratch_of(stopped.pid)
    assert len(scratch) == 1 and (scratch[0] / "hostfile").is_file(), scratch
    stopped.send_signal(signal.SIGTERM)
    assert stopped.wait(timeout=180) == 143
    assert namespaces_of(stopped.pid) == []
    assert processes_naming(str(tmp_path / "term")) == []
    assert scratch_of(stopped.pid) == []

    # killed once every node's launcher chain has started its rank: what `clean` must find is
    # the same processes in the same namespaces, and the ranks need not import and train first
    killed = _start_long_run(mlm_dataset, tmp_path / "kill", until_training=False)
    killed.kill()
    killed.wait()
    left = namespaces_of(killed.pid)
    assert len(left) == 3  # SIGKILL: nothing could clean up
    scratch = scratch_of(killed.pid)
    # the nodes' TMPDIR: each node's launch.sh made its job directory there, not in /tmp
    assert len(scratch) == 1 and len(list(scratch[0].glob("launch.sh.*"))) == 2, scratch
    cleaned = run_netsim("clean")
    ok(cleaned)
    assert all(ns in cleaned.stderr for ns in left), cleaned.stderr
    assert str(scratch[0]) in cleaned.stderr, cleaned.stderr
    assert namespaces_of(killed.pid) == [] and scratch_of(killed.pid) == []
    assert processes_naming(str(tmp_path / "kill")) == []
    assert host_links() == links


@needs_cluster
@pytest.mark.slow
def test_app_bench_sweeps_the_link_rate_on_the_simulated_cluster(mlm_dataset, tmp_path):
    out = tmp_path / "bench"
    # app bench forked from the warm process: its configurations are its own children, each a
    # real netsim.py run. Small batches: the default 32 x 128 tokens cost ~0.5 CPU-s a step a
    # rank, and the sweep's rows need only finish.
    proc = run_app("bench", "--data", mlm_dataset, "--out", out, "--sweep", "world=1,2",
                   "rate=100mbit", "micro_batch=2", "seq_len=32", "--steps", "3", "--",
                   "--dropout", "0", timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = (out / "results.csv").read_text().splitlines()
    assert len(rows) == 3 and all(",100mbit," in r and ",ok," in r for r in rows[1:]), rows
    two = json.loads((out / "results" / "bert-tiny-zero0-world2-mb2-seq32-workers0-threads1-"
                      "nodes2-rate100mbit.json").read_text())
    assert two["status"] == "ok" and two["config"]["nodes"] == 2
    log = (out / "runs" / "bert-tiny-zero0-world2-mb2-seq32-workers0-threads1-nodes2-"
           "rate100mbit.log").read_text()
    assert "2 node(s) x 1 rank(s), links 100mbit" in log
    assert leftovers() == []
