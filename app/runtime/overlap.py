"""The gradient reducer the app owns: gradients are all-reduced in buckets while backward runs.

DeepSpeed reduces ZeRO-0's gradients (and ZeRO-1's, without `overlap_comm`) after backward, in
one pass over every gradient: none of it hides behind compute, which across nodes costs about a
step's compute at 25 Gb/s (issue 21). Here, as in PyTorch DDP, the parameters are cut into
buckets in the order backward produces their gradients (the reverse of registration); a hook
after each gradient's accumulation copies it into its bucket, and a full bucket is all-reduced
at once, asynchronously (gloo's threads on CPU, NCCL's stream on GPU: no host sync), while
backward computes the earlier layers. `finish`, where DeepSpeed would have reduced, waits for
the buckets and copies the result back into `param.grad`.

Only the boundary micro step is reduced: the others accumulate locally, as DeepSpeed does. The
buckets are launched strictly in order on every rank (a bucket waits for the ones before it),
so ranks agree on the collectives' order whatever their hooks' timing.
"""
from __future__ import annotations

import json
import os
import time
from typing import Callable, Iterable

import torch
import torch.distributed as dist

# DDP's default bucket (25 MB of fp32), and at least this many buckets when the model is small
# enough that one bucket would hold it all: one bucket overlaps nothing.
MAX_BUCKET_ELEMENTS = 25 * 2**20 // 4
MIN_BUCKET_ELEMENTS = 2**16
TARGET_BUCKETS = 8
# Test switches (tests/test_overlap.py): a file each rank appends its reducer's events to; and
# DeepSpeed's own reduction instead of this one (the reference the overlapped path must equal)
TRACE_ENV = "DSPRETRAIN_TEST_OVERLAP_TRACE"
OFF_ENV = "DSPRETRAIN_TEST_NO_OVERLAP"


def switched_off() -> bool:
    return os.environ.get(OFF_ENV, "") not in ("", "0")


