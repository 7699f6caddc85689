"""ZeRO-2's bucket reductions made asynchronous on devices without streams (CPU).

DeepSpeed's ZeRO-2 reduces a full ipg bucket inside the gradient hook that overflows it
(reduce_ipg_grads -> average_tensor -> allreduce_and_scatter / allreduce_no_retain), then copies
the owned gradients into the partition and drops the others (reduce_ipg_grads' epilogue). With
`overlap_comm` it hides that on a GPU side stream and alternates two ipg buffers; on an
accelerator whose streams are no-ops every collective blocks backward (netsim: ZeRO-2 at 0.35-0.40
scaling efficiency where DDP reached 0.57-0.61, docs/benchmarks.md).

This instance patch keeps DeepSpeed's arithmetic and launches the same collectives, in the same
order, with `async_op`: what follows them (the wait, the copy of the reduced values back into the
ipg buffer and the fp32 partition, reduce_ipg_grads' epilogue) is deferred, oldest first, to a
later bucket's launch once its collectives are done, or to the end of backward, where DeepSpeed's
epilogue flushes the last bucket (`reduce_ipg_grads()` without a dtype). An oversized gradient
(DeepSpeed keeps it outside the ipg buffers; in a BERT the tied word embeddings, whose gradient is
final only at backward's end) is launched and deferred in the same way, and the end of backward
launches its last bucket behind the ones in flight before it waits for any. (Completing them
first, as this patch did before, held the embeddings' collective back 40 ms on the slower rank at
comm = compute on the 2-node netsim link; the link stays busy with the earlier buckets meanwhile,
so the step did not change beyond the run-to-run noise, docs/benchmarks.md.)

DeepSpeed alternates two ipg buffers, so a bucket still in flight would have to complete
(backward waiting for the link) before its buffer is refilled by the bucket after next; instead,
the buffer it still reads is handed to it and the refill goes to a spare one, up to
`PENDING_BUCKETS` buckets in flight (on a 2-node netsim link at comm = compute, backward waited
for the previous bucket 24-43 ms a step).

On gloo the bytes change too. Each slice of a bucket has one owner, yet DeepSpeed all-reduces the
whole bucket (`use_multi_rank_bucket_allreduce`, its default), or with that off reduces each
owner's slices with gloo's `reduce`, which moved more than an all-reduce of the same tensor
(netsim `collectives`, 2 nodes at 570 Mbit/s, 4.6 MB: reduce to rank 0 86 ms, all-reduce 68, each
rank sending the other its half 34). Here each rank sends every owner its slices (isend/irecv),
and the owner sums the ranks' copies in rank order (`_to_owners`, `_pairwise_reduce`): a
reduce-scatter's bytes, half an all-reduce's.

Everything it does not cover (offload, MoE, Muon, ZenFlow, reduce_scatter off, one ipg buffer)
runs DeepSpeed's own code, synchronously.
"""
from __future__ import annotations

import json
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from app.runtime.overlap import TRACE_ENV, bucket_elements

# Buckets whose collectives may be in flight at once, each holding an ipg buffer of its own.
# Backward waits only beyond this. Memory: at most PENDING_BUCKETS + 2 buffers of
# reduce_bucket_size elements beside DeepSpeed's two (a new one is made only when no spare is
# free: then each of ours is in a live slot or held by a bucket in flight); with the app's
# eighth-of-the-model buckets, three quarters of the model's gradients, on CPU only.
PENDING_BUCKETS = int(os.environ.get("DSPRETRAIN_ZERO2_PENDING", "4"))  # 2: DeepSpeed's depth


def overlap_zero2(engine, enabled: bool = True, ready=lambda name, obj: True,
                  pairwise: bool = True) -> str | None:
    """Patch ZeRO-2's optimizer where it applies (registry patch zero2_overlap, `enabled`); the
    start-up `gradients:` text (what runs, and why), or None where the accelerator has real
    streams (DeepSpeed's own overlap). `pairwise`: on gloo, the owners' slices sent point to
    point (gloo_pairwise), else DeepSpeed's collectives, launched asynchronously."""
    from deepspeed.accelerator import get_accelerator

    if not get_accelerator().resolves_data_dependency():
        return None
    opt = engine.optimizer
    dtype = str(engine.communication_data_type).removeprefix("torch.")
    why_not = _not_covered(opt) or (None if enabled else "--deepspeed-patches leaves it out")
    if not why_not and not ready("zero2_overlap", opt):
        why_not = "this DeepSpeed lacks what it reads"
    if why_not:
        return f"ZeRO-2's reduce buckets in {dtype}, each blocking backward in its hook " \
               f"(DeepSpeed's path, not overlapped: {why_not})"
    shrunk = _bucket_for_overlap(opt)
    patch = Zero2Overlap(opt, pairwise=pairwise)
    note = f"; reduce_bucket_size {shrunk:,} (the configured one held the whole model)" \
        if shrunk else ""
    return f"ZeRO-2's reduce buckets of <= {opt.reduce_bucket_size:,} elements in {dtype}, " \
           f"launched asynchronously during backward ({patch.describe_reduce()}) and " \
           f"completed when their ipg buffer is needed again{note}"


