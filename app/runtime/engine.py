"""The DeepSpeed engine: its JSON config, process group, `initialize`, and cross-rank reductions.

DeepSpeed is imported here, in app.checkpoint.store (its checkpoints) and in app.runtime.device (its accelerator
probe, the one place that asks about the hardware); the rest of the app sees an `nn.Module`. The
ds_config owns ZeRO stage, precision and clipping; the app fills the "auto" fields from its flags
and reads batch sizes back from the engine.
"""
from __future__ import annotations

import copy
import fcntl
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from app.runtime.device import Device, bind, resolve_precision
from data_tools.errors import UserError
from data_tools.manifest import read_json

CONFIG_DIR = Path(__file__).resolve().parents[2] / "ds_configs"


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


def adopt_launcher_env(env: dict[str, str] | None = None) -> None:
    """Fill torch's rank variables from an MPI or Slurm launcher's when they are missing, so
    those processes join one job instead of each becoming a world of one."""
    env = os.environ if env is None else env
    if "RANK" in env:
        return
    for name, sources in _LAUNCHER_VARS.items():
        value = next((env[s] for s in sources if env.get(s)), None)
        if value is not None:
            env[name] = value.split("(")[0]  # SLURM_NTASKS_PER_NODE may read "4(x2)"


def world_from_env(env: dict[str, str] | None = None) -> World:
    env = os.environ if env is None else env
    world_size = int(env.get("WORLD_SIZE", 1))
    # a missing local size means one rank per node is all we know: never the whole world
    return World(rank=int(env.get("RANK", 0)), world_size=world_size,
                 local_rank=int(env.get("LOCAL_RANK", 0)),
                 local_world_size=int(env.get("LOCAL_WORLD_SIZE") or env.get("LOCAL_SIZE") or 1))


def zero_config_path(stage: int) -> Path:
    return CONFIG_DIR / f"zero{stage}.json"


def load_ds_config(path: Path) -> dict[str, Any]:
    """Read a DeepSpeed JSON config; UserError naming the file (and line) when it is unusable."""
    ds = read_json(path, missing=f"--ds-config {path}: no such file")
    if not isinstance(ds, dict):
        raise UserError(f"{path}: expected a JSON object")
    zero = ds.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise UserError(f"{path}: key 'zero_optimization' must be an object")
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise UserError(f"{path}: key 'zero_optimization.stage' is {stage!r}; ZeRO stages are "
                        f"0, 1, 2 and 3")
    return ds


def _enabled(ds: dict[str, Any], key: str) -> Any:
    section = ds.get(key)
    return section.get("enabled", False) if isinstance(section, dict) else False


def settle_precision(ds: dict[str, Any], requested: str, device: Device, where: Path) -> str:
    """The run's precision: the ds_config's when it fixes one, else --precision resolved.

    A file that sets bf16/fp16 explicitly owns the knob; --precision may then only agree.
    """
    fixed = [name for name in ("bf16", "fp16") if _enabled(ds, name) is True]
    if len(fixed) > 1:
        raise UserError(f"{where}: both 'bf16.enabled' and 'fp16.enabled' are true")
    if fixed:
        if requested not in ("auto", fixed[0]):
            raise UserError(f"--precision {requested}: {where} sets '{fixed[0]}.enabled': true")
        return resolve_precision(fixed[0], device)
    resolved = resolve_precision(requested, device)
    if resolved != "fp32" and _enabled(ds, resolved) is False and resolved in ds:
        # the file turns this precision off explicitly: it owns the knob
        if requested == "auto":
            return "fp32"
        raise UserError(f"--precision {requested}: {where} sets '{resolved}.enabled': false")
    return resolved


# DeepSpeed-scale sizes for the "auto" ZeRO knobs (elements), not Hugging Face's hidden^2 (1.2 M
# at width 768: hundreds of latency-bound collectives a step on 128 GPUs). 5e7 is DeepSpeed's own
# stage-3 prefetch default and a tenth of its reduce-bucket default: few collectives, each large
# enough to run at full bandwidth, with a bucket of 200 MB in fp32.
ZERO_SIZES = {"reduce_bucket_size": 50_000_000, "allgather_bucket_size": 50_000_000,
              "stage3_prefetch_bucket_size": 50_000_000,
              "stage3_param_persistence_threshold": 100_000}
