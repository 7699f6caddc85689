"""launch.sh: option checking (one line, exit 2) and the deepspeed command it builds."""
from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest

LAUNCH = Path(__file__).resolve().parent.parent / "launch.sh"


def launch(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(LAUNCH), *args], capture_output=True, text=True, env=env,
                          timeout=60)


def test_dry_run_builds_the_deepspeed_command(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("# cluster\nnode1 slots=8\nnode2 slots=8\n")
    r = launch("--dry-run", "--hostfile", str(hosts), "--nodes", "2", "--procs-per-node", "8",
               "--master-port", "29600", "--stage-to", "/nvme/ds", "--",
               "--data", "/lustre/ds", "--out", "run dir")
    assert r.returncode == 0, r.stderr
    cmd = shlex.split(r.stdout)
    assert cmd[1:3] == ["-m", "deepspeed.launcher.runner"]
    i = cmd.index("--module")
    assert cmd[i + 1:] == ["app", "train", "--data", "/lustre/ds", "--out", "run dir",
                           "--stage-to", "/nvme/ds"]
    for flag, value in [("--hostfile", str(hosts)), ("--num_nodes", "2"), ("--num_gpus", "8"),
                        ("--master_port", "29600")]:
        assert cmd[cmd.index(flag) + 1] == value
    assert "--no_local_rank" in cmd


def test_no_ssh_mode_passes_node_rank():
    r = launch("--dry-run", "--no-ssh", "--nodes", "4", "--node-rank", "3", "--master-addr",
               "node0", "--", "--data", "d", "--out", "r")
    assert r.returncode == 0, r.stderr
    cmd = shlex.split(r.stdout)
    assert "--no_ssh" in cmd and cmd[cmd.index("--node_rank") + 1] == "3"
    assert cmd[cmd.index("--master_addr") + 1] == "node0"


@pytest.mark.parametrize("args, needle", [
    (["--nodes", "0", "--", "x"], "--nodes must be a positive integer"),
    (["--procs-per-node", "two", "--", "x"], "--procs-per-node must be a positive integer"),
    (["--master-port", "70000", "--", "x"], "--master-port"),
    (["--hostfile", "/no/such/hostfile", "--", "x"], "/no/such/hostfile"),
    (["--bogus", "--", "x"], "unknown option '--bogus'"),
    (["--no-ssh", "--master-addr", "a", "--", "x"], "--no-ssh needs --node-rank"),
    (["--no-ssh", "--node-rank", "4", "--nodes", "4", "--master-addr", "a", "--", "x"],
     "outside 0..3"),
    (["--node-rank", "1", "--", "x"], "only makes sense with --no-ssh"),
    ([], "no app train arguments"),
    (["--hostfile"], "--hostfile needs a value"),
])
def test_bad_options_one_line_exit_2(args, needle):
    r = launch(*args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_malformed_hostfile_names_file_and_line(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("node1 slots=8\nnode2 slots=eight\n")
    r = launch("--hostfile", str(hosts), "--", "x")
    assert r.returncode == 2
    assert r.stderr.strip() == (f"launch.sh: error: {hosts}:2: expected 'hostname slots=N', "
                                f"got 'node2 slots=eight'")


def test_threads_per_rank_split_the_cores(tmp_path):
    # launch.sh exports OMP_NUM_THREADS = cores / ranks unless the user set it; check through a
    # fake python that prints its environment instead of starting deepspeed.
    fake = tmp_path / "python"
    fake.write_text("#!/usr/bin/env bash\necho OMP=$OMP_NUM_THREADS TOK=$TOKENIZERS_PARALLELISM\n")
    fake.chmod(0o755)
    import os

    env = {**os.environ, "PYTHON": str(fake)}
    env.pop("OMP_NUM_THREADS", None)
    r = launch("--procs-per-node", "1", "--", "--data", "d", env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"OMP={len(os.sched_getaffinity(0))} TOK=false"
    env["OMP_NUM_THREADS"] = "3"
    assert launch("--", "x", env=env).stdout.strip() == "OMP=3 TOK=false"
