"""Where the model runs: the one place that asks DeepSpeed's accelerator about the hardware.

Everything device-specific (device name, pinned memory, communication backend, precision support,
memory figures, CPU threads) is answered here, so no other module mentions "cpu" or "cuda".
"""
from __future__ import annotations

import os
import random
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any, Iterator, Mapping

import numpy as np
import torch

from data_tools.errors import UserError

PRECISIONS = ("auto", "bf16", "fp16", "fp32")


def accelerator():
    """DeepSpeed's accelerator object (imported lazily: its probe takes a moment and logs)."""
    from deepspeed.accelerator import get_accelerator
    return get_accelerator()


@dataclass(frozen=True)
class Device:
    """Facts about this rank's accelerator, recorded in the run's config.json."""

    name: str
    """Accelerator kind as DeepSpeed names it ("cuda", "cpu", "xpu", ...)."""
    backend: str
    """Communication backend DeepSpeed uses for it (nccl on CUDA, gloo on CPU)."""
    pin_memory: bool
    """Whether the data loader should pin host memory (only useful with a separate device)."""
    bf16_supported: bool
    fp16_supported: bool
    model: str | None = None
    """The device as its driver names it ("NVIDIA H100 80GB HBM3"); None on CPU."""
    fused_adam_prebuilt: bool = False
    """DeepSpeed's fused Adam op was compiled into its wheel (DS_BUILD_FUSED_ADAM=1): loading it
    is an import, not a JIT build."""

    @property
    def is_cpu(self) -> bool:
        return self.name == "cpu"

    @property
    def torch_adam(self) -> bool:
        """Whether DeepSpeed's Adam should be torch's rather than its compiled op: on CPU and
        CUDA, always.

        On CPU the compiled op keeps beta**step as a running product in C++ state, which a
        resumed process recomputes with pow: the same weights and moments then step to values a
        last bit apart. torch's AdamW takes the power from the step stored in the checkpoint, so
        resume stays bit-exact. On CUDA DeepSpeed's op is built with nvcc on first use unless
        its wheel has it: a run without a CUDA toolkit crashed there, and a JIT build on a
        shared home held every rank of a large job at start-up. torch's fused AdamW
        (`torch_adam_fused`) is the same one-kernel update, needs no build, and skips a step
        with non-finite gradients on the device (app.runtime.step_guard), which DeepSpeed's
        cannot: it is taken even where DeepSpeed's op is prebuilt (a ds_config with
        `"torch_adam": false` still gets DeepSpeed's).
        """
        return self.is_cpu or self.torch_adam_fused

    @property
    def torch_adam_fused(self) -> bool:
        """torch's AdamW with fused=True (one kernel for all tensors, its step a device tensor:
        no host sync; a found_inf flag skips the update on the device): on CPU and CUDA. Other
        accelerators bring DeepSpeed ops of their own. (Before 2026-11-29 CPU runs took the
        single-tensor AdamW: a checkpoint of theirs resumes with the fused update, whose
        rounding differs in the last bits.)"""
        return self.name in ("cpu", "cuda")

    def torch_device(self, local_rank: int = 0) -> torch.device:
        return torch.device(self.name if self.is_cpu
                            else f"{self.name}:{device_ordinal(local_rank)}")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# transformers 5 switches its PyTorch side off below this torch (is_torch_available), so a model
# class would fail to build with a message about PyTorch missing; setup.cfg's floor says the same,
# for installs that bypass it (--no-deps, a cluster's preinstalled torch)
MIN_TORCH = (2, 6)


def check_torch_version(version: str = torch.__version__) -> None:
    """UserError when this torch is below MIN_TORCH (setup.cfg says why)."""
    parts = [int(p) if p.isdigit() else 0 for p in version.split("+")[0].split(".")[:2]]
    if tuple(parts) < MIN_TORCH:
        raise UserError(f"torch {version}: this app needs torch >= "
                        f"{'.'.join(map(str, MIN_TORCH))} (transformers 5 turns its PyTorch "
                        f"support off below it); install a newer torch build for this machine")


def detect() -> Device:
    check_torch_version()
    acc = accelerator()
    name = acc.device_name()
    return Device(name=name, backend=acc.communication_backend_name(), pin_memory=name != "cpu",
                  bf16_supported=bool(acc.is_bf16_supported()),
                  fp16_supported=bool(acc.is_fp16_supported()), model=_model_name(name),
                  fused_adam_prebuilt=_prebuilt("fused_adam"))


def _prebuilt(op: str) -> bool:
    """Whether DeepSpeed's wheel carries compiled op `op` (DS_BUILD_* at install)."""
    from deepspeed.git_version_info import installed_ops
    return bool(installed_ops.get(op, False))