# ZeRO-3 keeps parameters below the persistence threshold whole on every rank (no gather for
# them). Given the model's width, "auto" is 10 x hidden, as Hugging Face fills it: biases and
# LayerNorm weights stay whole, every matrix is partitioned. DeepSpeed's fixed 1e5 keeps every
# matrix of a width-128 model whole (bert-tiny: ZeRO-3 at 2 ranks then held 0.62x ZeRO-0's model
# state, not ~0.5x; docs/benchmarks.md, "bench").
PERSISTENCE_PER_HIDDEN = 10


def fill_auto(ds: dict[str, Any], *, micro_batch: int, grad_accum: int, world_size: int,
              precision: str, lr: float, betas: tuple[float, float], eps: float,
              weight_decay: float, pin_memory: bool, where: Path,
              torch_adam: bool = False, hidden_size: int | None = None) -> dict[str, Any]:
    """A copy of `ds` with every "auto" field set; UserError for an "auto" the app cannot fill.
    `torch_adam` (Device.torch_adam) picks torch's AdamW over DeepSpeed's compiled one unless the
    config says which, or offloads the optimizer (DeepSpeed's CPU Adam then). `hidden_size`, the
    model's width, sizes the ZeRO-3 persistence threshold (PERSISTENCE_PER_HIDDEN)."""
    ds = copy.deepcopy(ds)
    batch = {"train_micro_batch_size_per_gpu": micro_batch,
             "gradient_accumulation_steps": grad_accum,
             "train_batch_size": micro_batch * grad_accum * world_size}
    for key, value in batch.items():
        if ds.get(key, "auto") == "auto":
            ds[key] = value
        elif ds[key] != value:
            raise UserError(f"{where}: key '{key}' is {ds[key]} but the flags give {value} "
                            f"(set it to \"auto\" or drop the flag)")
    if ds.get("gradient_clipping") == "auto":
        ds["gradient_clipping"] = 1.0
    _fill_optimizer(ds, {"lr": lr, "betas": list(betas), "eps": eps,
                         "weight_decay": weight_decay})
    _fill_precision(ds, precision)
    zero = ds.setdefault("zero_optimization", {"stage": 0})
    opt = ds["optimizer"]
    offloaded = (zero.get("offload_optimizer") or {}).get("device") in ("cpu", "nvme")
    if (torch_adam and isinstance(opt, dict) and not offloaded
            and str(opt.get("type", "")).lower() in ("adam", "adamw")):
        opt["params"].setdefault("torch_adam", True)
    sizes = dict(ZERO_SIZES)
    if hidden_size:
        sizes["stage3_param_persistence_threshold"] = PERSISTENCE_PER_HIDDEN * hidden_size
    for key, value in sizes.items():
        if zero.get(key) == "auto":
            zero[key] = value
    for key in ("offload_optimizer", "offload_param"):
        if isinstance(zero.get(key), dict) and zero[key].get("pin_memory") == "auto":
            zero[key]["pin_memory"] = pin_memory
    left = _auto_paths(ds)
    if left:
        raise UserError(f"{where}: key '{left[0]}' is \"auto\" and the app does not fill it")
    return ds


def _fill_optimizer(ds: dict[str, Any], settings: dict[str, Any]) -> None:
    opt = ds.get("optimizer")
    if opt is None:  # no optimizer block (common in HF-style configs): DeepSpeed would build none
        ds["optimizer"] = {"type": "AdamW", "params": dict(settings)}
    elif isinstance(opt, dict):
        params = opt.setdefault("params", {})
        for key, value in settings.items():
            if params.get(key, "auto") == "auto":
                params[key] = value