def _not_covered(opt) -> str | None:
    """Why this optimizer stays on DeepSpeed's path (None: the patch covers it)."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if not isinstance(opt, DeepSpeedZeroOptimizer) or not opt.partition_gradients:
        return f"{type(opt).__name__} is not DeepSpeed's ZeRO-2 optimizer"
    checks = [(opt.cpu_offload, "optimizer offload"), (opt.has_moe_layers, "MoE"),
              (opt.zenflow, "ZenFlow"), (not opt.contiguous_gradients, "contiguous_gradients off"),
              (not opt.overlap_comm, "overlap_comm off: one ipg buffer"),
              (not opt.reduce_scatter, "reduce_scatter off: one blocking all-reduce a bucket"),
              (opt.sequence_parallel_size > 1, "sequence parallel"),
              (uses_muon(opt), "the Muon optimizer"),
              (_correctness_test(), "DeepSpeed's pg_correctness_test")]
    return next((why for bad, why in checks if bad), None)


def uses_muon(opt) -> bool:
    """DeepSpeed's Muon (as its ZeRO optimizers test for it): its update orthogonalises each
    matrix's whole gradient, so every rank needs whole reduced gradients, not a partition's."""
    return "muon" in type(opt.optimizer).__name__.lower()


def _correctness_test() -> bool:
    from deepspeed.runtime.zero import stage_1_and_2

    return bool(stage_1_and_2.pg_correctness_test)


def _bucket_for_overlap(opt) -> int | None:
    """A reduce bucket at least the model's size is reduced once, at the end of backward:
    nothing to overlap. Then take the app's reducer's size (an eighth of the model, app.runtime
    .overlap); a smaller configured bucket is kept. Returns the new size, if changed."""
    total = sum(p.numel() for group in opt.bit16_groups for p in group if p.requires_grad)
    if opt.reduce_bucket_size < total:
        return None
    opt.reduce_bucket_size = bucket_elements(total)
    return opt.reduce_bucket_size


@dataclass
class _Launched:
    """One launched bucket: its deferred completions (run in order), its collectives, and the
    ipg buffer its gradients still live in until the completions have run."""
    completions: list[Callable[[], None]] = field(default_factory=list)
    works: list = field(default_factory=list)
    buffer: object = None

    def done(self) -> bool:
        return _completed(self.works)


class Zero2Overlap:
    """The patch on one DeepSpeedZeroOptimizer (module docstring). `pending` holds the launched
    buckets not yet completed, oldest first; `spares`, ipg buffers free for a refill."""

    def __init__(self, opt, pairwise: bool = True):
        self.opt = opt
        self.pending: deque[_Launched] = deque()
        self.deferring: _Launched | None = None
        self.spares: list = []
        self.trace_path = os.environ.get(TRACE_ENV)
        self.events: list[tuple[str, int, float]] = []
        self.works: list[list] = []  # each launch's collectives, this backward (trace only)
        self.launched = 0
        self.deepest = 0  # the most buckets in flight at once this backward (trace only)
        import torch.distributed as tdist

        self.pairwise = pairwise and tdist.get_backend(opt.dp_process_group) == "gloo"
        self.originals = {name: getattr(opt, name) for name in (
            "allreduce_and_copy", "allreduce_and_copy_with_multiple_ranks",
            "reduce_independent_p_g_buckets_and_remove_grads")}
        opt.reduce_ipg_grads = self.reduce_ipg_grads
        opt.allreduce_and_copy = self.allreduce_and_copy
        opt.allreduce_and_copy_with_multiple_ranks = self.allreduce_and_copy_with_multiple_ranks
        opt.reduce_independent_p_g_buckets_and_remove_grads = self.gradient_ready
        opt.app_zero2_overlap = self

    # -- the hooks ----------------------------------------------------------------------------

    def gradient_ready(self, param, i):
        """DeepSpeed's per-gradient hook body; traced: which launched collectives are still in
        flight while backward produces this gradient."""
        if self.trace_path:
            now = time.perf_counter()
            self.events.append(("ready", -1, now))
            self.events += [("in_flight", k, now) for k, works in enumerate(self.works)
                            if not _completed(works)]
        return self.originals["reduce_independent_p_g_buckets_and_remove_grads"](param, i)

    def reduce_ipg_grads(self, comm_dtype=None):
        """A full bucket of `comm_dtype` (from the hook), or an oversized gradient (which
        DeepSpeed keeps outside the ipg buffers): launched, its completion deferred. Without a
        dtype (the end of backward) every dtype's last bucket is launched behind the ones in
        flight, and then all of them are completed, oldest first."""
        from deepspeed.runtime.torch_autocast import sort_dtypes

        opt = self.opt
        if comm_dtype is None:
            for dtype in sort_dtypes(opt.ipg_buckets.keys()):
                if opt.ipg_buckets[dtype].elements:
                    self._launch_bucket(dtype)
            self.complete_all(end=True)
            self._write_trace()
            return
        bucket = self._launch_bucket(comm_dtype)
        self._complete_done()
        # the caller swaps to the other ipg buffer next: if a bucket in flight still reads it,
        # that bucket keeps it and the refill goes to a spare
        other = 1 - bucket.index
        if any(p.buffer is bucket.buffer[other] for p in self.pending):
            while len(self.pending) >= PENDING_BUCKETS:
                self._complete_oldest()
            if any(p.buffer is bucket.buffer[other] for p in self.pending):
                bucket.buffer[other] = self._spare(bucket.buffer[other])

    def _launch_bucket(self, comm_dtype):
        """Launch the ipg bucket of `comm_dtype` (its buffer's filled part, or the one oversized
        gradient it holds, reduced in place as DeepSpeed does), its completion deferred; returns
        the bucket, cleared."""
        opt = self.opt
        bucket = opt.ipg_buckets[comm_dtype]
        params = list(bucket.params)
        oversized = opt.extra_large_param_to_reduce.pop(comm_dtype, None)
        if oversized is not None:
            assert len(params) == 1, "an oversized gradient shares its bucket"
            buffer, tensor = None, opt.get_gradient_for_reduction(oversized).view(-1)
        else:
            buffer = bucket.buffer[bucket.index]
            tensor = buffer.narrow(0, 0, bucket.elements)
        launched = self.deferring = _Launched(buffer=buffer)
        try:
            opt.average_tensor(tensor, comm_dtype)
        finally:
            self.deferring = None
        launched.completions.append(lambda: self._epilogue(params))
        bucket.clear()
        self.pending.append(launched)
        self.deepest = max(self.deepest, len(self.pending))
        return bucket

    def describe_reduce(self) -> str:
        return ("each slice sent to its owner only" if self.pairwise
                else "DeepSpeed's collectives")

    def _epilogue(self, params) -> None:
        """reduce_ipg_grads' epilogue at ZeRO-2 for one reduced bucket: owned gradients into the
        partition, the others dropped."""
        opt = self.opt
        for group_idx, param_idx_in_group, param_id in params:
            param = opt.bit16_groups[group_idx][param_idx_in_group]
            assert not opt.params_already_reduced[param_id], "a gradient reduced twice"
            opt.params_already_reduced[param_id] = True
            if not opt.is_param_in_current_partition[param_id]:
                opt.clear_grad_attribute(param)
            else:
                opt.copy_grads_in_partition(param, group_idx)

    def complete_all(self, end: bool = False) -> None:
        """Run every deferred completion, oldest first (`end`: backward has ended, traced)."""
        if end and self.trace_path:
            self.events.append(("backward_end", -1, time.perf_counter()))
        while self.pending:
            self._complete_oldest()

    def _complete_done(self) -> None:
        """Complete, oldest first, the buckets whose collectives have finished (gloo's send and
        receive report completion only once waited for: those wait for the limit or the end)."""
        while self.pending and self.pending[0].done():
            self._complete_oldest()

    def _complete_oldest(self) -> None:
        launched = self.pending.popleft()
        for completion in launched.completions:
            completion()
        live = [b for bucket in self.opt.ipg_buckets.values() for b in bucket.buffer]
        if launched.buffer is not None and all(b is not launched.buffer for b in live) \
                and len(self.spares) < PENDING_BUCKETS:
            self.spares.append(launched.buffer)  # its gradients have moved out: reusable

    def _spare(self, like):
        """A free ipg buffer shaped as `like` (one let go by a completed bucket, else new)."""
        for i, b in enumerate(self.spares):
            if b.shape == like.shape and b.dtype == like.dtype and b.device == like.device:
                return self.spares.pop(i)
        import torch

        return torch.empty_like(like)

    # -- the collectives ----------------------------------------------------------------------

    def allreduce_and_copy(self, small_bucket, communication_data_type, rank=None, log=None,
                           divide=True, process_group=None, output_bucket=None):
        """DeepSpeed's allreduce_and_copy (a reduce to `rank`, or an all-reduce), asynchronous
        inside a deferred bucket: the copy back into the bucket happens at completion."""
        if self.deferring is None:
            return self.originals["allreduce_and_copy"](
                small_bucket, communication_data_type, rank=rank, log=log, divide=divide,
                process_group=process_group, output_bucket=output_bucket)
        from deepspeed import comm as dist

        opt = self.opt
        opt._clear_previous_reduced_grads()  # as DeepSpeed does with overlap_comm
        group = opt.dp_process_group if process_group is None else process_group
        result = self._launch(small_bucket, communication_data_type, rank, divide, group)
        outputs = output_bucket or [None] * len(small_bucket)
        mine = rank is None or rank == dist.get_rank(group=group)
        self.deferring.completions.append(
            lambda: self._copy_back(result(), small_bucket, outputs, [mine] * len(small_bucket)))

    def allreduce_and_copy_with_multiple_ranks(self, small_bucket, communication_data_type,
                                               log=None, divide=True, process_group=None,
                                               bucket_ranks=None, output_bucket=None):
        """DeepSpeed's all-reduce of a multi-rank bucket, asynchronous inside a deferred bucket
        (average_tensor is called from reduce_ipg_grads only, which always defers): each slice
        is copied back, at completion, on the rank(s) that own it. On gloo with one owner a
        slice, each slice goes to its owner only."""
        from deepspeed import comm as dist

        if self.deferring is None:
            return self.originals["allreduce_and_copy_with_multiple_ranks"](
                small_bucket, communication_data_type, log=log, divide=divide,
                process_group=process_group, bucket_ranks=bucket_ranks,
                output_bucket=output_bucket)
        group = self.opt.dp_process_group if process_group is None else process_group
        owners = [_single(r) for r in bucket_ranks]
        to_owners = self.pairwise and None not in owners
        result = self._launch(small_bucket, communication_data_type,
                              owners if to_owners else None, divide, group)
        me = dist.get_rank(group=group)
        mine = [me in r if isinstance(r, frozenset) else me == r for r in bucket_ranks]
        outputs = output_bucket or [None] * len(small_bucket)
        self.deferring.completions.append(
            lambda: self._copy_back(result(), small_bucket, outputs, mine))

    def _launch(self, small_bucket, comm_dtype, rank, divide, group) -> Callable:
        """DeepSpeed's allreduce_bucket with async_op; returns what waits for it and gives the
        reduced tensor (in the communication dtype, as allreduce_bucket returns it). `rank`:
        None (an all-reduce), the group rank a reduce goes to, or a list, each slice's owner
        (gloo: each slice sent to its owner only; the reduced values are right in the owner's
        slices only, the only ones DeepSpeed reads)."""
        from deepspeed import comm as dist

        opt = self.opt
        tensor = opt.flatten(small_bucket)
        sent = tensor.to(comm_dtype) if comm_dtype != tensor.dtype else tensor
        if divide and opt.gradient_average:
            sent.div_(dist.get_world_size(group=group) / float(opt.sequence_parallel_size))
        k = self.launched
        self.launched += 1
        if rank is None:
            works, finish = [dist.all_reduce(sent, group=group, async_op=True)], None
        elif isinstance(rank, list):
            works, finish = self._to_owners(sent, [t.numel() for t in small_bucket], rank,
                                            group, tag=k)
        elif self.pairwise:
            works, finish = self._pairwise_reduce(sent, rank, group, tag=k)
        else:
            works, finish = [dist.reduce(sent, dist.get_global_rank(group, rank), group=group,
                                         async_op=True)], None
        assert self.deferring is not None  # both callers launch inside a deferred bucket only
        self.deferring.works += works
        if self.trace_path:  # a Work holds its tensor: kept past completion only when tracing
            self.works.append(works)
            self.events.append(("launch", k, time.perf_counter()))

        def result():
            for work in works:
                work.wait()
            if finish is not None:
                finish()
            if self.trace_path:
                self.events.append(("done", k, time.perf_counter()))
            if sent is not tensor and (rank is None or isinstance(rank, list)
                                       or rank == dist.get_rank(group=group)):
                tensor.copy_(sent)
            return sent

        return result

    @staticmethod
    def _pairwise_reduce(sent, owner: int, group, tag: int):
        """A reduce of `sent` to group rank `owner` as point-to-point messages: every other rank
        sends its tensor to the owner, which sums them all in rank order into `sent` (`finish`,
        after the works). Each rank's bytes are its slices for the other owners: a
        reduce-scatter's, (N-1)/N of the bucket."""
        import torch
        import torch.distributed as tdist

        me, world = tdist.get_rank(group=group), tdist.get_world_size(group=group)
        if me != owner:
            return [tdist.isend(sent, dst=tdist.get_global_rank(group, owner), group=group,
                                tag=tag)], None
        received = {r: torch.empty_like(sent) for r in range(world) if r != me}
        works = [tdist.irecv(buf, src=tdist.get_global_rank(group, r), group=group, tag=tag)
                 for r, buf in received.items()]

        def finish() -> None:
            total = _rank_order_sum([sent if r == me else received[r] for r in range(world)])
            if total is not sent:
                sent.copy_(total)

        return works, finish

    @staticmethod
    def _to_owners(sent, sizes: list[int], owners: list[int], group, tag: int):
        """A bucket of slices (`sizes`, in order, slice i owned by group rank `owners[i]`)
        reduced where it is needed: each rank sends every other owner that owner's slices (one
        message, concatenated) and receives its own from every other rank; `finish` sums them
        in rank order into this rank's slices of `sent`. A reduce-scatter's bytes, where an
        all-reduce of the bucket moves twice as many."""
        import torch
        import torch.distributed as tdist

        me, world = tdist.get_rank(group=group), tdist.get_world_size(group=group)
        spans: dict[int, list[tuple[int, int]]] = {}
        start = 0
        for n, owner in zip(sizes, owners):
            spans.setdefault(owner, []).append((start, n))
            start += n

        def gathered(r: int):
            pieces = [sent.narrow(0, a, n) for a, n in spans[r]]
            return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

        works = [tdist.isend(gathered(r), dst=tdist.get_global_rank(group, r), group=group,
                             tag=tag) for r in range(world) if r != me and r in spans]
        if me not in spans:
            return works, None
        own = gathered(me)
        received = {r: torch.empty_like(own) for r in range(world) if r != me}
        works += [tdist.irecv(buf, src=tdist.get_global_rank(group, r), group=group, tag=tag)
                  for r, buf in received.items()]

        def finish() -> None:
            total = _rank_order_sum([own if r == me else received[r] for r in range(world)])
            offset = 0
            for a, n in spans[me]:
                sent.narrow(0, a, n).copy_(total.narrow(0, offset, n))
                offset += n

        return works, finish

    def _copy_back(self, reduced, small_bucket, outputs, mine) -> None:
        opt = self.opt
        for buf, synced, output, own in zip(small_bucket, opt.unflatten(reduced, small_bucket),
                                            outputs, mine):
            if own:
                opt._add_to_grad_partition_buffer(output, synced)
                buf.copy_(synced)

    def _write_trace(self) -> None:
        """One line a backward into `$DSPRETRAIN_TEST_OVERLAP_TRACE.rankN` (tests)."""
        if self.trace_path and self.works:
            from deepspeed import comm as dist

            with open(f"{self.trace_path}.rank{dist.get_rank()}", "a") as f:
                f.write(json.dumps({"collectives": len(self.works), "in_flight_max": self.deepest,
                                    "events": self.events}) + "\n")
        self.events, self.works, self.launched, self.deepest = [], [], 0, 0


def _completed(works: list) -> bool:
    """Every collective of one launched reduction has completed (gloo's send and receive report
    it only once waited for)."""
    return all(work.is_completed() for work in works)


def _single(ranks) -> int | None:
    """The one rank a slice goes to (DeepSpeed's bucket_ranks entry), None for several."""
    if isinstance(ranks, frozenset):
        return next(iter(ranks)) if len(ranks) == 1 else None
    return int(ranks)


def _rank_order_sum(pieces: list):
    """The ranks' copies summed in rank order (the same bits on every run), into the first: rank
    0's, this rank's own or a receive buffer, either free to be summed into."""
    total = pieces[0]
    for piece in pieces[1:]:
        total.add_(piece)
    return total

