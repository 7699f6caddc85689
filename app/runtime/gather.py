"""ZeRO-1/2's weight all-gather, overlapped with the next forward (Megatron's overlapped
parameter gather).

After its optimizer step, DeepSpeed's ZeRO-1 and 2 (`DeepSpeedZeroOptimizer.step`; ZeRO-1 in bf16
through `BF16_Optimizer.update_lp_params`) all-gathers every rank's updated partition into the
flat weight buffers (`all_gather_dp_groups`) and blocks until it is done: half an all-reduce's
bytes, exposed every step (issue 21). Here that call launches the same bytes asynchronously
(gloo's threads on CPU, NCCL's stream on GPU: no host sync), cut into chunks, and returns; a
forward pre-hook on each module that owns parameters waits only for the chunks holding them.

Chunk order. A flat buffer is in parameter order, the order forward reads the weights, and rank
r's partition is flat[r*P:(r+1)*P]. An all-gather moves an equal piece of every partition, so
chunk c is piece c (elements [c*S, (c+1)*S)) of every partition, of every parameter group, and
the chunks are launched c = 0, 1, ...: forward reads partition 0 first, whose pieces then arrive
in the order it reads them; by the time it reaches partition 1, every chunk was needed by
partition 0 already and is in. No order does better: each chunk brings one piece of partition
0, so forward cannot get past piece c of partition 0 before c + 1 chunks are in.

Layer blocks (`by_group`: ZeRO-1/2 as the app builds them,
app.runtime.param_groups.optimizer_groups): each group holds a run of consecutive layers,
partitioned on its own, so chunk g is group g whole, launched in group order: forward finds block
b's weights in once b's chunks are, whatever the number of ranks (with one group for the model,
forward's first layers wait for a piece of every partition).

At a world where the groups' partitions are latency-bound (app.runtime.overlap.packs: the
reducer's pieces below MIN_PIECE_BYTES; bert-120m's 15 groups at 1,024 ranks hold 16-22,892
bf16 elements a rank, 32 B-45 KB), consecutive groups are packed into one chunk until it holds
MIN_PIECE_BYTES a rank (`gather_chunks`), and a chunk of several groups is ONE collective: each
rank copies its partitions of them into a staging buffer, one all-gather fills every rank's row
of it, and the wait copies the rows out into the groups' flat buffers (one strided copy a
group). Grouping alone would not do: each group is its own flat buffer, so its own call. Nor
would handing the step back to DeepSpeed: its `all_gather_dp_groups` (deepspeed/runtime/utils.py,
0.19.8) runs `all_gather_into_tensor` once per group too, blocking, so it keeps the 15 calls and
loses the overlap. The staging buffer is the chunk's groups' flat size, as the list all-gather's
own staging buffer is (below), and is let go at the wait.

On gloo a chunk is sent point to point (each rank its piece to every other, on the group's
connections): gloo's own all-gather took 1.45x as long as that exchange (netsim `collectives`, 2
nodes at 570 Mbit/s, 4.6 MB: 48.9 against 33.6 ms). NCCL runs its all-gather.

Everything else that reads or writes the weights sees them complete: `flush()` waits for every
chunk, and runs before the next optimizer step (its partition is the running gather's input),
after each forward of the whole model (a parameter read outside its module's forward), before a
checkpoint save or load, a state_dict, and at exit. Tied weights: the first module to use one
waits; the later ones find its chunks done. Only DeepSpeed's ZeRO-1 (fp32 and bf16) and ZeRO-2
with more than one data-parallel rank, no offload, no MoE or pipeline; elsewhere DeepSpeed's own
gather.
"""
from __future__ import annotations

import atexit
import functools
import json
import os
import time
import weakref
from typing import Callable

import torch
import torch.distributed as dist

from app.runtime import registry
from app.runtime.overlap import bucket_elements, gather_chunks, packs, partition_blocks, piece_floor

# Test instrumentation (tests/test_param_gather.py, bench/overlap_timeline.py): a file each rank
# appends its gather's events to. (DeepSpeed's own gather instead: --deepspeed-patches
# all,-param_gather.)
TRACE_ENV = "DSPRETRAIN_TEST_GATHER_TRACE"
_ACTIVE: dict[str, "ParamGather | None"] = {"gather": None}
# gloo point-to-point tags of the gather (chunk x groups + group on top): apart from the
# reducers' (a bucket's index), though never in flight together (flushed before backward)
GATHER_TAG = 1 << 20


