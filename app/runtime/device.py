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

    @property
    def is_cpu(self) -> bool:
        return self.name == "cpu"

    @property
    def torch_adam(self) -> bool:
        """Whether DeepSpeed's Adam should be torch's rather than its compiled op.

        On CPU the compiled op keeps beta**step as a running product in C++ state, which a
        resumed process recomputes with pow: the same weights and moments then step to values a
        last bit apart. torch's AdamW takes the power from the step stored in the checkpoint, so
        resume stays bit-exact. The CUDA kernel recomputes the power every step already.
        """
        return self.is_cpu

    def torch_device(self, local_rank: int = 0) -> torch.device:
        return torch.device(self.name if self.is_cpu else f"{self.name}:{local_rank}")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def detect() -> Device:
    acc = accelerator()
    name = acc.device_name()
    return Device(name=name, backend=acc.communication_backend_name(), pin_memory=name != "cpu",
                  bf16_supported=bool(acc.is_bf16_supported()),
                  fp16_supported=bool(acc.is_fp16_supported()), model=_model_name(name))


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
    """"auto" = flash_attention_2 when transformers finds a version of it it supports, on a GPU,
    in bf16/fp16 (its kernels take nothing else), with "concat" packing (padded batches make
    transformers unpad them with a host sync per layer); else PyTorch SDPA."""
    if requested != "auto":
        return requested
    if not device.is_cpu and precision in ("bf16", "fp16") and packing == "concat":
        from transformers.utils import is_flash_attn_2_available
        if is_flash_attn_2_available():
            return "flash_attention_2"
    return "sdpa"


def set_cpu_threads(env: Mapping[str, str] = os.environ) -> int | None:
    """Share the node's cores among its ranks, on every kind of device: torch takes them all per
    process otherwise (8 ranks x all cores under CPU-offloaded Adam or the loader's numpy).

    Respects OMP_NUM_THREADS when the user or launcher set it; returns the thread count chosen.
    """
    if env.get("OMP_NUM_THREADS"):
        return None
    local = int(env.get("LOCAL_WORLD_SIZE") or env.get("LOCAL_SIZE") or 1)
    threads = max(1, usable_cores() // max(local, 1))
    torch.set_num_threads(threads)
    return threads


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
        accelerator().set_device(local_rank)


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

    def take(self) -> float:
        """Seconds measured since the last take (call after synchronize)."""
        seconds = self._seconds + sum(a.elapsed_time(b) for a, b in self._pairs) / 1000.0
        self._pairs, self._seconds = [], 0.0
        return seconds