def _model_name(name: str) -> str | None:
    """torch.cuda.get_device_name() and its kin for other accelerators (None on CPU)."""
    get = getattr(getattr(torch, name, None), "get_device_name", None)
    if name == "cpu" or get is None:
        return None
    try:
        return str(get())
    except (RuntimeError, AssertionError):
        return None


def resolve_precision(requested: str, device: Device) -> str:
    """"auto" = bf16 where the accelerator has it and is not the CPU; fp32 on CPU.

    On CPU, bf16 autocast is slower than fp32 and changes nothing about correctness.
    """
    if requested not in PRECISIONS:
        raise UserError(f"--precision {requested!r}: expected one of {', '.join(PRECISIONS)}")
    if requested == "auto":
        return "bf16" if device.bf16_supported and not device.is_cpu else "fp32"
    if requested == "bf16" and not device.bf16_supported:
        raise UserError(f"--precision bf16: the {device.name} accelerator does not support bf16")
    if requested == "fp16" and not device.fp16_supported:
        raise UserError(f"--precision fp16: the {device.name} accelerator does not support fp16")
    return requested


def attention_implementation(requested: str, device: Device, precision: str = "bf16",
                             packing: str = "concat") -> str:
    """The --attn implementation to build the model with (`choose_attention`, without why)."""
    return choose_attention(requested, device, precision, packing)[0]


# Why "auto" is PyTorch's SDPA on every device: the app's layouts that may use flash kernels at
# all ("concat" packing: no mask) run SDPA's own flash backend, which is FlashAttention-2 (on
# sm80 and later, H100 included, with dropout), so the flash-attn package would add no speed,
# only a compiled extension that must match this torch (one built for another fails every rank at
# model build) and, at micro batch 1, transformers' packed-sequence check, a host sync per layer.
# FlashAttention-3 (Hopper) is faster but drops attention dropout in transformers' integration:
# not a default until measured (docs/gpu.md).
AUTO_ATTENTION = "sdpa"


def choose_attention(requested: str, device: Device, precision: str = "bf16",
                     packing: str = "concat", attention_dropout: float = 0.0) -> tuple[str, str]:
    """(implementation, why) for --attn: "auto" is SDPA (AUTO_ATTENTION says why); an explicit
    flash_attention_2 must import and run here (`flash_attention_broken`), else one line; flex
    says where PyTorch's FlexAttention runs (`flex_why`)."""
    if requested == "flex":
        return requested, flex_why(device.name, attention_dropout)
    if requested == "flash_attention_2":
        broken = flash_attention_broken(device)
        if broken:
            raise UserError(f"--attn flash_attention_2: {broken}; --attn sdpa runs PyTorch's "
                            f"own FlashAttention-2 kernels on sm80+ GPUs")
        return requested, "as asked; flash-attn imported and ran a test call"
    if requested != "auto":
        return requested, "as asked"
    if device.is_cpu:
        return AUTO_ATTENTION, "auto: PyTorch's SDPA (CPU)"
    if precision not in ("bf16", "fp16") or packing != "concat":
        return AUTO_ATTENTION, f"auto: PyTorch's SDPA ({precision}, --packing {packing})"
    return AUTO_ATTENTION, ("auto: PyTorch's SDPA, whose flash backend is FlashAttention-2; the "
                            "flash-attn package is not needed (--attn flash_attention_2 to use it)")


# FlexAttention (torch.nn.attention.flex_attention, app/flex.py) by torch device type: where
# torch.compile turns it into one fused kernel (Triton on CUDA; the eager form materialises the
# S x S scores as SDPA's math path does), and where torch has its backward at all (torch 2.13
# refuses `requires_grad` inputs on CPU and MPS in flex_attention's `_validate_device`).
FLEX_COMPILED = ("cuda",)
FLEX_NO_BACKWARD = ("cpu", "mps")


def flex_compiled(device_type: str) -> bool:
    """Whether app/flex.py runs flex_attention (and create_block_mask) through torch.compile on
    this device type: the fused kernel where torch has one; eager elsewhere (CPU: compiling it
    needs a C++ toolchain and buys nothing for the tests it serves)."""
    return device_type in FLEX_COMPILED


def flex_backward(device_type: str) -> bool:
    """Whether torch's FlexAttention takes a backward on this device type."""
    return device_type not in FLEX_NO_BACKWARD


