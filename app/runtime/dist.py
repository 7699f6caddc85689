"""The process group: this process's place in the job, joining and leaving it, and collectives.

The launcher's environment becomes a `World` (MPI and Slurm launchers' variables included);
`init_distributed` joins the group through DeepSpeed (a bare `python -m app train` is a world of
one); the collectives are the few small cross-rank reductions the loop and checkpoints need, each
a no-op in a world of one.
"""
from __future__ import annotations

import os
import resource
import socket
import sys
import time
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path

import torch

from app.runtime.device import Device, bind
from app.runtime.ops import load_op
from data_tools.errors import UserError


@dataclass(frozen=True)
class World:
    """This process's place in the job, from the launcher's environment (before any init)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


# What MPI and Slurm launchers (deepspeed --launcher openmpi|mpich|slurm, srun, mpirun) set
# instead of torch's RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE, in order of preference.
_LAUNCHER_VARS = {
    "RANK": ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"),
    "WORLD_SIZE": ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"),
    "LOCAL_RANK": ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"),
    "LOCAL_WORLD_SIZE": ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS",
                         "SLURM_NTASKS_PER_NODE"),
}


def adopt_launcher_env(env: MutableMapping[str, str] | None = None) -> None:
    """Fill torch's rank variables from an MPI or Slurm launcher's when they are missing, so
    those processes join one job instead of each becoming a world of one."""
    env = os.environ if env is None else env
    if "RANK" in env:
        return
    for name, sources in _LAUNCHER_VARS.items():
        value = next((env[s] for s in sources if env.get(s)), None)
        if value is not None:
            env[name] = value.split("(")[0]  # SLURM_NTASKS_PER_NODE may read "4(x2)"


def world_from_env(env: Mapping[str, str] | None = None) -> World:
    env = os.environ if env is None else env
    world_size = int(env.get("WORLD_SIZE", 1))
    # a missing local size means one rank per node is all we know: never the whole world
    return World(rank=int(env.get("RANK", 0)), world_size=world_size,
                 local_rank=int(env.get("LOCAL_RANK", 0)),
                 local_world_size=int(env.get("LOCAL_WORLD_SIZE") or env.get("LOCAL_SIZE") or 1))


def free_port() -> int:
    """A TCP port free right now on this host: a rendezvous port for a job started from here."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def raise_open_file_limit() -> str | None:
    """Raise this process's soft open-file limit to its hard one; a line saying so, if it was.

    Every socket is a file descriptor: gloo's group on CPU holds one per other rank, NCCL a few
    per ring and tree neighbour, and the loader, the logs and the accelerator hold their own. A
    soft limit of 1,024 (still a common default, below the hard one) then ends a large job in
    EMFILE, so a rank takes what the administrator allows."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else _kernel_open_file_max()
    if target is None or (soft != resource.RLIM_INFINITY and soft >= target):
        return None
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
        return None  # a container may refuse it: the soft limit stands
    return f"raised the open-file limit from {soft} to {target} (the hard limit)"


def _kernel_open_file_max() -> int | None:
    """The most descriptors a process can have (fs.nr_open): the cap of an unlimited hard limit."""
    try:
        return int(Path("/proc/sys/fs/nr_open").read_text())
    except (OSError, ValueError):
        return None


def default_gloo_interface(env: MutableMapping[str, str] | None = None) -> str | None:
    """GLOO_SOCKET_IFNAME from NCCL_SOCKET_IFNAME when only the latter is set; a line saying so.

    A cluster that needs NCCL_SOCKET_IFNAME (hostnames resolving to the wrong network) needs the
    same for gloo, which otherwise takes the hostname's address, or loopback. NCCL's value may be
    prefixes ("eth" is eth0, eth1, ...) or exact names ("=eth0"), gloo's must be a name: the first
    interface of this node that NCCL's value selects. An exclusion list ("^docker") says nothing
    about which one to use and is left alone."""
    env = os.environ if env is None else env
    nccl = env.get("NCCL_SOCKET_IFNAME", "")
    if env.get("GLOO_SOCKET_IFNAME") or not nccl or nccl.startswith("^"):
        return None
    exact = nccl.startswith("=")
    wanted = [w for w in nccl.lstrip("=").split(",") if w]
    here = [name for _, name in socket.if_nameindex()]
    chosen = next((name for w in wanted for name in here
                   if name == w or (not exact and name.startswith(w))), None)
    if chosen is None:
        return None  # launch.sh's pre-flight names the interface that is not here
    env["GLOO_SOCKET_IFNAME"] = chosen
    return f"GLOO_SOCKET_IFNAME={chosen} (from NCCL_SOCKET_IFNAME={nccl})"


def init_distributed(device: Device, timeout_minutes: float = 30.0) -> World:
    """Join the process group; a bare `python -m app train` becomes a world of one. A collective
    that waits longer than `timeout_minutes` for a rank fails the job (DeepSpeed's default: 10)."""
    from datetime import timedelta

    import deepspeed

    if "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:
        os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                           "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": os.environ.get("MASTER_PORT") or str(free_port())})
    bind(device, int(os.environ.get("LOCAL_RANK", 0)))
    for note in (raise_open_file_limit(), default_gloo_interface()):
        if note and os.environ.get("RANK") == "0":
            print(note, file=sys.stderr)
    load_op("ShareMemCommBuilder")
    try:
        deepspeed.init_distributed(dist_backend=device.backend, auto_mpi_discovery=False,
                                   timeout=timedelta(minutes=timeout_minutes))
    except torch.distributed.DistNetworkError as e:
        if "EADDRINUSE" not in str(e):
            raise
        where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        raise UserError(f"the rendezvous port {where} is in use (another job on this host?): "
                        f"pass another one (launch.sh --master-port, deepspeed "
                        f"--master_port)") from None
    world = world_from_env()
    if device.is_cpu:  # the shm op is the CPU accelerator's
        unlink_shm_buffer(world)
    return world


