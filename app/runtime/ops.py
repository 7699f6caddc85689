"""DeepSpeed's compiled ops, loaded before DeepSpeed asks for them, one process of a node at a
time, with a build lock a killed process left behind cleared (`load_op`).

The app's default optimizer needs none of them on CUDA (torch's fused AdamW) or CPU (torch's
AdamW): an op is loaded when a ds_config asks for DeepSpeed's Adam (or offloads it), and for the
CPU backend's shared-memory collectives. A JIT build happens once per node and installation, in
a directory of that node's own (`_own_extensions_dir`): ranks of other nodes never wait for it.
"""
from __future__ import annotations

import fcntl
import os
import platform
import sys
from pathlib import Path
from typing import Any

import torch

from app.runtime.device import accelerator
from data_tools.errors import UserError

# The optimizer ops a run cannot go without (the others, e.g. shared-memory collectives, only
# speed things up: DeepSpeed falls back when they cannot be built)
REQUIRED = {"FusedAdamBuilder": "'optimizer.params.torch_adam': false in the ds_config",
            "CPUAdamBuilder": "'offload_optimizer' in the ds_config"}


def optimizer_op(ds_config: dict[str, Any]) -> str | None:
    """The op builder DeepSpeed's Adam from the config loads (offloaded: CPU Adam; else fused)."""
    opt = ds_config.get("optimizer") or {}
    if str(opt.get("type", "")).lower() not in ("adam", "adamw"):
        return None
    if (opt.get("params") or {}).get("torch_adam"):
        return None
    offload = ((ds_config.get("zero_optimization") or {}).get("offload_optimizer") or {})
    return "CPUAdamBuilder" if offload.get("device") in ("cpu", "nvme") else "FusedAdamBuilder"


def load_op(builder_name: str) -> None:
    """Load one of DeepSpeed's ops before DeepSpeed asks for it, one process of a node at a time,
    clearing the build lock a killed process left behind.

    torch marks a JIT build with a bare `lock` file in the op's build directory and every other
    process waits while it exists; a process killed while holding it (SIGKILL, a preempted node,
    a CI timeout) leaves it, and every later start waits for ever. Ours take an flock beside it
    for the whole load, so a `lock` found while holding the flock was left by a dead process.
    DeepSpeed caches loaded ops, so its own load later is a dictionary lookup.
    """
    import deepspeed.ops

    _own_extensions_dir()
    builder = accelerator().create_op_builder(builder_name)
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        if builder_name in REQUIRED:  # DeepSpeed would fail later, with a traceback
            raise UserError(f"DeepSpeed's {builder_name[:-len('Builder')]} op cannot be built "
                            f"here (no CUDA toolkit: nvcc and CUDA_HOME?), and "
                            f"{REQUIRED[builder_name]} asks for it: drop that, or install "
                            f"DeepSpeed with the op prebuilt (DS_BUILD_"
                            f"{builder_name[:-len('Builder')].upper()}=1 pip install deepspeed)")
        return
    from deepspeed.git_version_info import installed_ops
    if installed_ops.get(builder.NAME, False):
        builder.load(verbose=False)  # prebuilt into the wheel: an import, no build lock
        return
    from torch.utils.cpp_extension import _get_build_directory

    build_dir = Path(_get_build_directory(builder.NAME, verbose=False))
    with open(build_dir.parent / f".{builder.NAME}.app-lock", "a+") as held:
        try:
            fcntl.flock(held, fcntl.LOCK_EX)
        except OSError:  # a filesystem without locks: leave torch's own lock alone
            builder.load(verbose=False)
            return
        stale = build_dir / "lock"
        if stale.exists():
            print(f"warning: removing {stale}, a build lock left by a process killed while "
                  f"building DeepSpeed's {builder.NAME} op", file=sys.stderr, flush=True)
            stale.unlink(missing_ok=True)
        builder.load(verbose=False)


def _own_extensions_dir() -> None:
    """Build DeepSpeed's JIT ops in a directory of this installation's and this node's own
    (unless the user set TORCH_EXTENSIONS_DIR): torch's default is shared by every environment
    with the same Python, so two virtualenvs with their own DeepSpeed rebuilt each other's ops on
    every start (a minute or more each). Per node, because the build lock (`load_op`) holds a
    process for its whole load: on a shared home, one directory for all nodes queued every rank
    of the job behind one lock (1-3 s each: tens of minutes at 1,000 ranks), while one a node
    queues only the node's ranks, and a lock left there is one of this node's processes'."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return
    import hashlib

    import deepspeed
    from torch.utils.cpp_extension import get_default_build_root

    install = f"{deepspeed.__file__}|{deepspeed.__version__}|{torch.__version__}"
    tag = hashlib.sha256(install.encode()).hexdigest()[:10]
    version = f"py{sys.version_info.major}{sys.version_info.minor}"
    os.environ["TORCH_EXTENSIONS_DIR"] = str(Path(get_default_build_root()) / f"{version}-{tag}"
                                             / (platform.node() or "host"))