def _fill_precision(ds: dict[str, Any], precision: str) -> None:
    """Enable the run's precision; bf16 accumulates gradients in fp32 where DeepSpeed allows it
    (ZeRO 1-3; at ZeRO-0 it refuses the mix and accumulates and all-reduces them in bf16)."""
    for name in ("bf16", "fp16"):
        section = ds.get(name)
        if isinstance(section, dict) and section.get("enabled") == "auto":
            section["enabled"] = precision == name
    if precision in ("bf16", "fp16") and not isinstance(ds.get(precision), dict):
        ds[precision] = {"enabled": True}  # a file without the section runs what we report
    if precision == "bf16" and zero_stage(ds) >= 1 and "data_types" not in ds:
        ds["data_types"] = {"grad_accum_dtype": "fp32"}


class _ReadKeys(dict):
    """A dict that notes which keys were looked up: DeepSpeed reads its top-level keys with
    .get and ignores the rest, so a key it never looked up is one it does not know."""

    def __init__(self, data: dict[str, Any]):
        super().__init__(data)
        self.read: set[str] = set()

    def get(self, key, *default):
        self.read.add(key)
        return super().get(key, *default)

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key) -> bool:
        self.read.add(key)
        return super().__contains__(key)


def _pydantic_key(ds: dict[str, Any], error) -> str:
    """'zero_optimization.bogus_key' from a DeepSpeed section model's validation error."""
    loc = ".".join(str(p) for p in error["loc"])
    first = str(error["loc"][0]) if error["loc"] else ""
    for key, section in ds.items():
        if isinstance(section, dict) and first in section:
            return f"{key}.{loc}"
    return loc


def validate_ds_config(ds: dict[str, Any], where: Path) -> list[str]:
    """Check a filled config through DeepSpeed's own config model, before any process group.

    What DeepSpeed refuses becomes one UserError naming the key; returns warnings for top-level
    keys DeepSpeed does not know (it ignores them silently: usually a typo).
    """
    import difflib
    import logging

    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS, DeepSpeedConfig
    from deepspeed.utils import logger
    from pydantic import ValidationError

    probe = _ReadKeys(copy.deepcopy(ds))
    # DeepSpeed checks the batch sizes against the current world, which is one rank here
    probe["train_batch_size"] = (probe["train_micro_batch_size_per_gpu"]
                                 * probe["gradient_accumulation_steps"])
    level = logger.level
    logger.setLevel(logging.WARNING)  # its config parsing logs at info on every rank
    try:
        DeepSpeedConfig(probe)
    except ValidationError as e:
        err = e.errors()[0]
        raise UserError(f"{where}: key '{_pydantic_key(ds, err)}': {err['msg']} (DeepSpeed's "
                        f"config check)") from None
    except (AssertionError, ValueError, TypeError, KeyError) as e:
        raise UserError(f"{where}: DeepSpeed refuses this config: {e}") from None
    finally:
        logger.setLevel(level)
    opt = ds.get("optimizer", {}).get("type", "")
    if opt.lower() not in DEEPSPEED_OPTIMIZERS and not hasattr(torch.optim, opt):
        raise UserError(f"{where}: key 'optimizer.type' is {opt!r}: neither a DeepSpeed optimizer "
                        f"({', '.join(DEEPSPEED_OPTIMIZERS)}) nor one of torch.optim")
    clip = ds.get("gradient_clipping", 0.0)
    if not isinstance(clip, (int, float)) or isinstance(clip, bool) or clip < 0:
        raise UserError(f"{where}: key 'gradient_clipping' is {clip!r}: expected a number >= 0")
    warnings = []
    for key in sorted(set(ds) - probe.read):
        close = difflib.get_close_matches(key, sorted(probe.read), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        warnings.append(f"{where}: key '{key}' is not a DeepSpeed setting and is ignored{hint}")
    return warnings


def _auto_paths(node: Any, prefix: str = "") -> list[str]:
    if isinstance(node, dict):
        return [p for k, v in node.items() for p in _auto_paths(v, f"{prefix}{k}.")]
    return [prefix.rstrip(".")] if node == "auto" else []


def zero_stage(ds: dict[str, Any]) -> int:
    return int(ds.get("zero_optimization", {}).get("stage", 0))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(device: Device, timeout_minutes: float = 30.0) -> World:
    """Join the process group; a bare `python -m app train` becomes a world of one. A collective
    that waits longer than `timeout_minutes` for a rank fails the job (DeepSpeed's default: 10)."""
    from datetime import timedelta

    import deepspeed

    if "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:
        os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                           "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": os.environ.get("MASTER_PORT") or str(_free_port())})
    bind(device, int(os.environ.get("LOCAL_RANK", 0)))
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


