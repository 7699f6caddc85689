"""launch.sh: option and hostfile checks (one line, exit 2, nothing started), the deepspeed command
it builds, what it forwards, and the per-rank wrapper (`--as-rank`). Runs with processes that do
not train: the multi-node runs are in test_multinode.py."""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

LAUNCH = Path(__file__).resolve().parent.parent / "launch.sh"


def launch(*args: str, env: dict | None = None, cwd: Path | None = None
           ) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(LAUNCH), *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=60)


def one_error_line(r: subprocess.CompletedProcess, *needles: str) -> str:
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("launch.sh: error: "), r.stderr
    assert "Traceback" not in r.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def hostfile(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "hosts"
    path.write_text(text)
    return path


def test_dry_run_builds_the_deepspeed_command(tmp_path):
    hosts = hostfile(tmp_path, "# cluster\nnode1 slots=8\nnode2 slots=8\n")
    r = launch("--dry-run", "--hostfile", str(hosts), "--nodes", "2", "--procs-per-node", "8",
               "--master-port", "29600", "--stage-to", "/nvme/{node_rank}/ds", "--",
               "--data", "/lustre/ds", "--out", "run dir")
    assert r.returncode == 0, r.stderr
    cmd = shlex.split(r.stdout)
    assert cmd[1:3] == ["-m", "app.runtime.runner"]  # DeepSpeed's runner, collector paused
    for flag, value in [("--hostfile", str(hosts)), ("--num_nodes", "2"), ("--num_gpus", "8"),
                        ("--master_port", "29600"), ("--master_addr", "node1")]:
        assert cmd[cmd.index(flag) + 1] == value
    # every rank runs through launch.sh --as-rank, which puts the node's rank into --stage-to
    i = cmd.index("--no_python")
    assert cmd[i + 1:i + 5] == ["--no_local_rank", "bash", str(LAUNCH), "--as-rank"]
    j = cmd.index("--")
    assert cmd[i + 5:j] == ["--stage-to", "/nvme/{node_rank}/ds"]
    assert cmd[j + 2:] == ["-u", "-m", "app", "train", "--data", "/lustre/ds", "--out", "run dir"]
    assert "--no_ssh_check" in cmd  # launch.sh checks every host itself, the way pdsh connects
    assert "forwarding" in r.stderr and "OMP_NUM_THREADS" in r.stderr


def test_no_ssh_mode_passes_node_rank(tmp_path):
    r = launch("--dry-run", "--no-ssh", "--nodes", "4", "--node-rank", "3", "--master-addr",
               "node0", "--procs-per-node", "2", "--", "--data", "d", "--out", "r")
    assert r.returncode == 0, r.stderr
    cmd = shlex.split(r.stdout)
    assert "--no_ssh" in cmd and cmd[cmd.index("--node_rank") + 1] == "3"
    assert cmd[cmd.index("--master_addr") + 1] == "node0"
    assert "--hostfile" in cmd  # written for the job: 4 nodes of 2 slots each
    hosts = hostfile(tmp_path, "a slots=1\nb slots=1\n")
    r = launch("--dry-run", "--hostfile", str(hosts), "--no-ssh", "--node-rank", "1",
               "--master-addr", "a", "--", "--data", "d")
    assert r.returncode == 0, r.stderr
    assert shlex.split(r.stdout)[shlex.split(r.stdout).index("--hostfile") + 1] == str(hosts)


@pytest.mark.parametrize("args, needle", [
    (["--nodes", "0", "--", "x"], "--nodes must be a positive integer"),
    (["--procs-per-node", "two", "--", "x"], "--procs-per-node must be a positive integer"),
    (["--master-port", "70000", "--", "x"], "--master-port"),
    (["--ssh-port", "0", "--", "x"], "--ssh-port"),
    (["--hostfile", "/no/such/hostfile", "--", "x"], "/no/such/hostfile"),
    (["--bogus", "--", "x"], "unknown option '--bogus'"),
    (["--no-ssh", "--master-addr", "a", "--", "x"], "--no-ssh needs --node-rank"),
    (["--no-ssh", "--node-rank", "4", "--nodes", "4", "--master-addr", "a", "--", "x"],
     "outside 0..3"),
    (["--no-ssh", "--node-rank", "0", "--master-addr", "a", "--", "x"],
     "--no-ssh needs --hostfile FILE"),
    (["--node-rank", "1", "--", "x"], "only makes sense with --no-ssh"),
    (["--nodes", "3", "--", "x"], "--nodes 3 needs a --hostfile"),
    (["--launcher", "ray", "--", "x"], "--launcher ray"),
    (["--env", "NOT-A-NAME", "--", "x"], "--env NOT-A-NAME: expected a variable name"),
    (["--env", "LAUNCH_TEST_UNSET_VARIABLE", "--", "x"], "not set in this environment"),
    (["--", "--stage-to", "/x/{node_rank}"], "only in launch.sh's own --stage-to"),
    ([], "no app train arguments"),
    (["--hostfile"], "--hostfile needs a value"),
])
def test_bad_options_one_line_exit_2(args, needle):
    one_error_line(launch(*args), needle)


def test_malformed_hostfile_names_file_and_line(tmp_path):
    hosts = hostfile(tmp_path, "node1 slots=8\nnode2 slots=eight\n")
    r = launch("--hostfile", str(hosts), "--", "x")
    assert r.returncode == 2
    assert r.stderr.strip() == (f"launch.sh: error: {hosts}:2: expected 'hostname slots=N', "
                                f"got 'node2 slots=eight'")


@pytest.mark.parametrize("text, extra, needle", [
    ("# only a comment\n\n", [], "no hosts in the hostfile"),
    ("", ["--no-ssh", "--node-rank", "0", "--master-addr", "a"], "no hosts in the hostfile"),
    ("a slots=2\nb slots=2\na slots=2\n", [], "hosts:3: host 'a' is listed twice (also line 1)"),
    ("node[1-4] slots=8\n", [], "hosts:1: 'node[1-4]' is not a host name"),
    ("a slots=1\n", ["--nodes", "3"], "--nodes 3: "),
    ("a slots=1\n", ["--nodes", "3", "--no-ssh", "--node-rank", "0", "--master-addr", "a"],
     "--nodes 3: "),
    ("a slots=1\nb slots=1\n", ["--no-ssh", "--node-rank", "2", "--master-addr", "a"],
     "--node-rank 2 is outside 0..1"),
])
def test_bad_hostfiles_are_refused_before_anything_starts(tmp_path, text, extra, needle):
    hosts = hostfile(tmp_path, text)
    r = launch("--hostfile", str(hosts), *extra, "--", "--data", "d", "--out",
               str(tmp_path / "run"))
    line = one_error_line(r, needle)
    assert str(hosts) in line or "--node-rank" in line
    assert not (tmp_path / "run").exists()


def test_missing_pdsh_is_refused(tmp_path):
    # a PATH with everything this machine has but pdsh
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for d in os.environ["PATH"].split(os.pathsep) + ["/usr/bin", "/bin"]:
        if not os.path.isdir(d):
            continue
        for name in os.listdir(d):
            if name != "pdsh" and not (bin_dir / name).exists():
                (bin_dir / name).symlink_to(Path(d) / name)
    hosts = hostfile(tmp_path, "a slots=1\nb slots=1\n")
    env = {**os.environ, "PATH": str(bin_dir), "PYTHON": sys.executable}
    one_error_line(launch("--hostfile", str(hosts), "--", "x", env=env),
                   "the pdsh launcher needs pdsh")


def test_what_the_remote_shell_would_misread_is_refused(tmp_path):
    hosts = hostfile(tmp_path, "a slots=1\nb slots=1\n")
    line = one_error_line(launch("--dry-run", "--hostfile", str(hosts), "--", "--out", "a;b"),
                          "'a;b' cannot pass through pdsh")
    assert "--no-ssh" in line
    env = {**os.environ, "WANDB_NOTES": "costs $5", "HF_TOKEN": "hf_secret\"value"}
    line = one_error_line(launch("--dry-run", "--hostfile", str(hosts), "--", "x", env=env),
                          "cannot forward HF_TOKEN")
    assert "secret" not in line  # values are never printed
    # the same launch on one node (or with --no-ssh) passes no shell: nothing to refuse
    r = launch("--dry-run", "--hostfile", str(hosts), "--no-ssh", "--node-rank", "0",
               "--master-addr", "a", "--", "--out", "a;b", env=env)
    assert r.returncode == 0, r.stderr


def test_forwarded_names_are_listed_never_their_values(tmp_path):
    hosts = hostfile(tmp_path, "a slots=1\nb slots=1\n")
    env = {**os.environ, "WANDB_API_KEY": "0123456789abcdef" * 2, "HF_HOME": "/hf",
           "NCCL_DEBUG": "INFO", "MY_SETTING": "1", "NOT_ASKED_FOR": "1"}
    r = launch("--dry-run", "--hostfile", str(hosts), "--env", "MY_SETTING", "--", "x", env=env)
    assert r.returncode == 0, r.stderr
    names = r.stderr.split("forwarding ")[1].split(" (values")[0].split()
    assert {"WANDB_API_KEY", "HF_HOME", "NCCL_DEBUG", "MY_SETTING", "OMP_NUM_THREADS",
            "TOKENIZERS_PARALLELISM", "PATH"} <= set(names)
    assert "NOT_ASKED_FOR" not in names
    assert "0123456789abcdef" not in r.stdout + r.stderr


def test_threads_per_rank_split_the_cores(tmp_path):
    # launch.sh exports OMP_NUM_THREADS = cores / ranks unless the user set it; check through a
    # fake python that answers launch.sh's version probe (-c), then prints its environment
    # instead of starting deepspeed.
    fake = tmp_path / "python"
    fake.write_text('#!/usr/bin/env bash\n'
                    'if [ "$1" = -c ]; then echo "$0"; echo versions; exit; fi\n'
                    'echo OMP=$OMP_NUM_THREADS TOK=$TOKENIZERS_PARALLELISM\n')
    fake.chmod(0o755)
    env = {**os.environ, "PYTHON": str(fake)}
    env.pop("OMP_NUM_THREADS", None)
    r = launch("--procs-per-node", "1", "--", "--data", "d", env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"OMP={len(os.sched_getaffinity(0))} TOK=false"
    # ranks per node unknown here (one per accelerator): each rank divides by LOCAL_WORLD_SIZE
    assert launch("--", "x", env=env).stdout.strip() == "OMP= TOK=false"
    env["OMP_NUM_THREADS"] = "3"
    assert launch("--", "x", env=env).stdout.strip() == "OMP=3 TOK=false"


def test_a_rank_tags_its_lines_and_gets_its_node_rank_in_stage_to():
    """`launch.sh --as-rank` is what the deepspeed launcher starts for every rank."""
    env = {**os.environ, "CROSS_RANK": "1", "RANK": "3"}
    script = "import sys; print(sys.argv[1:]); print('oops', file=sys.stderr); sys.exit(5)"
    r = launch("--as-rank", "--stage-to", "/nvme/{node_rank}/ds", "--", sys.executable, "-c",
               script, env=env)
    assert r.returncode == 5  # the rank's own status
    assert r.stdout == "[node1 rank3] ['--stage-to', '/nvme/1/ds']\n"
    assert r.stderr == "[node1 rank3] oops\n"
    r = launch("--as-rank", "--no-prefix", "--", sys.executable, "-c", "print('plain')", env=env)
    assert r.returncode == 0 and r.stdout == "plain\n"
    env.pop("CROSS_RANK")
    one_error_line(launch("--as-rank", "--stage-to", "/nvme/{node_rank}", "--", "true", env=env),
                   "no node rank")


def test_mpi_and_slurm_backends_start_python_themselves(tmp_path):
    # DeepSpeed's slurm backend always runs `python -u SCRIPT`: no per-rank wrapper there
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "srun").chmod(0o755)
    hosts = hostfile(tmp_path, "a slots=1\nb slots=1\n")
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    r = launch("--dry-run", "--hostfile", str(hosts), "--launcher", "slurm", "--stage-to",
               "/nvme/ds", "--", "--data", "d", env=env)
    assert r.returncode == 0, r.stderr
    cmd = shlex.split(r.stdout)
    assert cmd[cmd.index("--launcher") + 1] == "slurm" and "--no_python" not in cmd
    assert cmd[cmd.index("--module"):] == ["--module", "app", "train", "--data", "d",
                                          "--stage-to", "/nvme/ds"]
    one_error_line(launch("--dry-run", "--hostfile", str(hosts), "--launcher", "slurm",
                          "--stage-to", "/nvme/{node_rank}", "--", "x", env=env),
                   "works with the pdsh launcher or --no-ssh")


def test_the_fabric_variables_reach_the_other_nodes_by_default(tmp_path):
    """GLOO_*, FI_* (EFA), UCX_*, torch's NCCL and rendezvous switches, CUDA_* and
    LD_LIBRARY_PATH (NCCL's net plugins) go without --env; CUDA_VISIBLE_DEVICES is launch.py's."""
    hosts = hostfile(tmp_path, "hostA slots=1\nhostB slots=1\n")
    fabric = {"GLOO_SOCKET_IFNAME": "eth9", "FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1",
              "UCX_TLS": "rc", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
              "TORCH_DISTRIBUTED_DEBUG": "INFO", "CUDA_HOME": "/usr/local/cuda",
              "LD_LIBRARY_PATH": "/opt/aws-ofi-nccl/lib"}
    env = {**os.environ, **fabric, "CUDA_VISIBLE_DEVICES": "0"}
    r = launch("--dry-run", "--hostfile", str(hosts), "--", "--data", "x", "--out", "y", env=env)
    assert r.returncode == 0, r.stderr  # eth9 is not here: the hosts' interfaces are checked there
    names = r.stderr.split("forwarding ")[1].split(" (values")[0].split()
    assert set(fabric) <= set(names) and "CUDA_VISIBLE_DEVICES" not in names


@pytest.mark.parametrize("var, value", [("GLOO_SOCKET_IFNAME", "nosuch0"),
                                        ("GLOO_SOCKET_IFNAME", "lo,nosuch0"),
                                        ("NCCL_SOCKET_IFNAME", "nosuch"),
                                        ("NCCL_SOCKET_IFNAME", "=l")])
def test_an_interface_this_node_lacks_is_one_line(var, value):
    env = {**os.environ, var: value}
    one_error_line(launch("--dry-run", "--procs-per-node", "2", "--", "x", env=env),
                   f"{var}={value}: no such network interface", "the master 127.0.0.1")
    r = launch("--dry-run", "--no-ssh", "--nodes", "2", "--procs-per-node", "1", "--node-rank",
               "1", "--master-addr", "node0", "--", "x", env=env)
    one_error_line(r, f"{var}={value}: ", "the master node0")


@pytest.mark.parametrize("var, value", [("GLOO_SOCKET_IFNAME", "lo"),
                                        ("NCCL_SOCKET_IFNAME", "l"),  # NCCL's are prefixes
                                        ("NCCL_SOCKET_IFNAME", "=lo"),
                                        ("NCCL_SOCKET_IFNAME", "^docker")])
def test_an_interface_this_node_has_passes(var, value):
    r = launch("--dry-run", "--procs-per-node", "2", "--", "x", env={**os.environ, var: value})
    assert r.returncode == 0, r.stderr


def test_a_gloo_interface_without_an_address_is_one_line():
    """Before: GLOO_SOCKET_IFNAME naming an interface that exists but has no address passed
    the pre-flight, then every rank failed inside gloo."""
    bare = [name for name in sorted(os.listdir("/sys/class/net"))
            if subprocess.run(["ip", "-o", "addr", "show", "dev", name], capture_output=True,
                              text=True).stdout.strip() == ""]
    if not bare:
        pytest.skip("every interface of this node has an address")
    for value in (bare[0], f"lo,{bare[0]}"):
        env = {**os.environ, "GLOO_SOCKET_IFNAME": value}
        one_error_line(launch("--dry-run", "--procs-per-node", "2", "--", "x", env=env),
                       f"GLOO_SOCKET_IFNAME={value}: interface {bare[0]}", "has no address")


def test_an_interface_without_a_route_to_the_master_is_one_line():
    master = "10.255.255.1"  # not this node's, reached by its default route if it has one
    if subprocess.run(["ip", "route", "get", master], capture_output=True).returncode != 0:
        pytest.skip("this node has no route to 10.255.255.1 at all")
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
    r = launch("--dry-run", "--no-ssh", "--nodes", "2", "--procs-per-node", "1", "--node-rank",
               "1", "--master-addr", master, "--", "x", env=env)
    one_error_line(r, "GLOO_SOCKET_IFNAME=lo: interface lo", f"no route to the master {master}")


def test_a_rank_takes_gloos_interface_from_nccls():
    from app.runtime.dist import default_gloo_interface

    env = {"NCCL_SOCKET_IFNAME": "nosuch,l"}  # prefixes, the first that matches an interface
    note = default_gloo_interface(env)
    assert note == "GLOO_SOCKET_IFNAME=lo (from NCCL_SOCKET_IFNAME=nosuch,l)"
    assert env["GLOO_SOCKET_IFNAME"] == "lo"
    for env in ({"NCCL_SOCKET_IFNAME": "=l"}, {"NCCL_SOCKET_IFNAME": "^docker"},
                {"NCCL_SOCKET_IFNAME": "lo", "GLOO_SOCKET_IFNAME": "eth7"}, {}):
        before = dict(env)
        assert default_gloo_interface(env) is None and env == before


def test_a_rank_raises_its_open_file_limit_to_the_hard_one():
    script = ("import resource; from app.runtime.dist import raise_open_file_limit as r; "
              "hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]; "
              "resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard)); print(r()); print(r()); "
              "print(resource.getrlimit(resource.RLIMIT_NOFILE)[0] > 64)")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=60, env=os.environ)
    assert r.returncode == 0, r.stderr
    first, second, raised = r.stdout.splitlines()
    assert first.startswith("raised the open-file limit from 64 to ") and second == "None"
    assert raised == "True"
