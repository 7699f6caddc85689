"""A warm process that forks the tests' app runs: torch, DeepSpeed, transformers and the app are
imported once per pytest worker, and every `python -m app ...` a test starts (tests/helpers.py
`run_app`, and `launch`'s ranks) is a fork of it with the run's environment, working directory,
arguments and output files, exiting with the status the command would.

Where a test starts a run through the launcher only to get N ranks (not to test the launcher),
the zygote forks N ranks with the environment DeepSpeed's launcher gives them (RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_SIZE, CROSS_RANK, CROSS_SIZE, MASTER_ADDR, MASTER_PORT) and treats a failing
rank as the launcher does: the others get SIGTERM, then SIGKILL 30 s later, and the job's status
is the first non-zero one. A fork costs milliseconds where a fresh `python -m app` paid ~7 s of
imports and a launcher chain ~15 s (docs: tests/README.md, "The warm process").

Each run is its own process (its own state, signals, exit, crash); only the imported modules are
shared, copied on write. What a fork cannot reproduce goes to a real process (helpers.py decides):
a run whose PYTHONPATH differs (a sitecustomize probe), or whose environment changes what a
module reads when imported (`IMPORT_TIME_ENV`); tests of the launcher, signals, ssh and the
simulated cluster start their processes themselves.

    python tests/zygote.py SOCKET        # serves until a {"quit": true} request or SIGKILL
"""
from __future__ import annotations

import atexit
import gc
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# environment a module reads when imported: a run that sets one runs in a real process
IMPORT_TIME_ENV = ("PYTHONPATH", "DSPRETRAIN_ZERO2_PENDING", "HF_HUB_OFFLINE",
                   "TRANSFORMERS_OFFLINE", "HF_HOME", "PYTORCH_CUDA_ALLOC_CONF", "LD_PRELOAD")
GRACE_S = 30.0  # DeepSpeed's launcher: SIGTERM to the other ranks, SIGKILL after 30 s