def unlink_shm_buffer(world: World, shm: Path = Path("/dev/shm")) -> None:
    """Remove the name of this rank's shared-memory all-reduce buffer, once every rank has it.

    On the CPU accelerator with all ranks on one node, DeepSpeed's shm op gives each rank a
    /dev/shm file (~70 MB) that every other rank maps while the group starts, and never removes
    it: each run left 70 MB per rank of RAM behind, until the machine ran out. After a barrier all
    ranks hold their mappings, so the name can go now (the memory lives until the last unmap),
    and nothing is left even when a rank is killed later.
    """
    name = shm / (f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}"
                  f"_{os.environ.get('MASTER_PORT', '')}_{world.rank}")
    if world.world_size > 1 and world.local_world_size == world.world_size:
        torch.distributed.barrier()
    try:
        name.unlink()
    except FileNotFoundError:
        pass


# How long `shutdown` hands the GIL to gloo's worker threads before the interpreter exits.
EXIT_GRACE_S = 0.05


def shutdown() -> None:
    """Leave the process group (NCCL warns about, and may hang on, groups never destroyed).

    Gloo's worker thread frees a finished collective just after the caller's wait returns, and
    with it the last reference to the tensors of the collectives still pending when that one
    was queued (a barrier holds every earlier one): Python tensors, whose release needs the GIL.
    A thread that asks for the GIL while the interpreter finalizes is ended, and a C++ thread
    ended that way aborts the process ("terminate called without an active exception", exit
    134, after the run's last line): seen in 7 of 60 two-rank runs that exit right after a
    barrier. Releasing the GIL for a moment lets that thread finish first.
    """
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
        time.sleep(EXIT_GRACE_S)


def _several_ranks() -> bool:
    """Collectives are no-ops in a world of one (or before the group exists)."""
    return torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1


def gather_rows(values: list[float], device: torch.device) -> list[list[float]]:
    """Every rank's `values` (the same length on each), in rank order: one small all-gather."""
    row = torch.tensor(values, dtype=torch.float64, device=device)
    if not _several_ranks():
        return [row.tolist()]
    rows = [torch.empty_like(row) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(rows, row)
    return [r.tolist() for r in rows]


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum over ranks, in place."""
    if _several_ranks():
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.SUM)
    return tensor


def lost_peer(error: BaseException) -> bool:
    """Whether a collective failed because another rank went away (it died or was stopped)."""
    text = str(error)
    return isinstance(error, getattr(torch.distributed, "DistError", ())) or any(
        s in text for s in ("Connection closed by peer", "Connection reset by peer",
                            "NCCL communicator was aborted", "Broken pipe"))


def world_size() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank when `flag` is true on any (a collective: every rank must call it)."""
    if not _several_ranks():
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return bool(t.item())


def barrier() -> None:
    if _several_ranks():
        torch.distributed.barrier()