def bucket_elements(total: int) -> int:
    """Elements a bucket: an eighth of the model, within [64 Ki, DDP's 25 MB of fp32]."""
    return max(MIN_BUCKET_ELEMENTS, min(MAX_BUCKET_ELEMENTS, total // TARGET_BUCKETS))


def buckets_in_backward_order(params: Iterable[torch.nn.Parameter],
                              size: int) -> list[list[torch.nn.Parameter]]:
    """The trainable parameters, last registered first (the order backward reaches them), cut
    into buckets of about `size` elements (a parameter larger than that is a bucket alone)."""
    buckets: list[list[torch.nn.Parameter]] = [[]]
    filled = 0
    for p in reversed([p for p in params if p.requires_grad and p.numel() > 0]):
        if buckets[-1] and filled + p.numel() > size:
            buckets.append([])
            filled = 0
        buckets[-1].append(p)
        filled += p.numel()
    return [b for b in buckets if b]


class GradReducer:
    """Bucketed all-reduce of `param.grad` during backward (module docstring).

    `average`: divide by the world size before the sum (DDP's pre-division: the sum cannot
    overflow a 16-bit type), else deliver the sum (where DeepSpeed's own code divides after).
    `keep_missing`: a parameter without a gradient gets the reduced zeros as its gradient (as
    DeepSpeed's ZeRO-0 does), else stays without one. `grad_of`: where a parameter's gradient
    is (default `param.grad`; DeepSpeed's BF16_Optimizer keeps it in an fp32 buffer).
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], *, group, world_size: int,
                 comm_dtype: torch.dtype, is_boundary: Callable[[], bool], average: bool = True,
                 keep_missing: bool = True, bucket_size: int | None = None,
                 grad_of: Callable[[torch.nn.Parameter], torch.Tensor | None] | None = None):
        params = [p for p in params if p.requires_grad and p.numel() > 0]
        self.group, self.world_size, self.comm_dtype = group, world_size, comm_dtype
        self.is_boundary, self.average, self.keep_missing = is_boundary, average, keep_missing
        self.grad_of = grad_of or (lambda p: p.grad)
        self.bucket_size = bucket_size or bucket_elements(sum(p.numel() for p in params))
        self.buckets = buckets_in_backward_order(params, self.bucket_size)
        self.where: dict[int, tuple[int, int]] = {}  # id(param) -> (bucket, offset)
        for b, bucket in enumerate(self.buckets):
            offset = 0
            for p in bucket:
                self.where[id(p)] = (b, offset)
                offset += p.numel()
        self.flats = [torch.empty(sum(p.numel() for p in bucket), dtype=comm_dtype,
                                  device=bucket[0].device) for bucket in self.buckets]
        self.trace_path = os.environ.get(TRACE_ENV)
        self._reset()
        self._handles = [p.register_post_accumulate_grad_hook(self._ready) for p in params]

    def _reset(self) -> None:
        self.filled: list[set[int]] = [set() for _ in self.buckets]
        self.works: list = []
        self.stale: set[int] = set()
        self.events: list[tuple[str, int, float]] = []

    def describe(self) -> str:
        return (f"{len(self.buckets)} bucket(s) of <= {self.bucket_size:,} elements, all-reduced "
                f"in {str(self.comm_dtype).removeprefix('torch.')} during backward")

    # -- during backward ----------------------------------------------------------------------

    def _ready(self, param: torch.nn.Parameter) -> None:
        """A gradient is final for this backward: into its bucket; launch what is complete."""
        grad = self.grad_of(param) if self.is_boundary() else None
        if grad is None:
            return
        b, _ = self.where[id(param)]
        if b < len(self.works):  # a second accumulation into an already sent gradient (a
            self.stale.add(b)    # parameter used in two checkpointed regions): resent at finish
            return
        self._fill(b, param, grad)
        if self.trace_path:  # which launched buckets are still in flight as backward goes on
            now = time.perf_counter()
            self.events.append(("ready", b, now))
            self.events += [("in_flight", i, now)
                            for i, work in enumerate(self.works) if not work.is_completed()]
        self._launch_ready()

    def _fill(self, b: int, param: torch.nn.Parameter, grad: torch.Tensor | None) -> None:
        _, offset = self.where[id(param)]
        view = self.flats[b].narrow(0, offset, param.numel())
        if grad is None:
            view.zero_()
        elif not self.average:
            view.copy_(grad.reshape(-1))
        elif grad.dtype == view.dtype:
            torch.mul(grad.reshape(-1), 1.0 / self.world_size, out=view)
        else:
            view.copy_(grad.reshape(-1) / self.world_size)
        self.filled[b].add(id(param))

    def _launch_ready(self) -> None:
        """Launch, in bucket order, every bucket whose gradients are all in."""
        while len(self.works) < len(self.buckets) and \
                len(self.filled[len(self.works)]) == len(self.buckets[len(self.works)]):
            b = len(self.works)
            self.works.append(dist.all_reduce(self.flats[b], group=self.group, async_op=True))
            self.events.append(("launch", b, time.perf_counter()))

    # -- after backward -----------------------------------------------------------------------

    def finish(self) -> None:
        """Where DeepSpeed would reduce: the parameters whose hook did not fire this backward
        (unused ones, or used only in earlier micro steps) go in now; wait for every bucket and
        copy the reduced gradients back into `param.grad`."""
        self.events.append(("backward_end", -1, time.perf_counter()))
        for b, bucket in enumerate(self.buckets):
            for p in bucket:
                if id(p) not in self.filled[b]:
                    self._fill(b, p, self.grad_of(p))
        self._launch_ready()
        for b, work in enumerate(self.works):
            work.wait()
            self.events.append(("done", b, time.perf_counter()))
            if b in self.stale:  # every rank has the same graph, so the same stale buckets
                for p in self.buckets[b]:
                    self._fill(b, p, self.grad_of(p))
                dist.all_reduce(self.flats[b], group=self.group)
            self._copy_back(b)
        self._write_trace()
        self._reset()

    def _copy_back(self, b: int) -> None:
        for p in self.buckets[b]:
            _, offset = self.where[id(p)]
            reduced = self.flats[b].narrow(0, offset, p.numel()).view_as(p)
            grad = self.grad_of(p)
            if grad is not None:
                grad.copy_(reduced.view_as(grad))
            elif self.keep_missing:
                p.grad = reduced.to(p.dtype, copy=True)

    def _write_trace(self) -> None:
        if not self.trace_path:
            return
        rank = dist.get_rank()
        with open(f"{self.trace_path}.rank{rank}", "a") as f:
            f.write(json.dumps({"buckets": len(self.buckets), "events": self.events}) + "\n")

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