def piece_elements(partition: int, chunks: int, alignment: int) -> int:
    """Elements of one piece: the partition in `chunks` pieces, each start aligned as DeepSpeed
    aligns its own shards (NCCL)."""
    size = -(-partition // chunks)
    return max(alignment, -(-size // alignment) * alignment)


class ParamGather:
    """The chunked, asynchronous all-gather of one optimizer's flat weight buffers (module
    docstring). `flats`: the flat buffers; `partitions`: each one's per-rank views; `groups`:
    each one's data-parallel process group; `chunks`: how many (default: about one of the
    gradient reducer's buckets each); `by_group`: chunk g is group g, whole (layer blocks), or
    where the world makes those latency-bound, a run of consecutive groups; `pairwise`: on
    gloo, point-to-point exchanges (registry patch gloo_pairwise), else the all-gather NCCL
    runs; `min_piece`: the least elements a rank a chunk should move (default: MIN_PIECE_BYTES
    of the weights' dtype)."""

    def __init__(self, module: torch.nn.Module, flats: list[torch.Tensor],
                 partitions: list[list[torch.Tensor]], groups: list, alignment: int,
                 chunks: int | None = None, by_group: bool = False, pairwise: bool = True,
                 min_piece: int | None = None):
        self.flats, self.partitions, self.groups = flats, partitions, groups
        self.rank = [dist.get_rank(group=g) for g in groups]
        # gloo: each rank sends its piece to every other rank (isend/irecv) rather than gloo's
        # all_gather, which took 1.45x as long (netsim `collectives`, module docstring)
        self.pairwise = [pairwise and dist.get_backend(g) == "gloo" for g in groups]
        self.peers = [[r if g is None else dist.get_global_rank(g, r)
                       for r in range(len(partitions[0]))] for g in groups]
        total = sum(f.numel() for f in flats)
        world = len(partitions[0])
        self.world = world
        self.by_group = by_group
        self.min_piece = piece_floor(flats[0].element_size()) if min_piece is None else min_piece
        parts = [p[0].numel() for p in partitions]
        # the world cuts the reducer's pieces below the floor: so it does the groups
        self.packed = packs(bucket_elements(total), world, self.min_piece)
        # chunk c's groups (by group); packed only where one collective can fill them all
        self.chunk_groups = [[g] for g in range(len(flats))]
        if by_group and self.packed and self._stageable():
            self.chunk_groups = gather_chunks(parts, self.min_piece)
        self.chunk_of = {g: c for c, gs in enumerate(self.chunk_groups) for g in gs}
        # a chunk about the size of one of the reducer's buckets (app.runtime.overlap), at
        # least the floor a rank where the world would cut it smaller
        if not chunks and not by_group:
            chunks = max(1, min(max(parts), -(-total // bucket_elements(total))))
            if self.packed:
                chunks = max(1, min(chunks, max(parts) // self.min_piece))
        self.chunks: int = len(self.chunk_groups) if by_group else int(chunks or 1)
        self.sizes = [piece_elements(p[0].numel(), self.chunks, alignment) for p in partitions]
        self.works: list[list] = []  # per launched chunk: its collectives, until waited for
        self.staged: dict[int, torch.Tensor] = {}  # a packed chunk's rows, until waited for
        self.done: set[int] = set()
        self.trace_path = os.environ.get(TRACE_ENV)
        self.events: list[tuple[str, int, float]] = []
        self._hooks = self._install_hooks(module)

    def _stageable(self) -> bool:
        """Whether groups can share a collective: one process group, dtype and device, and
        each flat's partitions its consecutive slices from its start (DeepSpeed's layout), so
        a group's rows are one strided view of its flat (`_rows`)."""
        first = self.flats[0]
        return all(g is self.groups[0] for g in self.groups) and all(
            f.dtype == first.dtype and f.device == first.device
            and all(q.data_ptr() == f.data_ptr() + r * part[0].numel() * f.element_size()
                    and q.numel() == part[0].numel() for r, q in enumerate(part))
            for f, part in zip(self.flats, self.partitions))

    def _rows(self, g: int) -> torch.Tensor:
        """Group g's flat as [rank, its partition]."""
        width = self.partitions[g][0].numel()
        return self.flats[g].narrow(0, 0, self.world * width).view(self.world, width)

    def describe(self) -> str:
        what = " (one a parameter group of a layer block)" if self.by_group else ""
        if self.by_group and len(self.chunk_groups) < len(self.flats):
            parts = [p[0].numel() for p in self.partitions]
            what = (f" (the {len(self.flats)} parameter groups of the layer blocks, "
                    f"{min(parts):,}-{max(parts):,} elements a rank, packed into runs of at "
                    f"least {self.min_piece:,}, one all-gather each: at {self.world} ranks the "
                    f"short ones alone would be latency-bound)")
        return f"the step's all-gather of the weights runs during the next forward, in " \
               f"{self.chunks} chunk(s){what} (each module waits for its own weights' chunks)"

    # -- the chunks ---------------------------------------------------------------------------

    def pieces(self, g: int, c: int) -> list[torch.Tensor]:
        """Piece c of every partition of group g (empty when the partition is shorter; by
        group: the whole partitions where group g is in chunk c)."""
        part = self.partitions[g]
        if self.by_group:
            return [p.narrow(0, 0, p.numel() if self.chunk_of[g] == c else 0) for p in part]
        start = min(c * self.sizes[g], part[0].numel())
        length = min(self.sizes[g], part[0].numel() - start)
        return [p.narrow(0, start, length) for p in part]

    def chunks_stepped(self, groups_done: int) -> int:
        """How many chunks, from the first, hold only groups before `groups_done` (by group:
        the chunks an optimizer step that has stepped those groups can launch)."""
        return sum(1 for gs in self.chunk_groups if gs[-1] < groups_done) if self.by_group \
            else 0

    def launch(self) -> None:
        """Every chunk's all-gather not launched yet, in chunk order, without waiting."""
        self.launch_upto(self.chunks)

    def launch_upto(self, end: int) -> None:
        """Launch the chunks before `end` not launched yet, in chunk order: the step calls this
        as its groups' partitions become final (`_launching_early`), then `launch` for the
        rest. The step's wrapper has flushed the previous step's chunks (`_launching`)."""
        if not self.works:
            self.done = set()
        for c in range(len(self.works), min(end, self.chunks)):
            if self.by_group and len(self.chunk_groups[c]) > 1:
                self.works.append(self._launch_staged(c))
                self._event("launch", c)
                continue
            works = []
            for g, group in enumerate(self.groups):
                views = self.pieces(g, c)
                if not views[0].numel():
                    continue
                if not self.pairwise[g]:
                    works.append(dist.all_gather(views, views[self.rank[g]], group=group,
                                                 async_op=True))
                    continue
                me, tag = self.rank[g], GATHER_TAG + c * len(self.groups) + g
                for r, view in enumerate(views):
                    if r != me:
                        works.append(dist.isend(views[me], dst=self.peers[g][r], group=group,
                                                tag=tag))
                        works.append(dist.irecv(view, src=self.peers[g][r], group=group,
                                                tag=tag))
            self.works.append(works)
            self._event("launch", c)

    def _launch_staged(self, c: int) -> list:
        """A chunk of several groups as one collective: this rank's partitions of them into its
        row of a staging buffer, every rank's row gathered into it (`all_gather_into_tensor` in
        place; on gloo, pairwise), copied out by `wait`."""
        gs = self.chunk_groups[c]
        g0, widths = gs[0], [self.partitions[g][0].numel() for g in gs]
        group, me = self.groups[g0], self.rank[g0]
        rows = torch.empty(self.world, sum(widths), dtype=self.flats[g0].dtype,
                           device=self.flats[g0].device)
        at = 0
        with torch.no_grad():  # BF16_Optimizer's flats require grad (the collectives bypass it)
            for g, width in zip(gs, widths):
                rows[me].narrow(0, at, width).copy_(self.partitions[g][me])
                at += width
        self.staged[c] = rows
        if not self.pairwise[g0]:
            return [dist.all_gather_into_tensor(rows.view(-1), rows[me], group=group,
                                                async_op=True)]
        works, tag = [], GATHER_TAG + c * len(self.groups) + g0
        for r in range(self.world):
            if r != me:
                works.append(dist.isend(rows[me], dst=self.peers[g0][r], group=group, tag=tag))
                works.append(dist.irecv(rows[r], src=self.peers[g0][r], group=group, tag=tag))
        return works

    def wait(self, chunks) -> None:
        for c in chunks:
            if c < len(self.works) and c not in self.done:
                for work in self.works[c]:
                    work.wait()
                rows = self.staged.pop(c, None)
                if rows is not None:  # a packed chunk: its rows into the groups' flats
                    at = 0
                    with torch.no_grad():
                        for g in self.chunk_groups[c]:
                            width = self.partitions[g][0].numel()
                            self._rows(g).copy_(rows.narrow(1, at, width))
                            at += width
                # let the chunk's collectives go: a list all-gather stages its output in a
                # buffer of its own (NCCL: world x piece), freed with the work, so all of them
                # together would hold a second copy of the weights until the forward's end,
                # where activations peak; released here, they are gone chunk by chunk (a
                # packed chunk's staging buffer above likewise)
                self.works[c] = []
                self.done.add(c)
                self._event("done", c)

    def flush(self) -> None:
        """Wait for every chunk in flight: the weights are whole after it."""
        if self.works:
            self.wait(range(len(self.works)))
            self.works, self.done = [], set()
            self._write_trace()

    # -- forward ------------------------------------------------------------------------------

    def chunks_of(self, param: torch.nn.Parameter) -> set[int]:
        """The chunks that hold any element of `param` (none if it is in no flat buffer)."""
        for g, flat in enumerate(self.flats):
            if param.dtype != flat.dtype or param.device != flat.device:
                continue
            start = (param.data_ptr() - flat.data_ptr()) // flat.element_size()
            if not 0 <= start < flat.numel():
                continue
            if self.by_group:
                return {self.chunk_of[g]}
            end, size, width = start + param.numel(), self.sizes[g], self.partitions[g][0].numel()
            found: set[int] = set()
            for r in range(self.world):
                lo, hi = max(start, r * width), min(end, (r + 1) * width)
                if lo < hi:
                    found.update(range((lo - r * width) // size, (hi - 1 - r * width) // size + 1))
            return found
        return set()

    def _install_hooks(self, module: torch.nn.Module) -> list:
        hooks = []
        for sub in module.modules():
            needed = set().union(*(self.chunks_of(p) for p in sub.parameters(recurse=False)))
            if needed:
                hooks.append(sub.register_forward_pre_hook(self._waiter(sorted(needed))))
        hooks.append(module.register_forward_pre_hook(lambda *_: self._forward_starts()))
        hooks.append(module.register_forward_hook(lambda *_: self.flush()))
        return hooks

    def _waiter(self, chunks: list[int]) -> Callable:
        def wait_for_weights(*_):
            self.wait(chunks)
        return wait_for_weights

    def _forward_starts(self) -> None:
        """Trace only: which chunks are still in flight as forward begins."""
        if self.trace_path and self.works:
            self._event("forward", -1)
            self.events += [("in_flight", c, time.perf_counter())
                            for c, works in enumerate(self.works)
                            if c not in self.done and not all(w.is_completed() for w in works)]

    def _event(self, kind: str, chunk: int) -> None:
        if self.trace_path:
            self.events.append((kind, chunk, time.perf_counter()))

    def _write_trace(self) -> None:
        if self.trace_path and self.events:
            with open(f"{self.trace_path}.rank{dist.get_rank()}", "a") as f:
                f.write(json.dumps({"chunks": self.chunks, "events": self.events}) + "\n")
        self.events = []

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()


# -- installing it on an engine --------------------------------------------------------------------

def install(engine, ready: Callable[[str, object], bool] = lambda name, obj: True,
            pairwise: bool = True) -> str | None:
    """Overlap the step's weight all-gather with the next forward where DeepSpeed's ZeRO-1 or 2
    gathers them (DeepSpeedZeroOptimizer; bf16 ZeRO-1: BF16_Optimizer) over more than one rank,
    without offload, MoE, pipeline or sequence parallelism (registry patch param_gather).
    Returns what it did (for the start-up `gradients:` line), None where DeepSpeed's own gather
    stays."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    opt = engine.optimizer
    if (engine.dp_world_size == 1
            or engine.zero_optimization_stage() not in (1, 2)
            or getattr(engine, "has_moe_layers", False) or engine.pipeline_parallelism
            or getattr(engine, "sequence_parallel_size", 1) > 1):
        return None
    if isinstance(opt, DeepSpeedZeroOptimizer) and not opt.cpu_offload:  # ZeRO-1 or 2
        flats, partitions = opt.bit16_groups_flat, opt.parallel_partitioned_bit16_groups
    elif isinstance(opt, BF16_Optimizer):
        flats, partitions = opt.bf16_groups_flat, opt.bf16_partitioned_groups
    else:
        return None
    if any(len({p.numel() for p in part}) != 1 for part in partitions):
        return None  # unequal partitions: not one all-gather (DeepSpeed pads them equal)
    if not ready("param_gather", opt):
        return None
    by_group = partition_blocks(engine.zero_optimization_stage()) > 1  # the groups are blocks
    gather = ParamGather(engine.module, flats, partitions, list(opt.real_dp_process_group),
                         opt.nccl_start_alignment_factor, by_group=by_group, pairwise=pairwise)
    _install_dispatch(engine)
    opt.step = _launching(opt.step, gather)
    if by_group and isinstance(opt, DeepSpeedZeroOptimizer):
        opt._optimizer_step = _launching_early(opt._optimizer_step, gather)
    for name in ("save_checkpoint", "load_checkpoint"):
        setattr(engine, name, _flushing(getattr(engine, name), gather))
    engine.module.state_dict = _flushing(engine.module.state_dict, gather)
    engine.app_param_gather = gather
    atexit.register(_flush_at_exit, weakref.ref(gather))
    return gather.describe()


def flush(engine) -> None:
    """Wait for `engine`'s weights, if a gather of them is in flight (any engine)."""
    gather = getattr(engine, "app_param_gather", None)
    if gather is not None:
        gather.flush()


def _launching(step: Callable, gather: ParamGather) -> Callable:
    """The optimizer's step with its all-gather launched by `gather` (after the previous one is
    in: its input, this rank's partition, is what the step updates)."""
    @functools.wraps(step)
    def step_and_launch(*args, **kwargs):
        gather.flush()
        gather._event("step", -1)
        _ACTIVE["gather"] = gather
        try:
            return step(*args, **kwargs)
        finally:
            _ACTIVE["gather"] = None
    return step_and_launch


def _launching_early(group_step: Callable, gather: ParamGather) -> Callable:
    """DeepSpeedZeroOptimizer's step runs the optimizer one parameter group at a time
    (`_optimizer_step(i)`) and writes group i's partition into the weights before group i + 1's
    turn. With the app's layer blocks, a chunk is a group (or a run of them, packed): when
    group i's turn begins, the chunks of groups 0 .. i - 1 only are final and go on the wire
    while the later groups step, instead of after the last one (the netsim model's 16 groups
    step in 15-16 ms, which the gather now overlaps: docs/benchmarks.md "netsim scale, round
    6")."""
    @functools.wraps(group_step)
    def step_group(group_no, *args, **kwargs):
        if _ACTIVE["gather"] is gather:
            gather._event("optimizer", group_no)
            gather.launch_upto(gather.chunks_stepped(group_no))
        return group_step(group_no, *args, **kwargs)
    return step_group


def _flushing(method: Callable, gather: ParamGather) -> Callable:
    @functools.wraps(method)
    def with_whole_weights(*args, **kwargs):
        gather.flush()
        return method(*args, **kwargs)
    return with_whole_weights


def _flush_at_exit(ref) -> None:
    """A gloo collective still running when the interpreter ends aborts the process."""
    gather = ref()
    if gather is not None and dist.is_initialized():
        try:
            gather.flush()
        except RuntimeError:
            pass  # a peer gone: the launcher ends the job anyway


def _install_dispatch(engine) -> None:
    """DeepSpeed's `all_gather_dp_groups`, as its optimizer modules call it, launches the
    chunked gather inside a step this module wrapped (for that optimizer's own buffers) and is
    DeepSpeed's blocking one everywhere else (a checkpoint load's `update_lp_params`, other
    engines). Swapped while `engine` lives (app.runtime.registry.swap)."""
    from deepspeed.runtime import bf16_optimizer
    from deepspeed.runtime.zero import stage_1_and_2

    for module in (bf16_optimizer, stage_1_and_2):
        registry.swap(module, "all_gather_dp_groups", _dispatching, owner=engine)


def _dispatching(original: Callable) -> Callable:
    def all_gather_dp_groups(groups_flat, *args, **kwargs):
        gather = _ACTIVE["gather"]
        if gather is not None and groups_flat is gather.flats:
            return gather.launch()
        return original(groups_flat, *args, **kwargs)
    return all_gather_dp_groups
