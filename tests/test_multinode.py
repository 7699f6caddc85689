"""Two nodes on one machine with the real launcher: launch.sh --no-ssh twice (one launcher per
node, as under srun), and launch.sh through pdsh over real ssh to loopback addresses 127.0.0.2 and
127.0.0.3, served by an sshd this module starts (throwaway keys, its own configs) and stops.

What the ranks saw comes from a test-only `sitecustomize.py` on PYTHONPATH: every rank writes its
environment and each call into data_tools.stage to HOOK_DIR. Every launch carries a marker in its
environment (forwarded with --env where ssh starts the processes), so the test finds any process
it left behind by pid."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.helpers import REPO, TINY, check, clean_env, free_port, launch, train_losses

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

LAUNCH = REPO / "launch.sh"
SSHD = Path("/usr/sbin/sshd")
NODES = ("127.0.0.2", "127.0.0.3")
# global batch 8 = micro 4 x 2 ranks whether they share a node or not; dropout 0 so they compare
ARGS = [*TINY, "--model", "bert-tiny", "--max-steps", "3", "--log-every", "1", "--dropout", "0"]
MARK = "LAUNCH_TEST_MARK"

HOOK = '''\
"""Test hook of tests/test_multinode.py (imported by every python process it launches)."""
import json, os, sys, time

_dir, _rank = os.environ.get("HOOK_DIR"), "RANK" in os.environ
if _rank and os.environ.get("HOOK_FAIL_NODE") == os.environ.get("CROSS_RANK"):
    os._exit(7)  # this node's rank dies at start, before the process group
if _dir and _rank:
    with open(os.path.join(_dir, f"env-{os.getpid()}.json"), "w") as f:
        json.dump(dict(os.environ), f)
    import importlib.abc, importlib.util

    class _StageSpy(importlib.abc.MetaPathFinder):
        """Record every call of data_tools.stage.stage (what --stage-to runs)."""
        def find_spec(self, name, path, target=None):
            if name != "data_tools.stage":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            load = spec.loader.exec_module

            def exec_module(module):
                load(module)
                real = module.stage

                def stage(src, dst, *args, **kwargs):
                    with open(os.path.join(_dir, f"stage-{time.time_ns()}.json"), "w") as f:
                        json.dump({"rank": os.environ["RANK"], "node": os.environ["CROSS_RANK"],
                                   "dst": str(dst)}, f)
                    return real(src, dst, *args, **kwargs)
                module.stage = stage
            spec.loader.exec_module = exec_module
            return spec
    sys.meta_path.insert(0, _StageSpy())
_fake = os.environ.get("HOOK_FAKE_TORCH_ON")
if _fake and os.environ.get("SSH_CONNECTION", "").split()[2:3] == [_fake]:
    import importlib.metadata as _md  # this host pretends to have another torch
    _version = _md.version
    _md.version = lambda name: "0.0.1+other" if name == "torch" else _version(name)
'''


# ------------------------------------------------------------------------------- helpers

def marked(marker: str) -> list[int]:
    """Pids of the live processes whose environment carries MARK=marker."""
    needle = f"{MARK}={marker}".encode()
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                env = (d / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if needle in env:
                pids.append(int(d.name))
    return pids


def assert_no_strays(marker: str, timeout: float = 20.0) -> None:
    deadline = time.time() + timeout
    while (pids := marked(marker)) and time.time() < deadline:
        time.sleep(0.2)
    if pids:
        cmds = []
        for pid in pids:
            try:
                cmds.append(f"{pid}: {Path(f'/proc/{pid}/cmdline').read_bytes()[:120]!r}")
            except OSError:
                pass
            try:
                os.kill(pid, signal.SIGKILL)  # only this test's processes, by pid
            except OSError:
                pass
        pytest.fail("processes left behind: " + "; ".join(cmds))


def run_launch(args: list, env: dict, timeout: int = 600) -> subprocess.CompletedProcess:
    marker = env[MARK]
    try:
        return subprocess.run(["bash", str(LAUNCH), *map(str, args)], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=timeout)
    finally:
        assert_no_strays(marker)


def hook_dir(tmp_path: Path) -> Path:
    d = tmp_path / "hook"
    d.mkdir()
    (d / "sitecustomize.py").write_text(HOOK)
    (d / "out").mkdir()
    return d


def launch_env(hook: Path, **extra: str) -> dict[str, str]:
    return clean_env(PYTHONPATH=f"{hook}{os.pathsep}{REPO}", HOOK_DIR=str(hook / "out"),
                     **{MARK: uuid.uuid4().hex}, **extra)


def rank_envs(hook: Path) -> dict[int, dict]:
    """What each rank saw, by node rank."""
    envs = [json.loads(p.read_text()) for p in (hook / "out").glob("env-*.json")]
    return {int(e["CROSS_RANK"]): e for e in envs}


def stage_calls(hook: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((hook / "out").glob("stage-*.json"))]


def world_size(run: Path) -> int:
    return json.loads((run / "config.json").read_text())["environment"]["world_size"]


def assert_same_losses(got: dict, ref: dict) -> None:
    assert sorted(got) == [1, 2, 3] and sorted(ref) == [1, 2, 3]
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-5), step


# ----------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def one_node(mlm_dataset, tmp_path_factory) -> dict[int, float]:
    """The reference: one node, two ranks, the same global batch (forked from the warm process
    with the launcher's environment: the launchers under test are the multi-node ones)."""
    tmp = tmp_path_factory.mktemp("one_node")
    check(launch("train", "--data", mlm_dataset, "--out", tmp / "run", *ARGS, procs=2))
    assert world_size(tmp / "run") == 2
    return train_losses(tmp / "run")


class Sshd:
    """An sshd on NODES:port for this user, with throwaway keys and its own client config."""

    def __init__(self, root: Path):
        self.root = root
        self.port = self._free_port()
        self.marker = uuid.uuid4().hex
        root.mkdir(parents=True, exist_ok=True)
        for key in ("host_key", "client_key"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", root / key],
                           check=True, capture_output=True)
        shutil.copyfile(root / "client_key.pub", root / "authorized_keys")
        (root / "authorized_keys").chmod(0o600)
        (root / "sshd_config").write_text("\n".join([
            f"Port {self.port}", *(f"ListenAddress {a}" for a in NODES),
            f"HostKey {root / 'host_key'}", f"AuthorizedKeysFile {root / 'authorized_keys'}",
            f"PidFile {root / 'sshd.pid'}", "PasswordAuthentication no",
            "KbdInteractiveAuthentication no", "PubkeyAuthentication yes",
            "PermitRootLogin prohibit-password", "StrictModes no", "UsePAM no", "LogLevel ERROR",
        ]) + "\n")
        self.client_config = root / "ssh_config"
        self.client_config.write_text("\n".join([
            "Host *", f"  Port {self.port}", f"  IdentityFile {root / 'client_key'}",
            "  IdentitiesOnly yes", "  StrictHostKeyChecking no",
            "  UserKnownHostsFile /dev/null", "  LogLevel ERROR",
        ]) + "\n")
        # pdsh's ssh module runs `ssh`: these options reach every connection it opens
        self.env = {"PDSH_SSH_ARGS_APPEND": f"-F {self.client_config}"}
        self.proc = None

    @staticmethod
    def _free_port() -> int:
        with socket.socket() as s:
            s.bind((NODES[0], 0))
            return s.getsockname()[1]

    def start(self) -> None:
        if not SSHD.exists():
            pytest.fail(f"{SSHD} is missing: apt-get install openssh-server (.ci/run does)")
        if os.geteuid() == 0:
            os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation directory
        self.log = open(self.root / "sshd.log", "w")
        self.proc = subprocess.Popen([SSHD, "-D", "-e", "-f", self.root / "sshd_config"],
                                     stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, MARK: self.marker})
        deadline = time.time() + 15
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"sshd exited with {self.proc.returncode}: "
                            f"{(self.root / 'sshd.log').read_text()[-2000:]}")
            try:
                for addr in NODES:
                    socket.create_connection((addr, self.port), timeout=1).close()
                break
            except OSError as e:
                if time.time() > deadline:
                    self.stop()
                    pytest.fail(f"sshd did not listen on {NODES}:{self.port}: {e}; "
                                f"{(self.root / 'sshd.log').read_text()[-2000:]}")
                time.sleep(0.1)
        r = subprocess.run(["ssh", "-F", self.client_config, NODES[1], "echo", "ok"],
                           capture_output=True, text=True, timeout=30)
        if r.stdout.strip() != "ok":
            self.stop()
            pytest.fail(f"ssh to the test sshd failed: {r.stderr.strip()}; "
                        f"{(self.root / 'sshd.log').read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
        self.log.close()
        assert_no_strays(self.marker)  # the listener and every session it forked


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    server = Sshd(tmp_path_factory.mktemp("sshd"))
    server.start()
    yield server
    server.stop()
    assert server.proc.poll() is not None


# -------------------------------------------------------------------------------- tests

def test_no_ssh_two_launchers_are_one_world_with_one_node_losses(mlm_dataset, one_node,
                                                                 tmp_path):
    """One launcher per node (as srun starts them): 2 nodes x 1 rank == 1 node x 2 ranks."""
    hosts = tmp_path / "hosts"
    hosts.write_text("node-a slots=1\nnode-b slots=1\n")
    hook = hook_dir(tmp_path)
    env = launch_env(hook)
    port = free_port()
    procs = []
    for k in (0, 1):
        logs = ["--log-dir", tmp_path / "logs"] if k == 1 else []
        args = ["--hostfile", hosts, "--no-ssh", "--node-rank", k, "--master-addr", "127.0.0.1",
                "--master-port", port, *logs, "--", "--data", mlm_dataset,
                "--out", tmp_path / "run", *ARGS]
        procs.append(subprocess.Popen(["bash", LAUNCH, *map(str, args)], cwd=REPO, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        outs = [p.communicate(timeout=600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        assert_no_strays(env[MARK])
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    assert world_size(tmp_path / "run") == 2
    assert_same_losses(train_losses(tmp_path / "run"), one_node)
    assert sorted(rank_envs(hook)) == [0, 1]
    # node 0's lines are tagged; node 1's rank wrote its own file instead
    assert "[node0 rank0] done: 3 steps" in outs[0][1]
    assert "[node1 rank1]" not in outs[1][0] + outs[1][1]
    (log,) = (tmp_path / "logs").glob("*rank1.log")
    assert "Setting accelerator to CPU" in log.read_text()


def test_pdsh_over_ssh_forwards_the_environment_and_stages_once_per_node(
        sshd, mlm_dataset, one_node, tmp_path):
    hook = hook_dir(tmp_path)
    home = tmp_path / "home"  # the user's own ~/.deepspeed_env: read, never overwritten
    home.mkdir()
    (home / ".deepspeed_env").write_text("DSP_TEST_FROM_USER_FILE=yes\n")
    key = "0123456789abcdef0123456789abcdef01234567"
    env = launch_env(hook, **sshd.env, HOME=str(home), WANDB_API_KEY=key,
                     WANDB_DSP_TEST="wandb-seen", HF_DSP_TEST="hf-seen", NOT_FORWARDED="x")
    hosts = tmp_path / "hosts"
    hosts.write_text("".join(f"{h} slots=1\n" for h in NODES))
    stage = tmp_path / "stage"
    r = run_launch(["--hostfile", hosts, "--master-port", free_port(), "--env", "HOOK_DIR",
                    "--env", MARK, "--stage-to", f"{stage}/node{{node_rank}}", "--",
                    "--data", mlm_dataset, "--out", tmp_path / "run", *ARGS], env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert world_size(tmp_path / "run") == 2
    assert_same_losses(train_losses(tmp_path / "run"), one_node)

    envs = rank_envs(hook)
    assert sorted(envs) == [0, 1]
    node1 = envs[1]
    assert node1["SSH_CONNECTION"].split()[2] == NODES[1]  # really started over ssh on .3
    assert node1["WANDB_DSP_TEST"] == "wandb-seen" and node1["HF_DSP_TEST"] == "hf-seen"
    assert node1["WANDB_API_KEY"] == key and node1["DSP_TEST_FROM_USER_FILE"] == "yes"
    assert node1["OMP_NUM_THREADS"] == env["OMP_NUM_THREADS"]
    assert node1["TOKENIZERS_PARALLELISM"] == "false" and node1["PATH"] == env["PATH"]
    assert "NOT_FORWARDED" not in node1  # a fresh ssh session: only what launch.sh forwards
    assert (home / ".deepspeed_env").read_text() == "DSP_TEST_FROM_USER_FILE=yes\n"
    assert key not in r.stdout + r.stderr  # forwarded, never printed
    assert "WANDB_API_KEY=***" in r.stdout  # DeepSpeed's own log of the pdsh command

    # each node staged its own copy, once, and its rank read that copy
    calls = stage_calls(hook)
    assert sorted((c["node"], c["dst"]) for c in calls) == [
        ("0", str(stage / "node0")), ("1", str(stage / "node1"))]
    for k in (0, 1):
        assert (stage / f"node{k}" / "dataset.json").read_bytes() == \
            (mlm_dataset / "dataset.json").read_bytes()
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["data"]["read_from"] == str(stage / "node0")
    assert f"{NODES[1]}: [node1 rank1] " in r.stdout + r.stderr


def test_a_rank_failing_on_one_node_stops_every_node(sshd, mlm_dataset, tmp_path):
    hook = hook_dir(tmp_path)
    env = launch_env(hook, **sshd.env, HOOK_FAIL_NODE="1")
    hosts = tmp_path / "hosts"
    hosts.write_text("".join(f"{h} slots=1\n" for h in NODES))
    started = time.time()
    r = run_launch(["--hostfile", hosts, "--master-port", free_port(), "--env", "HOOK_DIR",
                    "--env", "HOOK_FAIL_NODE", "--env", MARK, "--",
                    "--data", mlm_dataset, "--out", tmp_path / "run", *ARGS], env, timeout=300)
    # node 0's rank would wait for its peer in the rendezvous for 30 minutes
    assert time.time() - started < 240
    assert r.returncode == 7, r.stderr[-3000:]
    assert f"the launcher on {NODES[1]} exited with status 7" in r.stderr.splitlines()[-1]


def test_a_host_with_other_versions_is_refused_before_start(sshd, mlm_dataset, tmp_path):
    hook = hook_dir(tmp_path)
    env = launch_env(hook, **sshd.env, HOOK_FAKE_TORCH_ON=NODES[1])
    hosts = tmp_path / "hosts"
    hosts.write_text("".join(f"{h} slots=1\n" for h in NODES))
    r = run_launch(["--hostfile", hosts, "--env", "HOOK_FAKE_TORCH_ON", "--", "--data",
                    mlm_dataset, "--out", tmp_path / "run", *ARGS], env, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith(f"launch.sh: error: {NODES[1]} runs python ")
    assert "torch 0.0.1+other" in line and "install the same environment" in line
    assert not (tmp_path / "run").exists() and not list((hook / "out").iterdir())


def test_an_unreachable_host_is_refused_before_start(sshd, mlm_dataset, tmp_path):
    hook = hook_dir(tmp_path)
    env = launch_env(hook, **sshd.env)
    hosts = tmp_path / "hosts"
    hosts.write_text(f"{NODES[0]} slots=1\n127.0.0.9 slots=1\n")  # no sshd on .9
    r = run_launch(["--hostfile", hosts, "--", "--data", mlm_dataset, "--out", tmp_path / "run",
                    *ARGS], env, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("launch.sh: error: 127.0.0.9: not reachable by passwordless ssh")
    assert "ssh-copy-id 127.0.0.9" in line and "--no-ssh" in line
    assert not (tmp_path / "run").exists()


def test_term_to_launch_sh_stops_every_host_and_only_this_job(sshd, mlm_dataset, tmp_path):
    """A TERM to launch.sh in the loop: every host's ranks save one checkpoint and launch.sh
    exits 75, the ranks' own statuses brought back from their hosts (launch.py's is 1)."""
    hook = hook_dir(tmp_path)
    env = launch_env(hook, **sshd.env)
    hosts = tmp_path / "hosts"
    hosts.write_text("".join(f"{h} slots=1\n" for h in NODES))
    out = tmp_path / "run"
    args = ["--hostfile", hosts, "--master-port", free_port(), "--env", "HOOK_DIR", "--env", MARK,
            "--", "--data", mlm_dataset, "--out", out, *TINY, "--max-steps", "100000",
            "--log-every", "1", "--save-every", "100000"]
    # another job's process on the same host, started the way pdsh starts ours
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                             env={**env, "DSPRETRAIN_LAUNCH_ID": "another-job"})
    proc = subprocess.Popen(["bash", LAUNCH, *map(str, args)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while logged_steps(out) < 3 and proc.poll() is None and time.time() < deadline:
            time.sleep(0.5)  # both ranks in the loop, one over ssh on each host
        assert proc.poll() is None and len(rank_envs(hook)) == 2
        proc.send_signal(signal.SIGTERM)
        text, err = proc.communicate(timeout=180)
        assert other.poll() is None  # still running
    finally:
        for p in (proc, other):
            if p.poll() is None:
                p.kill()
                p.wait()
        assert_no_strays(env[MARK])
    assert proc.returncode == 75, err[-3000:]
    assert "launch.sh: stopping the job (terminated)" in err
    assert "the job failed" not in err  # the hosts' exits were the stop's doing
    assert "a stop signal at step" in text + err
    tag = (out / "checkpoints" / "latest").read_text().strip()
    assert int(tag.removeprefix("global_step")) >= 3 and (out / "checkpoints" / tag).is_dir()
    exits = {e["DSPRETRAIN_EXIT_DIR"] for e in rank_envs(hook).values()}
    assert len(exits) == 1 and not Path(exits.pop()).exists()  # collected, and removed


def logged_steps(out: Path) -> int:
    path = out / "metrics.jsonl"
    if not path.is_file():
        return 0
    return sum('"train/loss"' in line for line in path.read_text().splitlines())


def test_an_interface_missing_on_a_host_is_refused_before_start(sshd, mlm_dataset, tmp_path):
    hook = hook_dir(tmp_path)
    env = launch_env(hook, **sshd.env, GLOO_SOCKET_IFNAME="nosuch0")
    hosts = tmp_path / "hosts"
    hosts.write_text("".join(f"{h} slots=1\n" for h in NODES))
    r = run_launch(["--hostfile", hosts, "--", "--data", mlm_dataset, "--out", tmp_path / "run",
                    *ARGS], env, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith(f"launch.sh: error: {NODES[0]}: GLOO_SOCKET_IFNAME=nosuch0: no such")
    assert f"the master {NODES[0]}" in line
    assert not (tmp_path / "run").exists()