def flex_why(device_type: str, attention_dropout: float = 0.0) -> str:
    """The start-up line's reason for --attn flex on this device and model: where the
    FlexAttention kernel runs, and where a step runs its mask through SDPA instead (no attention
    dropout in FlexAttention; no backward on CPU)."""
    how = "compiled" if flex_compiled(device_type) else "eager"
    if attention_dropout > 0:
        return (f"as asked; FlexAttention ({how}) in eval; training runs its mask through SDPA: "
                f"FlexAttention has no attention dropout ({attention_dropout:g} here; "
                f"--dropout 0 for its kernel)")
    if not flex_backward(device_type):
        return (f"as asked; FlexAttention ({how}) in eval; training runs its mask through SDPA: "
                f"torch has no FlexAttention backward on {device_type}")
    return f"as asked; FlexAttention ({how}) with block masks"


_FLASH_PROBE: dict[str, str | None] = {}


def flash_attention_broken(device: Device) -> str | None:
    """None when the flash-attn package imports (its CUDA extension with it) and runs one tiny
    attention call on this rank's device in bf16; else why not, in one line. Once per process:
    package metadata alone (what transformers checks) says nothing of a wheel built for another
    torch or another GPU."""
    if "result" not in _FLASH_PROBE:
        _FLASH_PROBE["result"] = _probe_flash_attention(device)
    return _FLASH_PROBE["result"]


def _probe_flash_attention(device: Device) -> str | None:
    try:
        import flash_attn
        from flash_attn import flash_attn_func
    except Exception as e:  # noqa: BLE001 - ImportError, OSError "undefined symbol", ...
        return f"the flash-attn package does not import here ({_first_line(e)})"
    version = getattr(flash_attn, "__version__", "?")
    where = device.torch_device(int(os.environ.get("LOCAL_RANK", 0)))
    try:
        q = torch.zeros(1, 8, 2, 64, dtype=torch.bfloat16, device=where)  # batch, seq, heads, dim
        out = flash_attn_func(q, q, q, causal=True)
        (out[0] if isinstance(out, tuple) else out).float().sum().item()  # waits for the kernel
    except Exception as e:  # noqa: BLE001 - no kernel image for this GPU, a CPU, ...
        return f"flash-attn {version} does not run on {where} ({_first_line(e)})"
    return None


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:160]}" if text else type(e).__name__


def set_cpu_threads(env: Mapping[str, str] = os.environ) -> int | None:
    """Share the node's cores among its ranks, on every kind of device: torch takes them all per
    process otherwise (8 ranks x all cores under CPU-offloaded Adam or the loader's numpy).

    Respects OMP_NUM_THREADS when the user or launcher set it; returns the thread count chosen.
    """
    if env.get("OMP_NUM_THREADS"):
        return None
    threads = max(1, cpu_share(env).cores)
    torch.set_num_threads(threads)
    return threads


@dataclass(frozen=True)
class CpuShare:
    """This rank's part of the node's CPUs (its threads, and its loader's workers)."""

    affinity: int
    """Cores in this process's affinity mask (a Slurm, numactl or taskset binding narrows it)."""
    local_ranks: int
    shared: bool
    """The mask is the node's ranks' together (one launcher started them all inside it), not
    this rank's own (srun or numactl bound each rank to cores of its own)."""

    @property
    def cores(self) -> int:
        """Cores this rank may count on; 0: less than one."""
        return self.affinity // self.local_ranks if self.shared else self.affinity

    def as_dict(self) -> dict[str, Any]:
        return {"affinity_cores": self.affinity, "local_ranks": self.local_ranks,
                "mask": "shared by the local ranks" if self.shared else "the rank's own",
                "cores_per_rank": self.cores}


def cpu_share(env: Mapping[str, str] = os.environ) -> CpuShare:
    local = max(1, int(env.get("LOCAL_WORLD_SIZE") or env.get("LOCAL_SIZE") or 1))
    return CpuShare(usable_cores(), local, local > 1 and not _own_mask())


def _own_mask() -> bool:
    """Whether this process was bound to fewer cores than the process that started it: a rank
    srun (--cpu-bind) or numactl bound has a mask of its own, which dividing by the node's ranks
    would count a second time; ranks a launcher started share its mask."""
    try:
        return os.sched_getaffinity(0) < os.sched_getaffinity(os.getppid())
    except (AttributeError, OSError):  # no affinity API, or the parent is gone
        return False


def cpu_share_warning(device: Device, share: CpuShare, threads: int | None,
                      workers: int) -> str | None:
    """One line when a GPU rank has under two cores of its own: its loader then builds batches
    in the training process between steps (0 workers) on one thread, where a GPU step leaves the
    CPU idle. Usually a Slurm step that bound one task to one core while a launcher started all
    the node's ranks inside it."""
    if device.is_cpu or share.cores >= 2:
        return None
    how = "shared by" if share.shared else "of its own, with"
    return (f"warning: {share.affinity} CPU core(s) in this rank's affinity mask, {how} "
            f"{share.local_ranks} local rank(s): {threads or 'OMP_NUM_THREADS'} thread(s) and "
            f"{workers} loader worker(s) per rank, batches built between steps; give the ranks "
            f"cores (srun --cpus-per-task=$SLURM_CPUS_ON_NODE with one launch.sh a node, or "
            f"--cpu-bind=none; docs/launch.md, \"Slurm\")")