def launcher_env(rank: int, ranks: int, port: int) -> dict[str, str]:
    """What DeepSpeed's launch.py gives rank `rank` of `ranks` on one node (env:// rendezvous)."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(ranks),
            "LOCAL_SIZE": str(ranks), "CROSS_RANK": "0", "CROSS_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def preload() -> None:
    """What every `python -m app` run imports (the heavy part of its start). Muon's module:
    DeepSpeed's optimizer check imports it in every ZeRO engine's build (torch.compile,
    functorch, networkx: ~560 modules, ~2 s a fork otherwise)."""
    import deepspeed  # noqa: F401
    import deepspeed.runtime.bf16_optimizer  # noqa: F401
    import deepspeed.runtime.engine  # noqa: F401
    import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401
    import deepspeed.runtime.zero.stage3  # noqa: F401
    import deepspeed.runtime.zero.stage_1_and_2  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401
    from deepspeed.accelerator import get_accelerator
    from transformers import BertForMaskedLM, GPT2LMHeadModel, RobertaForMaskedLM  # noqa: F401

    import app.__main__  # noqa: F401
    import app.build  # noqa: F401
    import app.checkpoint.convert  # noqa: F401
    import app.export  # noqa: F401
    import app.plan.command  # noqa: F401
    import app.telemetry.report  # noqa: F401
    import app.train  # noqa: F401  (installs the stop handlers: undone below)
    import data_tools.__main__  # noqa: F401
    import data_tools.prepare  # noqa: F401
    from app.faults import preemption

    get_accelerator()
    preemption.release()  # the zygote's own signals stay the default ones
    _load_built_ops()
    # The imported modules' objects (~400k) out of the collector's way: a fork's collections
    # (DeepSpeed's own gc.collect() calls among them) neither walk them nor copy their pages
    gc.collect()
    gc.freeze()


# DeepSpeed's ops the CPU runs load: the shared-memory collectives (every multi-rank run:
# app.runtime.dist) and fused Adam (the runs in bf16)
CPU_OPS = ("ShareMemCommBuilder", "FusedAdamBuilder")


def build_cpu_ops() -> None:
    """Build CPU_OPS where the runs are on CPU: tests/run.sh calls it with the install, once per
    environment. Each is JIT-built once per installation (app/runtime/ops.py), ~1-2 min of a core;
    not built, the first run that needs one built it while the others waited on its lock, and
    every fork loaded it itself (below): in a fresh virtualenv, inside the timed suite."""
    from app.runtime import ops
    from app.runtime.device import accelerator

    if accelerator().device_name() == "cpu":
        for name in CPU_OPS:
            ops.load_op(name)


def _load_built_ops() -> None:
    """CPU_OPS, where they are built already. Loading one checks its build and asks cpuinfo
    twice in subprocesses, ~2 s a process; DeepSpeed keeps a loaded op for the process
    (OpBuilder._loaded_ops), so every fork finds them loaded. One not built yet (a machine whose
    set-up did not build them: build_cpu_ops): the first run that needs it builds it, and every
    fork loads it again."""
    from torch.utils.cpp_extension import _get_build_directory

    from app.runtime import ops
    from app.runtime.device import accelerator

    ops._own_extensions_dir()
    for name in CPU_OPS:
        builder = accelerator().create_op_builder(name)
        if builder is None:
            continue
        built = Path(_get_build_directory(builder.NAME, verbose=False)) / f"{builder.NAME}.so"
        if built.is_file():
            ops.load_op(name)


def _child(req: dict, rank: int, ranks: int, port: int, out: str, err: str) -> None:
    """In the forked child: become `python ARGV` (this rank's), never return."""
    code = 1
    try:
        os.setpgrp()  # its own group: a timeout or a failing peer kills its workers too
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY),
                                (1, out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                                (2, err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
            new = os.open(path, flags, 0o644)
            os.dup2(new, fd)
            os.close(new)
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGPIPE):
            signal.signal(s, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(req["env"])
        if req.get("launcher"):
            os.environ.update(launcher_env(rank, ranks, port))
        os.chdir(req["cwd"])
        _python(req["argvs"][rank])
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except BaseException:  # a traceback, as `python` prints it
        traceback.print_exc()
        code = 1
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(int(code or 0) & 0xFF)


def _python(argv: list[str]) -> None:
    """What `python ARGV` runs: `-c CODE ARGS`, `-m MODULE ARGS` or `SCRIPT ARGS`, with sys.argv
    and sys.path[0] as the interpreter sets them."""
    import runpy

    if argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        sys.path[0] = ""
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
    elif argv[0] == "-m":
        import importlib.util
        spec = importlib.util.find_spec(argv[1])
        if spec is not None and spec.submodule_search_locations is not None:
            spec = importlib.util.find_spec(f"{argv[1]}.__main__")  # a package: its __main__
        sys.argv = [spec.origin if spec is not None else argv[1], *argv[2:]]
        sys.path[0] = os.getcwd()
        # run as `python -m` does: the module executes afresh as __main__ (preloaded by the
        # zygote, it would be found imported already, and runpy warns)
        sys.modules.pop(f"{argv[1]}.__main__", None)
        if argv[1:3] == ["app", "train"]:  # `import app.train` installs these first thing
            from app.faults import preemption
            preemption.catch()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill(pids: dict[int, int | None], sig: int) -> None:
    for pid, status in pids.items():
        if status is None:
            try:
                os.killpg(pid, sig)
            except ProcessLookupError:
                pass


def _reap(pids: dict[int, int | None]) -> None:
    for pid, status in pids.items():
        if status is None:
            done, raw = os.waitpid(pid, os.WNOHANG)
            if done:
                pids[pid] = os.waitstatus_to_exitcode(raw)


def run(req: dict) -> dict:
    """Fork one process for each argv of `argvs` (`launcher`: as ranks of one job, with the
    launcher's environment), wait as DeepSpeed's launcher does, collect their output."""
    ranks = len(req["argvs"])
    port = _free_port() if req.get("launcher") else 0
    work = tempfile.mkdtemp(prefix="zygote-")
    files = [(os.path.join(work, f"out{r}"), os.path.join(work, f"err{r}")) for r in range(ranks)]
    sys.stdout.flush()
    sys.stderr.flush()
    order = []
    for r, (out, err) in enumerate(files):
        pid = os.fork()
        if pid == 0:
            _child(req, r, ranks, port, out, err)
        order.append(pid)
    pids: dict[int, int | None] = dict.fromkeys(order)
    deadline = time.monotonic() + float(req.get("timeout", 600))
    failed_at, timed_out, first_bad = None, False, None
    while any(s is None for s in pids.values()):
        time.sleep(0.02)
        _reap(pids)
        if first_bad is None:
            first_bad = next((s for s in (pids[p] for p in order) if s not in (None, 0)), None)
            if first_bad is not None and ranks > 1 and req.get("launcher"):
                failed_at = time.monotonic()
                _kill(pids, signal.SIGTERM)  # the launcher's terminate_process_tree
        if failed_at is not None and time.monotonic() - failed_at > GRACE_S:
            _kill(pids, signal.SIGKILL)
        if time.monotonic() > deadline:
            timed_out = True
            _kill(pids, signal.SIGKILL)
            while any(s is None for s in pids.values()):
                time.sleep(0.02)
                _reap(pids)
    out = [Path(o).read_text(errors="replace") for o, _ in files]
    err = [Path(e).read_text(errors="replace") for _, e in files]
    for o, e in files:
        os.unlink(o)
        os.unlink(e)
    os.rmdir(work)
    codes = [pids[p] for p in order]
    return {"returncodes": codes, "stdout": out, "stderr": err, "timed_out": timed_out,
            "returncode": first_bad if first_bad is not None else 0, "master_port": port}


def serve(path: str) -> None:
    os.setsid()  # out of pytest's terminal group: a Ctrl-C there is not the zygote's
    preload()
    if threading.active_count() != 1:  # forking a process with threads copies locks held
        print(f"zygote: {threading.active_count()} threads after the imports; not serving",
              file=sys.stderr, flush=True)
        sys.exit(3)
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen(1)
    print("zygote: ready", flush=True)
    while True:
        conn, _ = server.accept()
        with conn, conn.makefile("rwb") as stream:
            req = json.loads(stream.readline())
            if req.get("quit"):
                return
            try:
                reply = run(req)
            except Exception:
                reply = {"error": traceback.format_exc()}
            stream.write(json.dumps(reply).encode() + b"\n")
            stream.flush()


class Client:
    """The tests' side: starts a zygote (its socket in a private directory) and sends it runs."""

    def __init__(self, env: dict[str, str]):
        import subprocess

        self.dir = tempfile.mkdtemp(prefix="zygote-sock-")
        self.path = os.path.join(self.dir, "sock")
        self.env = dict(env)
        self.log = open(os.path.join(self.dir, "log"), "w+")
        self.proc = subprocess.Popen([sys.executable, __file__, self.path], cwd=REPO, env=env,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True)
        seen = []
        for line in self.proc.stdout:  # the imports may print first (DeepSpeed's accelerator)
            if line.startswith("zygote: ready"):
                break
            seen.append(line)
        else:
            self.log.seek(0)
            raise RuntimeError(f"the zygote did not start: {''.join(seen)[-1000:]}"
                               f"{self.log.read()[-2000:]}")
        atexit.register(self.close)

    def serves(self, env: dict[str, str]) -> bool:
        """Whether a run with `env` can be a fork: what modules read at import is the same."""
        return self.proc.poll() is None and all(env.get(k) == self.env.get(k)
                                                for k in IMPORT_TIME_ENV)

    def run(self, argvs: list[list[str]], env: dict[str, str], cwd: str, launcher: bool = False,
            timeout: float = 600) -> dict:
        """`python ARGV` forked once for each argv in `argvs` (`launcher`: as the ranks of one
        job); the reply: returncode, returncodes, stdout and stderr (a list, one a process),
        timed_out."""
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(self.path)
            with s.makefile("rwb") as stream:
                stream.write(json.dumps({"argvs": argvs, "env": env, "cwd": cwd,
                                         "launcher": launcher,
                                         "timeout": timeout}).encode() + b"\n")
                stream.flush()
                reply = json.loads(stream.readline())
        if "error" in reply:
            raise RuntimeError(f"zygote: {reply['error']}")
        return reply

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                with socket.socket(socket.AF_UNIX) as s:
                    s.settimeout(5)
                    s.connect(self.path)
                    s.sendall(b'{"quit": true}\n')
                self.proc.wait(timeout=10)
            except (OSError, Exception):
                self.proc.kill()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)  # its socket and log: nothing left in /tmp


if __name__ == "__main__":
    serve(sys.argv[1])
