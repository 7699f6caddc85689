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

At ZeRO-1 each rank steps only its own partition of the flat gradient, so `PartitionReducer`
reduce-scatters instead: (N-1)/N of the gradient leaves each rank, half an all-reduce's
2(N-1)/N. Gloo's `reduce_scatter_tensor` moves an all-reduce's bytes (measured over loopback,
torch 2.13: 2.0x the tensor either way), so on gloo the scatter is a pairwise exchange of the
pieces (isend/irecv on the group's existing connections) summed on the owner in rank order;
NCCL runs its own reduce-scatter.
"""
from __future__ import annotations

import json
import os
import time
from bisect import bisect_right
from typing import Callable, Iterable, NamedTuple

import torch
import torch.distributed as dist

# DDP's default bucket (25 MB of fp32), and at least this many buckets when the model is small
# enough that one bucket would hold it all: one bucket overlaps nothing.
MAX_BUCKET_ELEMENTS = 25 * 2**20 // 4
MIN_BUCKET_ELEMENTS = 2**16
TARGET_BUCKETS = 8
# Test instrumentation (tests/test_overlap.py, bench/overlap_timeline.py): a file each rank
# appends its reducer's events to. (DeepSpeed's own reduction instead of the app's, or the
# all-reduce reducer at ZeRO-1 instead of the reduce-scatter one: --deepspeed-patches
# all,-grad_overlap,-partition_reduce or all,-partition_reduce; app.runtime.registry.)
TRACE_ENV = "DSPRETRAIN_TEST_OVERLAP_TRACE"
# Test switch: ZeRO-1/2's optimizer groups in this many layer blocks (1: the two groups of
# checkpoints written before the blocks; tests/test_zero_switch.py makes such checkpoints). A
# layout, not a patch: it changes what a checkpoint holds.
BLOCKS_ENV = "DSPRETRAIN_TEST_PARTITION_BLOCKS"


# ZeRO-1/2 partition each optimizer group's flat buffer once across the ranks, so with one group
# for the whole model rank 0's partition is the model's first half, whose gradients come last:
# no reduce-scatter bucket can start before backward's second half (PartitionReducer). The app
# hands them the parameters in this many blocks of consecutive layers instead, each a group (two:
# with and without weight decay) partitioned on its own
# (app.runtime.param_groups.optimizer_groups): a block's buckets start once backward has passed
# it, and the next forward's weight gather arrives block by block (app.runtime.gather). Megatron's
# distributed optimizer shards per bucket for the same reason. docs/design.md, "ZeRO-1/2 in layer
# blocks".
PARTITION_BLOCKS = TARGET_BUCKETS


def partition_blocks(zero_stage: int) -> int:
    """How many layer blocks a run at `zero_stage` groups its parameters in: PARTITION_BLOCKS
    where ZeRO partitions flat groups (1, 2), else 1 (ZeRO-0 holds whole tensors, ZeRO-3
    partitions each parameter on its own)."""
    if zero_stage not in (1, 2):
        return 1
    return int(os.environ.get(BLOCKS_ENV) or PARTITION_BLOCKS)


def block_starts(sizes: list[int], blocks: int) -> list[int]:
    """Where each of at most `blocks` runs of consecutive items (sizes in order) starts: a run
    closes once it holds an equal share of what the earlier runs left, so a parameter larger
    than a share (an embedding) is a run of its own and the rest still make `blocks` runs."""
    starts, size, left = [0], 0, sum(sizes)
    for i, n in enumerate(sizes):
        if i > starts[-1] and len(starts) < blocks and size * (blocks - len(starts) + 1) >= left:
            starts.append(i)
            left -= size
            size = 0
        size += n
    return starts


def bucket_elements(total: int) -> int:
    """Elements a bucket: an eighth of the model, within [64 Ki, DDP's 25 MB of fp32]."""
    return max(MIN_BUCKET_ELEMENTS, min(MAX_BUCKET_ELEMENTS, total // TARGET_BUCKETS))


# -- sizing by world size (the reducer's buckets, the gather's chunks, and the plan's) -----------

MIN_PIECE_BYTES = 256 * 2**10
"""The least a reduce-scatter bucket or a weight gather chunk moves per rank, where the world
would cut it smaller (`packs`). NCCL's reduce-scatter and all-gather are rings: N - 1 steps,
each moving one rank's piece of s bytes and paying the per-hop latency a, so the link is busy
s/B of every a + s/B. At 25 Gb/s (3.1 GB/s of payload) 256 KiB is 84 us a hop: 74% of the link
at the plan's 25gbe latency of 30 us, 81-89% at 10-20 us; bert-120m's 6,400-element fp32 pieces
(25.6 KB) at 1,024 ranks take 8.2 us, 21%: each of its 27 reduce-scatters a step ran at a fifth
of the link (review gpu-path-2, M-7). The review's 1 MB (335 us, 92%) costs overlap instead:
fewer buckets, the last one complete only at backward's end. The plan (`app plan --model
bert-120m --seq-len 512 --micro-batch 16 --gpu H100-SXM --gpus-per-node 8`, bf16, step ms):
at 32 nodes on 25 Gb/s 233.5 unpacked, 218.0 at 256 KiB, 220.8 at 1 MB (fp32 ZeRO-1: 304.0,
291.9, 303.0); at 128 nodes 319.1, then 231.5 at either (fp32: 391.2, 315.3), at 100 Gb/s
127.1 -> 72.4. At 400 Gb/s (a = 3 us) it costs: 27.5 -> 29.0 at 128 nodes (fp32 38.7 ->
47.7), the one bucket left hiding nothing behind backward where the plan counts a call's
latency as 127 inter-node hops; 128 KiB would lose less there (26.2, 40.9) and up to 6% more
at 25-100 Gb/s. In bytes, not elements: the gather's bf16 weights get twice the fp32 gradients'
elements."""


def piece_floor(element_size: int) -> int:
    """MIN_PIECE_BYTES in elements of `element_size` bytes (fp32: 65,536; bf16: 131,072)."""
    return max(1, MIN_PIECE_BYTES // element_size)


def packs(bucket_size: int, world_size: int, floor: int) -> bool:
    """Whether the world, not the model, makes pieces latency-bound: the reducer's piece of a
    bucket, `bucket_size // world_size` elements a rank, is below `floor`. Then the reducer's
    buckets are cut from the optimizer groups' partitions run together, and the gather packs
    whole groups into chunks (`bucket_pieces`, `gather_chunks`), each at least `floor` a rank.
    Below that world nothing changes: each group is cut on its own, and its last piece and the
    small groups (a block's biases and norms: 384-1,768 elements a rank for the netsim model at
    2 ranks) stay buckets of their own: a few rings, each of few hops at such a world."""
    return bucket_size // world_size < floor


def bucket_pieces(parts: list[int], world_size: int, bucket_size: int,
                  floor: int = 1) -> list[list[tuple[int, int, int]]]:
    """The reduce-scatter buckets of groups whose per-rank partitions are `parts` elements long:
    each bucket's pieces as (group, start in the group's partition, length), the same on every
    rank (rank r's region of a bucket is its pieces in this order).

    Where the world leaves pieces of `bucket_size // world_size` at least `floor` (`packs`),
    bucket (g, c) is piece c of group g's partition, as before there was a floor. Else the
    partitions are run together, group after group, and cut into n = (their sum // floor)
    equal runs, the last taking the remainder: every bucket at least `floor` a rank (one bucket
    where the whole share is below it), a bucket spanning groups where they are short.
    bert-120m's 15 groups (vocab 30,522) at 1,024 ranks: 106,956 elements a rank, one bucket of
    fp32 gradients, not 27 pieces of at most 6,400 elements; at 256 ranks six of 71,299."""
    piece = max(1, bucket_size // world_size)
    if not packs(bucket_size, world_size, floor):
        return [[(g, start, min(piece, part - start))] for g, part in enumerate(parts)
                for start in range(0, part, piece)]
    total = sum(parts)
    n = max(1, total // floor)
    ends = [(b + 1) * (total // n) for b in range(n - 1)] + [total]
    buckets: list[list[tuple[int, int, int]]] = [[] for _ in ends]
    b, at = 0, 0  # at: the position of group g's partition in the run of them all
    for g, part in enumerate(parts):
        start = 0
        while start < part:
            while at + start >= ends[b]:
                b += 1
            n_here = min(part - start, ends[b] - at - start)
            buckets[b].append((g, start, n_here))
            start += n_here
        at += part
    return [bucket for bucket in buckets if bucket]


def gather_chunks(parts: list[int], floor: int) -> list[list[int]]:
    """The weight gather's chunks where it packs (`packs`), each a list of groups: consecutive
    groups (whole partitions, `parts` elements a rank) run together until a chunk holds at least
    `floor` a rank, and a last chunk short of it joins the one before (a group that long that
    starts a chunk is one alone, as without packing). bert-120m's 15 groups in bf16: one chunk
    at 1,024 ranks, three at 256."""
    chunks: list[list[int]] = []
    filled = 0
    for g, part in enumerate(parts):
        if not chunks or filled >= floor:
            chunks.append([])
            filled = 0
        chunks[-1].append(g)
        filled += part
    if len(chunks) > 1 and filled < floor:
        last = chunks.pop()
        chunks[-1] += last
    return chunks


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


def write_trace(path: str | None, buckets: int, events: list) -> None:
    """One line per reduced step in the rank's trace file (tests/test_overlap.py)."""
    if path:
        with open(f"{path}.rank{dist.get_rank()}", "a") as f:
            f.write(json.dumps({"buckets": buckets, "events": events}) + "\n")


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
        write_trace(self.trace_path, len(self.buckets), self.events)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


# -- ZeRO-1: reduce-scatter into the rank's own partition -----------------------------------------

class Segment(NamedTuple):
    """Part of a parameter's gradient inside one bucket: elements [start, start + length) of the
    flattened gradient go to bucket position `at` (partition r's region of the bucket starts
    at r x the bucket's per-rank length; within it, its pieces in the bucket's order)."""
    bucket: int
    partition: int
    at: int
    start: int
    length: int


class FlatGroup(NamedTuple):
    """One of DeepSpeed's flat parameter groups: its parameters with their element offsets in
    the flat buffer, and the flat's length (padded to a multiple of the world size)."""
    params: list
    offsets: list[int]
    numel: int


def flat_group(params: list, flat: torch.Tensor, partitions: list) -> FlatGroup | None:
    """The layout of `params`, whose data DeepSpeed made views of `flat` (its padding between
    and after them included); None unless `partitions` are equal consecutive slices of it all
    (then a reduce-scatter's pieces line up with them)."""
    size, part = flat.element_size(), partitions[0].numel()
    if part * len(partitions) != flat.numel() or any(
            q.numel() != part or q.data_ptr() != flat.data_ptr() + r * part * size
            for r, q in enumerate(partitions)):
        return None
    offsets = [(p.data_ptr() - flat.data_ptr()) // size for p in params]
    if any(o < 0 or o + p.numel() > flat.numel() for o, p in zip(offsets, params)):
        return None
    return FlatGroup(params, offsets, flat.numel())


def partition_buckets(groups: list[FlatGroup], world_size: int, bucket_size: int,
                      min_piece: int = 1):
    """Buckets of equal pieces of every rank's partition (`bucket_pieces`: piece c of group g,
    `bucket_size // world_size` elements, or where that is below `min_piece`, the partitions
    run together and cut in runs of at least `min_piece`), so a reduce-scatter of a bucket
    hands rank r its own pieces. Rank r's region of bucket b starts at r x lengths[b] and holds
    its pieces in the bucket's order. Returns each bucket's per-rank length and every
    parameter's segments, bucket indices in the order of the groups' pieces."""
    parts = [group.numel // world_size for group in groups]
    buckets = bucket_pieces(parts, world_size, bucket_size, min_piece)
    lengths = [sum(n for _, _, n in pieces) for pieces in buckets]
    cuts: list[list[tuple[int, int, int, int]]] = [[] for _ in groups]  # (start, bucket, at, n)
    for b, pieces in enumerate(buckets):
        at = 0
        for g, start, n in pieces:
            cuts[g].append((start, b, at, n))
            at += n
    segments: dict[int, list[Segment]] = {}
    for g, group in enumerate(groups):
        part, starts = parts[g], [cut[0] for cut in cuts[g]]
        for p, offset in zip(group.params, group.offsets):
            pos, end = offset, offset + p.numel()
            while pos < end:
                r, within = divmod(pos, part)
                start, b, at, length = cuts[g][bisect_right(starts, within) - 1]
                n = min(end - pos, start + length - within)
                segments.setdefault(id(p), []).append(
                    Segment(b, r, r * lengths[b] + at + within - start, pos - offset, n))
                pos += n
    return lengths, segments


def launch_order(lengths: list[int], segments: dict[int, list[Segment]],
                 order: list) -> list[int]:
    """Buckets by when backward completes them: a bucket is complete when the gradient it needs
    that backward reaches last is in (backward runs the parameters in reverse registration
    order). Ties keep (group, piece) order reversed: later pieces are later in the model."""
    position = {id(p): i for i, p in enumerate(reversed(order))}
    ready_at = [-1] * len(lengths)
    for pid, segs in segments.items():
        for seg in segs:
            ready_at[seg.bucket] = max(ready_at[seg.bucket], position.get(pid, len(position)))
    return sorted(range(len(lengths)), key=lambda b: (ready_at[b], -b))


class PartitionReducer:
    """ZeRO-1's gradients reduce-scattered in buckets during backward: each rank gets the sum
    (or, `average`, the pre-divided sum) of its own partition only, written where DeepSpeed's
    step reads it (`grad_of`: `param.grad`, or BF16_Optimizer's fp32 buffer); the rest of each
    gradient stays this rank's own, unreduced, and must not be read after `finish`.

    A bucket is piece c of every rank's partition of one flat group (`partition_buckets`), the
    layout a reduce-scatter needs. What that costs: a bucket is complete only when its piece of
    the group's FIRST partition is, and backward reaches it last. With one group for the whole
    model nothing could launch before backward has done (N-1)/N of it; the app's groups are
    layer blocks (`partition_blocks`), so that holds within a block only and the last block's
    buckets launch once backward has passed it. Sending each piece to its owner as soon as it
    is ready would start earlier but make all ranks send to one owner at a time (incast: (N-1)x
    slower links at scale).
    Buckets are launched in the order backward completes them (`launch_order`), the same on
    every rank.

    At a world that would cut pieces below `min_piece` (default: MIN_PIECE_BYTES of the wire
    dtype where the bucket size is the default; none where the caller sizes the buckets), the
    groups' partitions are packed instead, a bucket spanning groups (`bucket_pieces`): a few
    buckets, each moving at least the floor a rank, rather than one latency-bound ring per
    piece.
    """

    def __init__(self, groups: list[FlatGroup], order: list, *, group, world_size: int,
                 comm_dtype: torch.dtype, is_boundary: Callable[[], bool], average: bool,
                 grad_of: Callable[[torch.nn.Parameter], torch.Tensor | None] | None = None,
                 bucket_size: int | None = None, pairwise: bool = True,
                 min_piece: int | None = None):
        self.group, self.world_size, self.comm_dtype = group, world_size, comm_dtype
        self.is_boundary, self.average = is_boundary, average
        self.grad_of = grad_of or (lambda p: p.grad)
        self.rank = dist.get_rank(group)
        self.peers = [r if group is None else dist.get_global_rank(group, r)
                      for r in range(world_size)]
        # gloo: point-to-point exchanges (registry patch gloo_pairwise); else reduce_scatter_tensor,
        # NCCL's (with pairwise=False on gloo: that branch's code, in the tests)
        self.pairwise = pairwise and dist.get_backend(group) == "gloo"
        self.bucket_size = bucket_size or bucket_elements(sum(g.numel for g in groups))
        if min_piece is None:
            min_piece = 1 if bucket_size else piece_floor(comm_dtype.itemsize)
        self.min_piece, self.n_groups = min_piece, len(groups)
        self.packed = packs(self.bucket_size, world_size, min_piece)
        lengths, segments = partition_buckets(groups, world_size, self.bucket_size, min_piece)
        new = {b: i for i, b in enumerate(launch_order(lengths, segments, order))}
        self.lengths = [lengths[b] for b in sorted(new, key=lambda b: new[b])]
        self.segments = {pid: [seg._replace(bucket=new[seg.bucket]) for seg in segs]
                         for pid, segs in segments.items()}
        params = [p for g in groups for p in g.params if id(p) in self.segments]
        self.members: list[list] = [[] for _ in self.lengths]  # (param, segment) per bucket
        for p in params:
            for seg in self.segments[id(p)]:
                self.members[seg.bucket].append((p, seg))
        self.needed = [len({id(p) for p, _ in m}) for m in self.members]
        device = params[0].device
        self.flats = [torch.zeros(world_size * n, dtype=comm_dtype, device=device)
                      for n in self.lengths]  # padding stays zero
        self.received = [torch.empty(world_size * n if self.pairwise else 0, dtype=comm_dtype,
                                     device=device) for n in self.lengths]
        self.outs = [torch.empty(n, dtype=comm_dtype, device=device) for n in self.lengths]
        self.trace_path = os.environ.get(TRACE_ENV)
        self._reset()
        self._handles = [p.register_post_accumulate_grad_hook(self._ready) for p in params]

    def _reset(self) -> None:
        self.filled: list[set[int]] = [set() for _ in self.lengths]
        self.works: list[list] = []
        self.stale: set[int] = set()
        self.events: list[tuple[str, int, float]] = []

    def describe(self) -> str:
        how = "pairwise over gloo" if self.pairwise else "reduce_scatter"
        size = f"of <= {self.bucket_size:,} elements"
        if self.packed:
            low, high = min(self.lengths), max(self.lengths)
            size = (f"of {low:,}{f'-{high:,}' if high > low else ''} elements a rank (the "
                    f"{self.n_groups} optimizer groups' partitions run together and cut at "
                    f"least {self.min_piece:,} a rank: at {self.world_size} ranks pieces of "
                    f"{self.bucket_size:,}-element buckets, "
                    f"{self.bucket_size // self.world_size:,} a rank, would be latency-bound)")
        return (f"{len(self.lengths)} bucket(s) {size}, "
                f"reduce-scattered ({how}) in {str(self.comm_dtype).removeprefix('torch.')} "
                f"during backward: {self.world_size - 1}/{self.world_size} of the gradient "
                f"sent, half an all-reduce")

    # -- during backward ----------------------------------------------------------------------

    def _ready(self, param: torch.nn.Parameter) -> None:
        """A gradient is final for this backward: its pieces into their buckets; launch, in
        order, the buckets that are complete."""
        grad = self.grad_of(param) if self.is_boundary() else None
        if grad is None:
            return
        for seg in self.segments[id(param)]:
            if seg.bucket < len(self.works):  # accumulated again after its bucket was sent:
                self.stale.add(seg.bucket)    # resent whole at finish (GradReducer)
            else:
                self._fill(seg, grad)
                self.filled[seg.bucket].add(id(param))
        if self.trace_path:
            now = time.perf_counter()
            self.events.append(("ready", self.segments[id(param)][0].bucket, now))
            self.events += [("in_flight", b, now) for b, works in enumerate(self.works)
                            if not all(w.is_completed() for w in works)]
        self._launch_ready()

    def _fill(self, seg: Segment, grad: torch.Tensor | None) -> None:
        view = self.flats[seg.bucket].narrow(0, seg.at, seg.length)
        if grad is None:
            view.zero_()
            return
        src = grad.reshape(-1).narrow(0, seg.start, seg.length)
        if not self.average:
            view.copy_(src)
        elif src.dtype == view.dtype:
            torch.mul(src, 1.0 / self.world_size, out=view)
        else:
            view.copy_(src / self.world_size)

    def _launch_ready(self) -> None:
        while len(self.works) < len(self.lengths) and \
                len(self.filled[len(self.works)]) == self.needed[len(self.works)]:
            b = len(self.works)
            self.works.append(self._send(b))
            self.events.append(("launch", b, time.perf_counter()))

    def _send(self, b: int) -> list:
        """Start bucket b's reduce-scatter: NCCL's own; on gloo (whose reduce-scatter is an
        all-reduce) each rank sends every other rank that rank's piece and receives its own."""
        if not self.pairwise:
            return [dist.reduce_scatter_tensor(self.outs[b], self.flats[b], group=self.group,
                                               async_op=True)]
        n, works = self.lengths[b], []
        for r in range(self.world_size):
            if r != self.rank:
                works.append(dist.isend(self.flats[b].narrow(0, r * n, n), dst=self.peers[r],
                                        group=self.group, tag=b))
                works.append(dist.irecv(self.received[b].narrow(0, r * n, n),
                                        src=self.peers[r], group=self.group, tag=b))
        return works

    # -- after backward -----------------------------------------------------------------------

    def finish(self) -> None:
        """Where DeepSpeed would reduce: gradients whose hook did not fire go in (zeros where
        there is none), every bucket is waited for, and this rank's pieces are written back."""
        self.events.append(("backward_end", -1, time.perf_counter()))
        for b in range(len(self.works), len(self.lengths)):
            for p, seg in self.members[b]:
                if id(p) not in self.filled[b]:
                    self._fill(seg, self.grad_of(p))
                    self.filled[b].add(id(p))
        self._launch_ready()
        for b, works in enumerate(self.works):
            for work in works:
                work.wait()
            self.events.append(("done", b, time.perf_counter()))
            if b in self.stale:  # the same graph on every rank: the same stale buckets
                for p, seg in self.members[b]:
                    self._fill(seg, self.grad_of(p))
                for work in self._send(b):
                    work.wait()
            self._copy_back(b, self._summed(b))
        write_trace(self.trace_path, len(self.lengths), self.events)
        self._reset()

    def _summed(self, b: int) -> torch.Tensor:
        """This rank's piece of bucket b, reduced: the ranks' pieces summed in rank order."""
        if not self.pairwise:
            return self.outs[b]
        n = self.lengths[b]
        pieces = [(self.flats[b] if r == self.rank else self.received[b]).narrow(0, r * n, n)
                  for r in range(self.world_size)]
        out = torch.add(pieces[0], pieces[1], out=self.outs[b])
        for piece in pieces[2:]:
            out.add_(piece)
        return out

    def _copy_back(self, b: int, reduced: torch.Tensor) -> None:
        base = self.rank * self.lengths[b]
        for p, seg in self.members[b]:
            grad = self.grad_of(p)
            if seg.partition == self.rank and grad is not None:
                grad.view(-1).narrow(0, seg.start, seg.length).copy_(
                    reduced.narrow(0, seg.at - base, seg.length))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