def enable_tf32(device: Device, precision: str, requested: bool) -> None:
    """--tf32: fp32 matrix products and convolutions on TF32 tensor cores (CUDA only)."""
    if requested and precision == "fp32" and device.name == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask, e.g. a Slurm allocation)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return cores or 1


def synchronize() -> None:
    """Wait for the accelerator's queued work (a no-op on CPU): before reading a clock that is to
    time it. A host sync: call it at log, eval and save boundaries only."""
    accelerator().synchronize()


def bind(device: Device, local_rank: int) -> None:
    """Make this rank's accelerator the current one, before any collective: NCCL puts a
    collective's tensors on the current device, which is otherwise device 0 on every rank."""
    if not device.is_cpu:
        accelerator().set_device(device_ordinal(local_rank))


def device_ordinal(local_rank: int) -> int:
    """The accelerator a local rank drives, among those it sees: its local rank where each rank
    sees all the node's devices (DeepSpeed's launcher, torchrun), 0 where Slurm shows each task
    only its own (--gpus-per-task=1, --gpu-bind): ordinal `local_rank` is then no device."""
    count = int(accelerator().device_count() or 0)
    return local_rank % count if count else local_rank


def rng_state() -> dict[str, Any]:
    """Every random generator this rank draws from (dropout, and anything seeded globally)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if accelerator().device_name() != "cpu":
        state["accelerator"] = accelerator().get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "accelerator" in state:
        accelerator().set_rng_state(state["accelerator"])


def to_device(batch: Mapping[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Move a batch; non_blocking overlaps the copy with compute when the memory is pinned."""
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def memory_gb() -> tuple[float, float, float]:
    """(in use, reserved, peak) memory of this rank in GiB: the accelerator's allocator counters
    (allocated, reserved by the caching allocator, peak allocated), or on CPU the process's
    resident set (current, current, peak since its exec; zeros where there is no /proc)."""
    acc = accelerator()
    if acc.device_name() == "cpu":
        current, peak = _proc_status_bytes("self", "VmRSS"), peak_rss_bytes()
        return current / 2**30, current / 2**30, max(peak, current) / 2**30
    return (acc.memory_allocated() / 2**30, acc.memory_reserved() / 2**30,
            acc.max_memory_allocated() / 2**30)


def peak_rss_bytes(pid: int | str = "self") -> int:
    """A process's peak resident memory since its exec (VmHWM), 0 if it is gone or there is no
    /proc. Not `ru_maxrss`: Linux carries that across exec from the parent's memory, so a rank
    started by a large process (a tuner, pytest) would report at least the parent's size."""
    return _proc_status_bytes(pid, "VmHWM")


def _proc_status_bytes(pid: int | str, key: str) -> int:
    """A size field ("VmHWM", "VmRSS": kB) of /proc/PID/status in bytes; 0 where it is not."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(f"{key}:"):
                    return int(line.split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        pass
    return 0


def accelerator_memory_bytes() -> int:
    """Total memory of this rank's accelerator (the default budget of `app tune` on a GPU)."""
    return int(accelerator().total_memory())


class ComputeClock:
    """Sums the device time of code spans without a host sync per span: accelerator events
    recorded around each span and read at `take()` (after the window's one synchronize); on CPU,
    where work is synchronous, the host clock."""

    def __init__(self, device: Device):
        self.device = device
        self._event = None if device.is_cpu else accelerator().Event
        self._pairs: list = []
        self._seconds = 0.0

    @contextmanager
    def span(self) -> Iterator[None]:
        if self._event is None:
            t0 = time.perf_counter()
            yield
            self._seconds += time.perf_counter() - t0
            return
        start, end = self._event(enable_timing=True), self._event(enable_timing=True)
        start.record()
        yield
        end.record()
        self._pairs.append((start, end))

    def another(self) -> "ComputeClock":
        """A clock of its own on the same device (a second kind of span)."""
        return ComputeClock(self.device)

    def take(self) -> float:
        """Seconds measured since the last take (call after synchronize)."""
        seconds = self._seconds + sum(a.elapsed_time(b) for a, b in self._pairs) / 1000.0
        self._pairs, self._seconds = [], 0.0
        return seconds
