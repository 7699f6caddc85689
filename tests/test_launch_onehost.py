"""launch.sh with a hostfile whose one host is this box: a local run (DeepSpeed's runner would
otherwise take the hostfile for a multi-node launch and ssh to this very host), with the
hostfile's slots as ranks; a hostfile of another host, or of several, goes on as before."""
from __future__ import annotations

import shlex
import socket
import subprocess
from pathlib import Path

import pytest

from tests.helpers import TINY, clean_env

LAUNCH = Path(__file__).resolve().parent.parent / "launch.sh"


def dry_run(hosts: Path, *args: str) -> list[str]:
    r = subprocess.run(["bash", str(LAUNCH), "--dry-run", "--hostfile", str(hosts), *args, "--",
                        "--data", "d", "--out", "r"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return shlex.split(r.stdout)


def value(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", socket.gethostname()])
def test_one_local_host_runs_on_this_box(tmp_path, host):
    hosts = tmp_path / "hosts"
    hosts.write_text(f"# one node\n{host} slots=3\n")
    cmd = dry_run(hosts)
    # the hostfile handed on is absent: DeepSpeed's runner then uses this box, not ssh
    assert value(cmd, "--hostfile") != str(hosts)
    assert not Path(value(cmd, "--hostfile")).exists()
    assert value(cmd, "--num_gpus") == "3"  # the hostfile's slots
    assert "--master_port" in cmd and "--master_addr" not in cmd
    assert "--no_ssh_check" not in cmd and "--no_ssh" not in cmd
    assert cmd[-8:] == ["-u", "-m", "app", "train", "--data", "d", "--out", "r"]


def test_procs_per_node_overrides_the_slots(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost slots=4\n")
    assert value(dry_run(hosts, "--procs-per-node", "2"), "--num_gpus") == "2"


def test_first_of_several_hosts_with_nodes_1_is_local(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost slots=2\nnode9 slots=2\n")
    cmd = dry_run(hosts, "--nodes", "1")
    assert value(cmd, "--hostfile") != str(hosts) and value(cmd, "--num_gpus") == "2"


def test_one_other_host_keeps_the_hostfile(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("some-other-node slots=2\n")
    cmd = dry_run(hosts)
    assert value(cmd, "--hostfile") == str(hosts) and "--num_gpus" not in cmd


def test_no_ssh_keeps_the_hostfile(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost slots=2\n")
    cmd = dry_run(hosts, "--no-ssh", "--node-rank", "0", "--master-addr", "localhost")
    assert value(cmd, "--hostfile") == str(hosts) and "--no_ssh" in cmd


@pytest.mark.slow
def test_one_host_hostfile_trains_on_this_box(tmp_path, mlm_dataset):
    """The real launch: before, DeepSpeed's runner ssh'd to localhost and ended in a traceback."""
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost slots=1\n")
    out = tmp_path / "run"
    r = subprocess.run(["bash", str(LAUNCH), "--hostfile", str(hosts), "--", "--data",
                        str(mlm_dataset), "--out", str(out), *TINY, "--max-steps", "2",
                        "--eval-samples", "8"],  # the eval: not read
                       capture_output=True, text=True, timeout=300, env=clean_env())
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    assert (out / "summary.json").is_file()