def _optimizer_op(ds_config: dict[str, Any]) -> str | None:
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
    from deepspeed.accelerator import get_accelerator

    _own_extensions_dir()
    builder = get_accelerator().create_op_builder(builder_name)
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
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
    """Build DeepSpeed's JIT ops in a directory of this installation's own (unless the user set
    TORCH_EXTENSIONS_DIR): torch's default is shared by every environment with the same Python,
    so two virtualenvs with their own DeepSpeed rebuilt each other's ops on every start (a minute
    or more each)."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return
    import hashlib

    import deepspeed
    from torch.utils.cpp_extension import get_default_build_root

    install = f"{deepspeed.__file__}|{deepspeed.__version__}|{torch.__version__}"
    tag = hashlib.sha256(install.encode()).hexdigest()[:10]
    version = f"py{sys.version_info.major}{sys.version_info.minor}"
    os.environ["TORCH_EXTENSIONS_DIR"] = str(Path(get_default_build_root()) / f"{version}-{tag}")


def shutdown() -> None:
    """Leave the process group (NCCL warns about, and may hang on, groups never destroyed)."""
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def initialize(model: torch.nn.Module, ds_config: dict[str, Any],
               lr_lambda: Callable[[int], float], param_groups: list[dict[str, Any]]):
    """`deepspeed.initialize` with the optimizer from the config (over `param_groups`) and our
    LR schedule on it."""
    import deepspeed

    def scheduler(optimizer):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)

    op = _optimizer_op(ds_config)
    if op:
        load_op(op)

    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups,
                                           config=ds_config, lr_scheduler=scheduler)
    share_fp32_partitions(engine)
    skip_lone_allreduce(engine)
    return engine


def skip_lone_allreduce(engine) -> bool:
    """ZeRO-0 in a world of one: no gradient all-reduce. DeepSpeed still flattens every gradient
    into one buffer, multiplies it by 1/1, "all-reduces" it alone and copies it back: an
    identity that cost GPT-2 4 x 256 (5 M parameters, CPU) ~3% of its step (docs/benchmarks.md,
    "bench"). Returns whether it was skipped. ZeRO 1-3 keep their own reduction (it also moves
    gradients into their partitions)."""
    if engine.zero_optimization_stage() != 0 or engine.dp_world_size != 1 \
            or getattr(engine, "has_moe_layers", False):
        return False
    engine.enable_backward_allreduce = False
    return True


def share_fp32_partitions(engine) -> int:
    """ZeRO-3 with fp32 parameters: the optimizer's fp32 partitions become the parameters' own
    partitions instead of a copy of them (4 bytes a parameter less, over the ranks). Returns the
    bytes freed on this rank.

    DeepSpeed skips the fp32 master copy when a partition is fp32 on the device already (its
    autocast case, where the two are aliases), but its test compares `tensor.device` with the
    accelerator's device name, a torch.device with a str, which is never equal in torch 2.x: fp32
    runs kept two identical copies (measured: model state at 2 ranks 0.625x ZeRO-0's instead of
    0.5x; docs/benchmarks.md, "bench"). Equal values, so nothing trained changes; DeepSpeed's
    copy of the master onto the partition after each step becomes a copy onto itself. Offloaded
    optimizers keep their own copies.
    """
    opt = engine.optimizer
    masters = getattr(opt, "fp32_partitioned_groups_flat", None)
    partitions = getattr(opt, "fp16_partitioned_groups_flat", None)
    if not masters or not partitions or getattr(opt, "offload_optimizer", False):
        return 0
    freed = 0
    for master, part in zip(masters, partitions):
        if (part is not None and master.dtype == part.dtype and master.shape == part.shape
                and master.device == part.device and master.numel() > 0
                and master.untyped_storage().data_ptr() != part.untyped_storage().data_ptr()
                and torch.equal(master, part)):
            freed += master.untyped_storage().nbytes()
            master.data = part.data
    return freed


def apply_lr_schedule(engine) -> None:
    """Set every parameter group's LR from the schedule at its current step (after a rollback
    changed the schedule: the cool-down applies from the very next step)."""
    sched = engine.lr_scheduler
    for group, base, fn in zip(sched.optimizer.param_groups, sched.base_lrs, sched.lr_lambdas):
        group["lr"] = base * fn(sched.last_epoch)


def engine_facts(engine) -> dict[str, Any]:
    """What DeepSpeed built from the config (recorded in config.json): the optimizer wrapper and
    the dtypes of the weights and of gradient accumulation."""
    model_dtype, grad_dtype = engine.get_data_types()
    return {"optimizer": type(engine.optimizer).__name__, "model_dtype": str(model_dtype),
            "grad_accum_dtype": str(grad_dtype), "zero_stage": engine.zero_optimization_stage()}


def grad_norm_before_step(engine) -> torch.Tensor | None:
    """The global gradient norm, when DeepSpeed will not report one (ZeRO-0 in fp32).

    Call after the boundary micro step's backward (gradients are all-reduced then) and before
    `engine.step()` clears them. Returns None where `engine.get_global_grad_norm()` will work.
    """
    if engine.zero_optimization() or engine.bfloat16_enabled() or engine.fp16_enabled():
        return None
    grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
    if not grads:
        return None
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))


def model_state_bytes(engine) -> int:
    """Bytes of model state this rank holds: parameters (at ZeRO-3 its partitions and the
    persistent ones), gradients and optimizer states, counted once per tensor storage.

    Walks the module's parameters and the optimizer chain (DeepSpeed's ZeRO wrapper, then the
    torch optimizer inside it: flat buffers, partitions, `state`). Call between the boundary
    micro step's backward and `engine.step()`, where gradients exist (the step frees them);
    it reads tensor sizes only, no device sync. The ZeRO paper's model states, measured.
    """
    seen: dict[tuple[int, int], int] = {}

    def add(obj: Any, depth: int) -> None:
        if isinstance(obj, torch.Tensor):
            if obj.device.type == "meta":
                return
            storage = obj.untyped_storage()
            if storage.data_ptr():
                seen[(storage.data_ptr(), obj.device.index or 0)] = storage.nbytes()
        elif depth > 0 and isinstance(obj, (list, tuple)):
            for item in obj:
                add(item, depth - 1)
        elif depth > 0 and isinstance(obj, dict):
            for item in obj.values():
                add(item, depth - 1)

    for p in engine.module.parameters():
        for t in (p, p.grad, getattr(p, "ds_tensor", None)):
            add(t, 0)
    optimizer, hops = engine.optimizer, 0
    while optimizer is not None and hops < 4:  # ZeRO wrapper -> torch optimizer
        add(vars(optimizer), 4)
        optimizer, hops = getattr(optimizer, "optimizer", None), hops + 1
    return sum(seen.values())


def reported_grad_norm(engine) -> float | None:
    norm = engine.get_global_grad_norm()
    return None if norm is None else float(norm)


def loss_scale(engine) -> float | None:
    """The dynamic loss scale (fp16 only)."""
    if not engine.fp16_enabled():
        return None
    scale = getattr(engine.optimizer, "cur_scale", None) or getattr(engine.optimizer,
                                                                    "loss_scale", None)
    return None if scale is None else float(scale)


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


def all_gather_object(obj: Any) -> list[Any]:
    if not _several_ranks():
        return [obj]
    out: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def barrier() -> None:
    if _several_ranks():
        torch.distributed.barrier()


def versions() -> dict[str, str]:
    import deepspeed
    import transformers

    return {"torch": torch.__version__, "deepspeed": deepspeed.__version__,
            "transformers": transformers.__version__}
