"""Running the real app in tests: `python -m app ...` subprocesses and the `deepspeed` launcher."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from app.faults import injection
from app.runtime.dist import free_port

REPO = Path(__file__).resolve().parent.parent

# Small enough for a few seconds a run on CPU, big enough to learn something.
TINY = ["--seq-len", "64", "--micro-batch", "4",
        "--eval-samples", "16", "--wandb", "disabled", "--num-workers", "0"]


def clean_env(**extra: str) -> dict[str, str]:
    """The test process's environment minus any process-group variables, plus `extra`."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                        "MASTER_PORT", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE")}
    env.update({"WANDB_MODE": "disabled", "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": "",
                "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
    env.update(extra)
    return env


def two_gloo_ranks(script: str, timeout: int = 120) -> None:
    """`script` run by two real processes, `argv` = (master port, rank), which init a gloo
    group themselves; each must exit 0 having printed "ok"."""
    port = str(free_port())
    env = clean_env()
    client = zygote(env)
    if client is not None:  # two forks of the warm process
        reply = client.run([["-c", script, port, str(rank)] for rank in (0, 1)], env,
                           str(REPO), timeout=timeout)
        assert not reply["timed_out"], reply["stderr"]
        for code, out, err in zip(reply["returncodes"], reply["stdout"], reply["stderr"]):
            assert code == 0 and "ok" in out, err[-2000:]
        return
    procs = [subprocess.Popen([sys.executable, "-c", script, port, str(rank)], cwd=REPO,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for rank in (0, 1)]
    for proc in procs:
        out, err = proc.communicate(timeout=timeout)
        assert proc.returncode == 0 and "ok" in out, err[-2000:]


_ZYGOTE: list = []  # this pytest worker's warm process (tests/zygote.py), made on first use


def zygote(env: dict[str, str]):
    """The warm process that forks this worker's app runs, or None where a run with `env` must be
    a real process: TEST_ZYGOTE=0, or an environment that changes what modules read when
    imported (a sitecustomize on PYTHONPATH, ...: tests/zygote.py IMPORT_TIME_ENV)."""
    if os.environ.get("TEST_ZYGOTE", "1") == "0":
        return None
    if not _ZYGOTE:
        from tests.zygote import Client
        _ZYGOTE.append(Client(clean_env()))
    client = _ZYGOTE[0]
    return client if client.serves(env) else None


def python(*argv, env: dict[str, str] | None = None, timeout: float = 600,
           real: bool = False) -> subprocess.CompletedProcess:
    """`python ARGV` (`-c CODE ...`, `-m MODULE ...`, `SCRIPT ...`) in a process of its own,
    cwd the repository: a fork of this worker's warm process (tests/zygote.py) where it can be,
    else (`real`, or an environment a fork cannot take) a fresh interpreter."""
    env = env or clean_env()
    argv = [str(a) for a in argv]
    client = None if real else zygote(env)
    if client is None:
        return subprocess.run([sys.executable, *argv], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=timeout)
    reply = client.run([argv], env, str(REPO), timeout=timeout)
    return _completed([sys.executable, *argv], reply, timeout)


def _completed(cmd: list[str], reply: dict, timeout: float) -> subprocess.CompletedProcess:
    """The zygote's reply as subprocess.run's (the processes' outputs one after the other);
    `master_port`: the job's rendezvous port (0: not a launcher job)."""
    out, err = "".join(reply["stdout"]), "".join(reply["stderr"])
    if reply["timed_out"]:
        raise subprocess.TimeoutExpired(cmd, timeout, out, err)
    done = subprocess.CompletedProcess(cmd, reply["returncode"], out, err)
    done.master_port = reply.get("master_port", 0)  # type: ignore[attr-defined]
    return done


def _forked(module: str, args: tuple, env: dict[str, str], ranks: int,
            timeout: float) -> subprocess.CompletedProcess | None:
    """`python -m MODULE ARGS` on `ranks` ranks forked from the warm process with the
    launcher's environment, as a CompletedProcess (the launcher's status); None when it must be
    a real process."""
    return _forked_argv(["-m", module, *map(str, args)], env, ranks, timeout, str(REPO))


def _forked_argv(argv: list[str], env: dict[str, str], ranks: int, timeout: float,
                 cwd: str) -> subprocess.CompletedProcess | None:
    """`python ARGV` on `ranks` ranks forked from the warm process (more than one: with the
    launcher's environment); None when it must be a real process."""
    client = zygote(env)
    if client is None:
        return None
    reply = client.run([argv] * ranks, env, cwd, launcher=ranks > 1, timeout=timeout)
    return _completed([sys.executable, *argv], reply, timeout)


def run_app(*args: str, timeout: int = 600, env: dict[str, str] | None = None,
            real: bool = False) -> subprocess.CompletedProcess:
    """`python -m app ARGS` in a process of its own (a world of one): a fork of this worker's
    warm process (tests/zygote.py), or with `real` (or an environment a fork cannot take) a
    fresh interpreter."""
    env = env or clean_env()
    forked = None if real else _forked("app", args, env, 1, timeout)
    if forked is not None:
        return forked
    return subprocess.run([sys.executable, "-m", "app", *map(str, args)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=timeout)


def default_sigint() -> None:
    """`preexec_fn` for a child a test interrupts with SIGINT: a suite started as a background job
    (`pytest &`, `nohup`) runs with SIGINT ignored, which the child would inherit and so never see
    the Ctrl-C (Python installs its KeyboardInterrupt handler only over the default)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def launch(*args: str, procs: int = 2, timeout: int = 900,
           env: dict[str, str] | None = None, real: bool = False) -> subprocess.CompletedProcess:
    """`python -m app ARGS` on N ranks (CPU accelerator, gloo): forked from this worker's warm
    process with the environment DeepSpeed's launcher gives its ranks (tests/zygote.py), or with
    `real` (or an environment a fork cannot take) through the real launcher, `deepspeed
    --num_gpus N --module app ARGS`."""
    env = env or clean_env()
    forked = None if real else _forked("app", args, env, procs, timeout)
    if forked is not None:
        return forked
    launcher = shutil.which("deepspeed") or str(Path(sys.executable).parent / "deepspeed")
    cmd = [launcher, "--num_gpus", str(procs), "--no_local_rank", "--master_port",
           str(free_port()), "--module", "app", *map(str, args)]
    return subprocess.run(cmd, cwd=REPO, env=env or clean_env(), capture_output=True, text=True,
                          timeout=timeout)


def check(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stderr[-4000:]}"
    return proc


def metrics(run_dir: Path) -> list[dict]:
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def train_losses(run_dir: Path) -> dict[int, float]:
    return {m["step"]: m["train/loss"] for m in metrics(run_dir) if "train/loss" in m}


def error_lines(stderr: str) -> list[str]:
    """stderr lines that are not DeepSpeed's or the launcher's own log lines."""
    return [line for line in stderr.splitlines()
            if line.strip() and not line.startswith("[20") and "Warning" not in line
            and "warnings.warn" not in line]


# Run a command as root without its capabilities: file permissions then apply as to any user.
NO_CAPS = ["setpriv", "--inh-caps=-all", "--bounding-set=-all"]


@contextlib.contextmanager
def tmpfs(path: Path, size: str, ro: bool = False):
    """A real small filesystem (the tests run as root); fails with the reason where mount is
    denied, rather than skipping what it was meant to show."""
    path.mkdir(parents=True, exist_ok=True)
    opts = f"size={size}" + (",ro" if ro else "")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.fail(f"cannot mount a tmpfs (the disk-full tests need root): {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def snapshot(root: Path) -> dict[str, str]:
    """Every file under `root` and a hash of its bytes: compare before and after a command."""
    return {str(p.relative_to(root)): hashlib.sha1(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def remanifest(tag: Path) -> None:
    """Rewrite a one-rank checkpoint tag's manifest.json after a test damaged one of its files on
    purpose: the damage as if made before the save hashed the files (a bug at save time), so what
    the test checks is the check behind the manifest, not the manifest."""
    from app.checkpoint import manifest
    manifest.write(tag, manifest.own_entries(tag, 0))


def script_ranks(script: Path, cwd: str, procs: int = 2, timeout: int = 300,
                 args: list | None = None) -> subprocess.CompletedProcess:
    """`python SCRIPT ARGS` on `procs` ranks forked from this worker's warm process with the
    environment DeepSpeed's launcher gives them (tests/zygote.py), or through the real launcher
    (`deepspeed_script`) where a fork cannot take the environment; asserts it succeeded."""
    proc = _forked_argv([str(script), *map(str, args or [])], clean_env(), procs, timeout, cwd)
    if proc is None:
        return deepspeed_script(script, cwd, procs, timeout, args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def deepspeed_script(script: Path, cwd: str, procs: int = 2, timeout: int = 300,
                     args: list | None = None) -> subprocess.CompletedProcess:
    """`script ARGS` on `procs` ranks started by the real deepspeed launcher; asserts it
    succeeded."""
    launcher = shutil.which("deepspeed") or str(Path(sys.executable).parent / "deepspeed")
    proc = subprocess.run([launcher, "--num_gpus", str(procs), "--no_local_rank", "--master_port",
                           str(free_port()), str(script), *map(str, args or [])], cwd=cwd,
                          env=clean_env(),
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


flip = injection.flip  # the tests damage a checkpoint file as the fault injection does
