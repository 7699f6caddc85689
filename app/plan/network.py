"""The network in the plan: what DeepSpeed 0.19 sends per optimizer step, per ZeRO stage, how long
it takes on a given network, how much of it hides behind compute, and from that the step time,
tokens/s and scaling efficiency from 1 to N nodes. Pure functions (no torch.distributed): the
planner and the simulated-cluster benchmark call the same `predict_step`. Formulas and defaults:
docs/plan.md, "The network".

What is sent (P parameters, c = communication dtype bytes, w = weight bytes), as DeepSpeed 0.19
does it with this repo's ds_configs (read from `engine.py`, `stage_1_and_2.py`, `bf16_optimizer.py`,
`stage3.py`):

    ZeRO-0        all-reduce of the gradients (c x P) on the boundary micro step, in the app's
                  reducer's buckets during backward (app/runtime/overlap.py; DeepSpeed alone
                  reduces after backward, `buffered_allreduce_fallback`)
    ZeRO-1        a reduce-scatter of the gradients (c x P) into each rank's partition during
                  backward, in buckets of equal pieces of every partition (the app's
                  PartitionReducer, packed at least MIN_PIECE_BYTES a rank where the world
                  would cut them smaller: `sized_calls`; NCCL's reduce-scatter, pairwise
                  isend/irecv over gloo; DeepSpeed's own reduction becomes a local copy), then
                  an all-gather of the updated weights (w x P), launched by the step and waited
                  for, chunk by chunk, during the next forward (app/runtime/gather.py)
    ZeRO-1 bf16   the same bytes: the reducer sends BF16_Optimizer's fp32 gradient buffer in c
                  during backward, then the bf16 weights are all-gathered in the next forward
    ZeRO-2        the bucketed all-reduce every micro step (the gradients are partitioned as
                  they come; on gloo each slice sent to its owner, a reduce-scatter's bytes:
                  app/runtime/zero2_overlap.py), then the weight all-gather at the boundary
    ZeRO-3        every micro step: weight all-gathers in forward (and again in backward unless
                  the parameters stay gathered between them), a reduce-scatter of the gradients

Cost of one collective on n nodes of g devices (hierarchical, each phase a ring; the node's link
is shared by its g devices, so it carries the whole tensor's share):

    all-reduce      2(g-1)/g x B / intra + 2(n-1)/n x B / inter + (2(g-1) a_intra + 2(n-1) a_inter)
    reduce-scatter   (g-1)/g x B / intra +  (n-1)/n x B / inter +  ((g-1) a_intra +  (n-1) a_inter)
    all-gather       as reduce-scatter

per bucket of B bytes (a = the per-message latency of one ring step).

What the step waits for (a pipeline, not a share of backward that hides everything), in the
windows of `windows_of`: the compute less the optimizer step (`Job.step_ms`, which nothing
overlaps), split into forward (measured, or 1 - backward_fraction) and backward:

    ready_b     a bucket's gradients are final at the share of backward's work done after the
                last use of its last parameter (the planner's `backward_layout`: matmul work by
                elements; a tied embedding is final only at the very end of backward)
    finish_b    max(ready_b, finish_b-1) + cost_b: buckets go over the link one after another
    exposed     finish_last - backward's end (at least the embeddings' bucket, ready at the end)
    forward     gathers during forward (Overlap.gather_chunks, ZeRO-3's prefetch): all launched
                when forward starts, forward stalls until chunk c is in where it first needs it:
                stall = max_c(finish_c - needed_c)
    CPU         on a one-core node the CPU gloo spends per byte a node sends (copies, sums, the
                TCP stack; Link.cpu_ms_per_mb, measured: GLOO_CPU_MS_PER_MB) is taken from
                compute, overlapped or not: paid on top
    gloo        torch's gloo reduce-scatter moves an all-reduce's bytes (measured): two passes
                (DeepSpeed's ZeRO-3 on CPU); the app's ZeRO-1 sends pairwise, one pass

Each term and the measurements behind the constants: docs/plan.md, "What hides behind compute"
and "The primitives, measured on the simulated cluster".

The low-communication mode (`LowComm`, `--dp-mode diloco`): the synchronous model above at an
island's world, plus every H steps a blocking outer sync (`outer_sync`: a ring all-reduce of the
weights' pseudo-gradients across islands, each island rank its 1/N slice, then the island's
all-gather), amortised over H: docs/plan.md, "Low-communication data parallelism".
"""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field, replace
from functools import lru_cache
from math import ceil
from typing import Any, Callable, NamedTuple

from app.runtime.overlap import (
    block_starts,
    bucket_elements,
    bucket_pieces,
    gather_chunks,
    packs,
    partition_blocks,
    piece_floor,
)
from data_tools.errors import UserError

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
BACKWARD_FRACTION = 2 / 3
"""The share of a micro step's compute that is backward (2 of its 3 matmul passes): the window a
gradient reduction can hide behind."""
GLOO_CPU_MS_PER_MB = 1.4
"""CPU ms per MB a node sends, gloo between two one-core netsim nodes at 570 Mbit/s (process CPU
of an all-reduce and an all-gather of 0.25-9.2 MB, `bench/netsim.py collectives`: 1.37 and
1.41 ms per MB sent; docs/plan.md)."""
ZERO2_GLOO_TIME = 1.6
"""ZeRO-2's reduction on gloo (each slice to its owner, app/runtime/zero2_overlap.py: a
reduce-scatter's bytes) costs about this many times a reduce-scatter's link time on the simulated
cluster. First fitted (1.8) to the 2-node steps of docs/benchmarks.md "netsim scale, round 3b";
refitted to rounds 4-6 together once round 6's ZeRO-2 step lost its 16 per-group norm
collectives (patches.one_norm_collective), where 1.8 left the plan 16% high at 199 Mbit/s: with
1.6 the plan is within 10% of every measured ZeRO-2 cell of rounds 4, 5 and 6 (three machines'
worth of rates, unshaped included). What costs the rest is not modelled term by term (measured,
not explained; candidates: DeepSpeed launches a bucket in the hook of the gradient after it, and
copies the owned gradients into the partition on the same core)."""
ALLREDUCE_BUCKET = 500_000_000
"""Elements per all-reduce at ZeRO-0 and in BF16_Optimizer (MEMORY_OPT_ALLREDUCE_SIZE)."""


class Overlap(NamedTuple):
    """Which of a path's collectives run while compute runs, and how."""

    reduce: bool
    """The gradient reduction runs during backward (bucketed)."""
    gather: bool
    """The weight all-gathers run during compute (ZeRO-3's prefetch; ZeRO-1/2's boundary gather
    never does in DeepSpeed 0.19: it ends the optimizer step)."""
    scatter_pieces: int = 0
    """ZeRO-1/2: the reduction is a reduce-scatter in this many buckets, bucket c holding piece
    c of every rank's partition (ready when its last gradient is); 0: all-reduce buckets cut in
    backward order."""
    gather_chunks: int = 0
    """ZeRO-1/2: the updated weights are all-gathered during the next forward in this many
    chunks (chunk c: piece c of every partition, needed when forward first uses one of its
    weights); 0: the gather ends the step, exposed."""


# What overlaps, per (path, device kind): the one place the planner reads it. ZeRO-0 reduces
# through the app's all-reduce reducer (app/runtime/overlap.py GradReducer): buckets all-reduced
# asynchronously while backward runs, on CPU (gloo's threads) as on GPU. ZeRO-1 (fp32, and bf16
# through BF16_Optimizer) reduce-scatters equal pieces of every rank's partition during backward
# (PartitionReducer: `scatter_pieces`, the reducer's bucket count, filled in by PlanSetup) and
# gathers its updated weights in chunks during the next forward (app/runtime/gather.py:
# `gather_chunks`). ZeRO-2 keeps DeepSpeed's buckets: on a GPU on its side stream
# (`overlap_comm`), on CPU launched asynchronously by app/runtime/zero2_overlap.py (a bucket
# holding the whole model cut to the reducer's size); its weights gathered as ZeRO-1's. ZeRO-3 is
# DeepSpeed's: on the CPU accelerator its side streams are no-ops, so nothing overlaps there.
PIECES = -1
"""`scatter_pieces` / `gather_chunks` placeholder: as many as the app's reducer has buckets, or
at a world that makes those latency-bound, the buckets and chunks the runtime packs there
(`sized_calls`)."""
OVERLAPPED: dict[tuple[str, str], Overlap] = {
    ("zero0", "gpu"): Overlap(True, False),  # the app's reducer, during backward
    ("zero0", "cpu"): Overlap(True, False),
    ("zero1", "gpu"): Overlap(True, True, PIECES, PIECES),  # reduce-scatter; gather in forward
    ("zero1", "cpu"): Overlap(True, True, PIECES, PIECES),
    ("zero1-bf16", "gpu"): Overlap(True, True, PIECES, PIECES),  # from BF16_Optimizer's buffer
    ("zero1-bf16", "cpu"): Overlap(True, True, PIECES, PIECES),
    ("zero2", "gpu"): Overlap(True, True, 0, PIECES),  # overlap_comm; gather in forward
    ("zero2", "cpu"): Overlap(True, True, 0, PIECES),  # app/runtime/zero2_overlap.py
    ("zero3", "gpu"): Overlap(True, True),  # overlap_comm and the prefetch
    ("zero3", "cpu"): Overlap(False, False),
}
APP_REDUCER_PATHS = ("zero0", "zero1", "zero1-bf16")
"""The paths whose gradients go through the app's reducer, in its buckets (bucket_elements)."""


def path_of(stage: int, precision: str) -> str:
    """The DeepSpeed code path a (stage, precision) takes: bf16 ZeRO-1 with the app's fp32
    gradient accumulation runs BF16_Optimizer, not the ZeRO optimizer."""
    if stage not in (0, 1, 2, 3):
        raise UserError(f"ZeRO stage {stage}: stages are 0, 1, 2 and 3")
    return "zero1-bf16" if stage == 1 and precision == "bf16" else f"zero{stage}"


def overlap_of(stage: int, precision: str, device: str = "gpu") -> Overlap:
    return OVERLAPPED[(path_of(stage, precision), device)]


@dataclass(frozen=True)
class Interconnect:
    """A network between nodes: bandwidth per node and per-message latency (line rates)."""

    name: str
    gbps: float
    """Inter-node bandwidth per node and direction, Gb/s (shared by the node's devices)."""
    latency_us: float
    """Latency of one ring step (one message between neighbouring nodes), microseconds."""
    what: str


INTERCONNECTS = {i.name: i for i in (
    Interconnect("10gbe", 10, 40, "10 Gb Ethernet, TCP sockets"),
    Interconnect("25gbe", 25, 30, "25 Gb Ethernet, TCP sockets (the paper's cluster)"),
    Interconnect("100gbe", 100, 20, "100 Gb Ethernet, TCP sockets"),
    Interconnect("200gbe-roce", 200, 5, "200 Gb Ethernet with RoCE v2 (RDMA)"),
    Interconnect("400g-ib", 400, 3, "one 400 Gb/s InfiniBand NDR port per node"),
    Interconnect("8x400g-ib", 3200, 3, "8 NDR ports per node (DGX H100 / HGX class)"),
    Interconnect("efa-p4d", 400, 15, "AWS p4d: 4 x 100 Gb/s EFA (SRD)"),
    Interconnect("efa-p5", 3200, 15, "AWS p5: 32 x 100 Gb/s EFA v2 (SRD)"),
)}
DEFAULT_INTERCONNECT = "25gbe"

# Intra-node bandwidth per device and direction (Gb/s) and ring-step latency (us), by
# accelerator (app.telemetry.hardware names): NVLink/NVSwitch or Infinity Fabric per direction
# from the datasheets (half the bidirectional figure), PCIe x16 per direction otherwise.
INTRA = {
    "A100-40GB": (2400, 2), "A100-80GB": (2400, 2),  # NVLink3 600 GB/s bidirectional
    "H100-SXM": (3600, 2), "H200": (3600, 2),  # NVLink4 900 GB/s
    "H100-NVL": (2400, 2),  # NVLink bridge 600 GB/s between the pair
    "H100-PCIe": (512, 5),  # PCIe Gen5 x16 128 GB/s
    "B200": (7200, 2),  # NVLink5 1.8 TB/s
    "MI300X": (3584, 3),  # Infinity Fabric 7 x 128 GB/s
    "MI250X": (1600, 3),  # Infinity Fabric, ~400 GB/s to its peers (approximate)
    "V100-16GB": (1200, 3), "V100-32GB": (1200, 3),  # NVLink2 300 GB/s
    "V100-PCIe": (128, 5),  # PCIe Gen3 x16
}
PCIE4_INTRA = (256, 5)
"""Any other card: PCIe Gen4 x16, 32 GB/s per direction (L40S, L4, A10, A10G, T4)."""


def intra_default(accelerator: str | None) -> tuple[float, float]:
    """(Gb/s, latency us) between the devices of one node for an accelerator name."""
    return INTRA.get(accelerator or "", PCIE4_INTRA)


def nearest_interconnect(gbps: float) -> Interconnect:
    """The preset closest in bandwidth (log scale): the latency a bare --net-gbps implies."""
    from math import log
    return min(INTERCONNECTS.values(), key=lambda i: (abs(log(i.gbps / gbps)), i.latency_us))


@dataclass(frozen=True)
class Link:
    """The network a job runs on."""

    inter_gbps: float
    inter_latency_us: float = 0.0
    intra_gbps: float = PCIE4_INTRA[0]
    intra_latency_us: float = PCIE4_INTRA[1]
    cpu_ms_per_mb: float = 0.0
    """CPU time the rank's own core spends per MB its node sends (gloo's copies and sums, the
    TCP stack): on a node with one core a rank it is taken from compute, so the step pays it
    whether the transfer overlaps or not. 0 on GPUs (NCCL's kernels, the NIC's DMA)."""

    def __post_init__(self) -> None:
        if not self.cpu_ms_per_mb >= 0:
            raise UserError(f"--net-cpu-ms-per-mb {self.cpu_ms_per_mb}: must be 0 or more")
        for name in ("inter_gbps", "intra_gbps"):
            if not getattr(self, name) > 0:
                raise UserError(f"--{_flag(name)} {getattr(self, name)}: must be positive")
        for name in ("inter_latency_us", "intra_latency_us"):
            if not getattr(self, name) >= 0:
                raise UserError(f"--{_flag(name)} {getattr(self, name)}: must be 0 or more")


def _flag(name: str) -> str:
    return {"inter_gbps": "net-gbps", "intra_gbps": "intra-gbps",
            "inter_latency_us": "net-latency-us",
            "intra_latency_us": "intra-latency-us"}.get(name, name.replace("_", "-"))


@dataclass(frozen=True)
class Collective:
    """One kind of collective a step runs: the whole tensor's bytes, split into buckets."""

    kind: str
    """"all-reduce", "reduce-scatter" or "all-gather"."""
    what: str
    """"gradients" or "weights"."""
    nbytes: int
    """The full tensor (every rank's share together), bytes."""
    buckets: int
    """Calls it is split into (each pays the latency once)."""
    per_micro: bool
    """Runs every micro step (else once per optimizer step, at the boundary)."""
    phase: str
    """When it can run: "forward", "backward" or "step" (after backward, in the optimizer step)."""
    overlapped: bool
    layout: tuple[Grad, ...] = ()
    """The parameters it covers in backward order (pipeline model); () for the closed form."""
    bucket_elements: int = 0
    """Backward reductions: buckets cut from `layout` as the reducer cuts them."""
    pieces: int = 0
    """Buckets (or chunks) of equal pieces of every rank's partition instead (Overlap)."""
    rounds: int = 0
    """Ring passes over the tensor (0: by kind; gloo's reduce-scatter is an all-reduce)."""
    blocks: int = 1
    """ZeRO-1/2: the flat buffer is this many layer blocks, each partitioned on its own
    (app.runtime.overlap.partition_blocks): `pieces` spread over them (partition_pieces)."""
    time_factor: float = 1.0
    """Its link time over what its bytes take (measured where the path costs more than its
    bytes: ZERO2_GLOO_TIME); the bytes sent are not changed."""
    spans: tuple[tuple[tuple[int, int, int], ...], ...] = ()
    """Packed (`sized_calls`): each call's pieces of every rank's partition of the blocks,
    (block, start, length) in elements a rank, as the runtime cuts them at the world the
    collectives were sized for; (): `pieces` equal pieces a block."""


class Grad(NamedTuple):
    """One parameter (or a share of the model) as backward and forward reach it."""

    elements: int
    ready: float
    """Share of backward's work done when its gradient is final (a tied embedding: 1, at the
    end, though the decoder's product that also feeds it comes first)."""
    needed: float
    """Share of forward's work done before forward first uses it."""


# The plan's search (app.plan.recommend) asks for the same model's buckets and pieces a few
# thousand times a plan (341 options for a 2-node bert-tiny); they depend on the layout and the
# sizes only, so they are kept (functools' cache, bounded: a tune search plans many models in one
# process). A repeated plan of that job in one process: 0.8-1.1 -> 0.3-0.4 CPU-s. (`sized_calls`
# is not kept: it reads overlap.MIN_PIECE_BYTES, which tests change.)
MEMO = 4096


def uniform_layout(params: int, groups: int = 64) -> tuple[Grad, ...]:
    """Without a model: the parameters spread evenly over backward and forward."""
    return tuple(Grad(params // groups + (i < params % groups), (i + 1) / groups,
                      1 - (i + 1) / groups) for i in range(groups))


def collectives(stage: int, params: int, *, comm_bytes: int, weight_bytes: int,
                overlap: Overlap, reduce_bucket: int, allgather_bucket: int,
                prefetch_bucket: int = 50_000_000, allreduce_bucket: int = ALLREDUCE_BUCKET,
                zero3_gathers: int = 2, layout: tuple[Grad, ...] = (),
                gloo: bool = False, blocks: int = 1, world: int = 0,
                reducer_bucket: int = 0) -> list[Collective]:
    """What one optimizer step sends at `stage` (module docstring); bucket sizes in elements.
    `layout`: the parameters in backward order (default: spread evenly); `gloo`: gloo's
    reduce-scatter, which moves an all-reduce's bytes (measured: docs/plan.md); `blocks`:
    ZeRO-1/2's layer blocks (Collective.blocks); `world`, `reducer_bucket`: the ranks and the
    app reducer's bucket that `overlap`'s PIECES are sized for (`sized_calls`: the reducer's
    bucket count, or at a world that makes those latency-bound, the runtime's packed buckets
    and chunks)."""
    lay = layout or uniform_layout(params)

    def n(bucket: int) -> int:  # calls, as the parameters are cut into buckets
        return len(cut_buckets(lay, max(bucket, 1)))

    grads, weights = comm_bytes * params, weight_bytes * params
    scatter_rounds = 2 if gloo else 0
    if stage == 0:
        return [Collective("all-reduce", "gradients", grads, n(allreduce_bucket), False,
                           "backward", overlap.reduce, lay, allreduce_bucket)]
    if stage in (1, 2):
        def calls(k: int, per_block: int | None = None) -> int:  # of partition pieces
            return len(partition_pieces(lay, 1, k, blocks, per_block))

        def sized(k: int, element_bytes: int, gather: bool) -> tuple[int, tuple]:
            if k != PIECES:
                return k, ()
            spans = sized_calls(lay, world, blocks, reducer_bucket, element_bytes, gather)
            return (len(spans) or ceil(params / max(reducer_bucket, 1))), spans

        k, spans = sized(overlap.scatter_pieces, comm_bytes, False)
        # the app's reduce-scatter: NCCL's, or pairwise isend/irecv over gloo (one pass)
        # ZeRO-2: DeepSpeed's buckets (backward order), each slice reduced to its owner: on
        # gloo sent point to point (app/runtime/zero2_overlap.py), a reduce-scatter's bytes
        reduce = (Collective("reduce-scatter", "gradients", grads, len(spans) or calls(k),
                             stage == 2, "backward", overlap.reduce, lay, 0, k, blocks=blocks,
                             spans=spans) if k else
                  Collective("reduce-scatter" if gloo and overlap.reduce else "all-reduce",
                             "gradients", grads, n(reduce_bucket), stage == 2, "backward",
                             overlap.reduce, lay, reduce_bucket,
                             time_factor=ZERO2_GLOO_TIME if gloo and overlap.reduce else 1.0))
        k, spans = sized(overlap.gather_chunks, weight_bytes, True)
        gather = (Collective("all-gather", "weights", weights,
                             len(spans) or calls(k, 1 if blocks > 1 else None), False,
                             "forward", True, lay, 0, k, blocks=blocks, spans=spans) if k else
                  Collective("all-gather", "weights", weights, n(allgather_bucket), False,
                             "step", overlap.gather))
        return [reduce, gather]
    out = [Collective("all-gather", "weights", weights, n(prefetch_bucket), True, "forward",
                      overlap.gather, lay, prefetch_bucket)]
    if zero3_gathers > 1:
        out.append(Collective("all-gather", "weights", weights, n(prefetch_bucket), True,
                              "backward", overlap.gather))
    out.append(Collective("reduce-scatter", "gradients", grads, n(reduce_bucket), True,
                          "backward", overlap.reduce, lay, reduce_bucket, 0, scatter_rounds))
    return out


def collective_ms(c: Collective, nodes: int, per_node: int, link: Link) -> float:
    """Time of all of `c`'s buckets once (module docstring: hierarchical rings)."""
    if nodes * per_node <= 1:
        return 0.0
    rounds = c.rounds or (2 if c.kind == "all-reduce" else 1)
    g, m = per_node, nodes
    seconds = c.time_factor * rounds * ((g - 1) / g * c.nbytes / (link.intra_gbps * 1e9 / 8)
                                        + (m - 1) / m * c.nbytes / (link.inter_gbps * 1e9 / 8))
    latency_us = rounds * ((g - 1) * link.intra_latency_us + (m - 1) * link.inter_latency_us)
    return 1000 * seconds + c.buckets * latency_us / 1000


def exposed_ms(comm_ms: float, window_ms: float, buckets: int) -> float:
    """The part of `comm_ms` (in `buckets` equal calls, back to back on the link) that outlasts
    the compute window it overlaps. A bucket can start once the window has produced it (bucket
    i at i/b of the window), so at least the last bucket is exposed:
    max(T/b, T - W (b-1)/b)."""
    if comm_ms <= 0:
        return 0.0
    b = max(buckets, 1)
    return max(comm_ms / b, comm_ms - window_ms * (b - 1) / b)


def _spans(layout: tuple[Grad, ...]) -> tuple[list[int], list[Grad]]:
    """The parameters in registration order (the flat buffer's: backward's reversed) and the
    start of each in it, plus the end."""
    flat = list(reversed(layout))
    starts = [0]
    for g in flat:
        starts.append(starts[-1] + g.elements)
    return starts, flat


def _touching(starts: list[int], flat: list[Grad], lo: float, hi: float) -> list[Grad]:
    i = max(0, bisect_right(starts, lo) - 1)
    out = []
    while i < len(flat) and starts[i] < hi:
        out.append(flat[i])
        i += 1
    return out


# Above this many windows a call's members are found per parameter rather than per rank's
# window (the same set: `_periodic`), so a plan at a million nodes answers in seconds
WINDOW_LOOP_MAX = 64


def _periodic(starts: list[int], flat: list[Grad], base: float, period: float, offset: float,
              length: float, count: int, end: float) -> list[Grad]:
    """The parameters that windows k = 0..count-1, [base + k·period + offset, + length) cut at
    `end`, touch (as `_touching` each window): per rank's window below WINDOW_LOOP_MAX windows,
    else per parameter, by the windows its span can meet (O(parameters), whatever the world)."""
    if count <= WINDOW_LOOP_MAX:
        out: list[Grad] = []
        for k in range(count):
            lo = base + k * period + offset
            hi = min(lo + length, end)
            if lo < hi:
                out += _touching(starts, flat, lo, hi)
        return out
    out = []
    for i, g in enumerate(flat):
        s, e = max(starts[i], base), min(starts[i + 1], end)
        if s >= e:
            continue
        first = max(0, int((s - base - offset - length) // period) + 1)
        last = min(count - 1, ceil((e - base - offset) / period) - 1)
        if first <= last:
            out.append(g)
    return out


def partition_pieces(layout: tuple[Grad, ...], world: int, pieces: int, blocks: int = 1,
                     per_block: int | None = None) -> list[tuple[float, float, float]]:
    """Bucket (or chunk) c = piece c of every rank's partition of the flat buffer:
    [(share of the tensor, ready: its last gradient's, needed: its first weight's)].

    `blocks` > 1: the parameters in that many runs (app.runtime.overlap.block_starts, as
    app.runtime.param_groups.optimizer_groups cuts them), each a flat buffer partitioned on its
    own; bucket (b, c) = piece c of every partition of block b, `per_block` pieces a block
    (default: its share of `pieces`, at least one)."""
    return list(_partition_pieces(layout, world, pieces, blocks, per_block))


@lru_cache(maxsize=MEMO)
def _partition_pieces(layout: tuple[Grad, ...], world: int, pieces: int, blocks: int,
                      per_block: int | None) -> tuple[tuple[float, float, float], ...]:
    starts, flat = _spans(layout)
    total, out = starts[-1], []
    runs = block_starts([g.elements for g in flat], max(blocks, 1)) + [len(flat)]
    for a, b in zip(runs, runs[1:]):
        lo_b, size = starts[a], starts[b] - starts[a]
        n = per_block or (pieces if blocks <= 1 else max(1, ceil(pieces * size / total)))
        for c in range(n):
            members = _periodic(starts, flat, lo_b, size / world, size * c / (world * n),
                                size / (world * n), world, float("inf"))
            out.append((size / total / n, max(g.ready for g in members),
                        min(g.needed for g in members)))
    return tuple(out)


def _block_parts(layout: tuple[Grad, ...], world: int, blocks: int
                 ) -> tuple[list[int], list[Grad], list[int], list[int], list[int]]:
    """The flat buffer's starts and parameters (`_spans`), and each layer block's start, size
    and per-rank partition (its size over `world`, rounded up: DeepSpeed pads a flat group at
    its end)."""
    starts, flat = _spans(layout)
    runs = block_starts([g.elements for g in flat], max(blocks, 1)) + [len(flat)]
    los = [starts[a] for a in runs[:-1]]
    sizes = [starts[b] - starts[a] for a, b in zip(runs, runs[1:])]
    return starts, flat, los, sizes, [-(-size // world) for size in sizes]


def sized_calls(layout: tuple[Grad, ...], world: int, blocks: int, bucket: int,
                element_bytes: int, gather: bool = False) -> tuple[tuple[tuple[int, int, int],
                                                                         ...], ...]:
    """The app's calls at `world` ranks where the runtime packs them (app.runtime.overlap.packs:
    the reducer's pieces, `bucket // world` elements a rank, below MIN_PIECE_BYTES of
    `element_bytes`), by the runtime's own sizing: the reducer's buckets (`bucket_pieces`) or
    the gather's chunks (`gather_chunks`, each whole blocks; one block: chunk c piece c of the
    partition, at least the floor a rank), over the layer blocks' partitions, as
    Collective.spans. () where the world does not pack them (the reducer's bucket count spread
    over the blocks then: `partition_pieces`). The plan's blocks stand for the runtime's
    optimizer groups (a block's weight-decay and no-decay groups, one flat here)."""
    floor = piece_floor(element_bytes)
    if world <= 1 or not bucket or not packs(bucket, world, floor):
        return ()
    *_, parts = _block_parts(layout, world, blocks)
    if not gather:
        return tuple(tuple(b) for b in bucket_pieces(parts, world, bucket, floor))
    if blocks > 1:
        return tuple(tuple((g, 0, parts[g]) for g in gs) for gs in gather_chunks(parts, floor))
    k = max(1, min(ceil(sum(parts) * world / bucket), parts[0] // floor))  # app.runtime.gather
    size = -(-parts[0] // k)
    return tuple(((0, start, min(size, parts[0] - start)),)
                 for start in range(0, parts[0], size))


def span_pieces(layout: tuple[Grad, ...], world: int, blocks: int,
                spans: tuple[tuple[tuple[int, int, int], ...], ...]
                ) -> list[tuple[float, float, float]]:
    """`partition_pieces` for calls given as spans (Collective.spans: the pieces of every
    rank's partition of the blocks each call holds): [(share, ready, needed)]."""
    return list(_span_pieces(layout, world, blocks, spans))


@lru_cache(maxsize=MEMO)
def _span_pieces(layout: tuple[Grad, ...], world: int, blocks: int,
                 spans: tuple[tuple[tuple[int, int, int], ...], ...]
                 ) -> tuple[tuple[float, float, float], ...]:
    starts, flat, los, sizes, parts = _block_parts(layout, world, blocks)
    total, out = sum(parts) or 1, []
    for call in spans:
        members = []
        for block, start, length in call:
            members += _periodic(starts, flat, los[block], parts[block], start, length, world,
                                 los[block] + sizes[block])
        out.append((sum(n for _, _, n in call) / total,
                    max((g.ready for g in members), default=0.0),
                    min((g.needed for g in members), default=1.0)))
    return tuple(out)


def cut_buckets(layout: tuple[Grad, ...], size: int) -> list[tuple[float, float, float]]:
    """Buckets of about `size` elements in backward order, as app/runtime/overlap.py cuts them
    (a parameter larger than a bucket is one alone): [(share, ready, needed)]."""
    return list(_cut_buckets(layout, size))


@lru_cache(maxsize=MEMO)
def _cut_buckets(layout: tuple[Grad, ...], size: int) -> tuple[tuple[float, float, float], ...]:
    total = sum(g.elements for g in layout) or 1
    out, filled, members = [], 0, []
    for g in layout:
        if members and filled + g.elements > size:
            out.append(members)
            members, filled = [], 0
        members.append(g)
        filled += g.elements
    out.append(members)
    return tuple((sum(g.elements for g in m) / total, max(g.ready for g in m),
                  min(g.needed for g in m)) for m in out if m)


def schedule(c: Collective, world: int) -> list[tuple[float, float, float]]:
    """`c`'s calls in the order they are launched: [(share of its bytes, ready, needed)]."""
    if c.spans:  # packed, as the runtime packs them at the world they were sized for
        return span_pieces(c.layout, world, c.blocks, c.spans)
    if c.pieces:  # the weight gather by layer blocks: a chunk a group (app.runtime.gather)
        per_block = 1 if c.blocks > 1 and c.kind == "all-gather" else None
        return partition_pieces(c.layout, world, c.pieces, c.blocks, per_block)
    size = c.bucket_elements or ceil(sum(g.elements for g in c.layout) / max(c.buckets, 1))
    cut = cut_buckets(c.layout, size)
    return cut if c.phase == "backward" else list(reversed(cut))  # forward: registration order


def pipeline_exposed(calls: list[tuple[float, float]], window_ms: float) -> float:
    """Backward: call b (ready at `ready_b` ms, `cost_b` ms on the link) starts when it is
    ready and the link is free: finish_b = max(ready_b, finish_b-1) + cost_b; the step waits
    for finish_last - the window's end."""
    finish = 0.0
    for ready, cost in calls:
        finish = max(ready, finish) + cost
    return max(0.0, finish - window_ms)


def forward_stall(calls: list[tuple[float, float]]) -> float:
    """Forward: every chunk launched when forward starts, back to back on the link; forward
    stalls until chunk c is in when it first needs one of its weights (at `needed_c` ms of its
    own work): the stall is the largest finish_c - needed_c."""
    finish, stall = 0.0, 0.0
    for needed, cost in calls:
        finish += cost
        stall = max(stall, finish - needed)
    return stall


def phase_exposed(hidden: list[Collective], phase: str, window_ms: float, nodes: int,
                  per_node: int, link: Link) -> float:
    """The exposed part of the overlapped collectives of a phase: the pipeline where they carry
    a layout, else the closed form of `exposed_ms`."""
    laid = [c for c in hidden if c.layout and (phase == "backward") == (c.phase == "backward")
            and not (phase == "backward" and c.kind == "all-gather")]
    rest = [c for c in hidden if c not in laid]
    exposed = 0.0
    if rest:
        exposed += exposed_ms(sum(collective_ms(c, nodes, per_node, link) for c in rest),
                              window_ms, sum(c.buckets for c in rest))
    calls = []
    for c in laid:
        for share, ready, needed in schedule(c, nodes * per_node):
            one = replace(c, nbytes=int(c.nbytes * share), buckets=1)
            at = ready if phase == "backward" else needed
            calls.append((at * window_ms, collective_ms(one, nodes, per_node, link)))
    if calls and phase == "backward":
        exposed += pipeline_exposed(sorted(calls, key=lambda x: x[0]), window_ms)
    elif calls:
        exposed += forward_stall(calls)
    return exposed


@dataclass(frozen=True)
class StepTime:
    """One optimizer step on a network (milliseconds)."""

    compute_ms: float
    """All micro steps' compute (forward, backward, optimizer) without communication."""
    comm_ms: float
    """Every collective of the step, end to end, as if nothing overlapped (with the core's CPU
    work for them, `cpu_comm_ms`)."""
    exposed_comm_ms: float
    """The part of `comm_ms` the step waits for."""
    parts: list[dict[str, Any]] = field(default_factory=list)
    cpu_comm_ms: float = 0.0
    """The part of `exposed_comm_ms` that is the node's core working for the collectives."""
    outer_ms: float = 0.0
    """Low-communication mode: one outer sync end to end (`OuterSync.ms`), of which the step
    carries 1/H in `comm_ms` and `exposed_comm_ms`; 0 for synchronous data parallelism."""

    @property
    def step_ms(self) -> float:
        return self.compute_ms + self.exposed_comm_ms


def windows_of(compute_ms: float, grad_accum: int, backward_fraction: float,
               step_ms: float = 0.0, forward_ms: float | None = None) -> dict[str, float]:
    """A micro step's windows: the compute of the micro steps less the optimizer step
    (`step_ms`, once per optimizer step, which nothing overlaps), split into forward
    (`forward_ms` over all micro steps where measured, else 1 - `backward_fraction` of it) and
    backward (the rest)."""
    micro = max(compute_ms - step_ms, 0.0) / grad_accum
    if forward_ms is None:
        return {"backward": micro * backward_fraction, "forward": micro * (1 - backward_fraction)}
    forward = min(forward_ms / grad_accum, micro)
    return {"backward": micro - forward, "forward": forward}


def step_time(colls: list[Collective], nodes: int, per_node: int, link: Link,
              compute_ms: float, grad_accum: int = 1,
              backward_fraction: float = BACKWARD_FRACTION, step_ms: float = 0.0,
              forward_ms: float | None = None) -> StepTime:
    """Step time from the collectives and the compute of one optimizer step (`compute_ms`, all
    `grad_accum` micro steps, the optimizer step `step_ms` included). Overlapped collectives of
    a phase share its window of each micro step (`windows_of`); boundary ones use the last
    micro step's; where they carry a layout, the pipeline of `phase_exposed`. The CPU the
    node's core spends on the step's bytes (`link.cpu_ms_per_mb`) is paid on top, overlapped or
    not."""
    windows = windows_of(compute_ms, grad_accum, backward_fraction, step_ms, forward_ms)
    parts, total, exposed = [], 0.0, 0.0
    for last in (False, True):  # the micro steps before the boundary, then the last one
        count = grad_accum - 1 if not last else 1
        for phase in ("forward", "backward", "step"):
            here = [c for c in colls if c.phase == phase and (c.per_micro or last)]
            ms = [collective_ms(c, nodes, per_node, link) for c in here]
            hidden = [c for c in here if c.overlapped and phase in windows]
            out = [t for c, t in zip(here, ms) if not (c.overlapped and phase in windows)]
            if hidden:
                exposed += count * phase_exposed(hidden, phase, windows[phase], nodes, per_node,
                                                 link)
            exposed += count * sum(out)
            total += count * sum(ms)
    for c in colls:
        t = collective_ms(c, nodes, per_node, link)
        parts.append({"kind": c.kind, "what": c.what, "bytes": c.nbytes, "buckets": c.buckets,
                      "per_micro_step": c.per_micro, "phase": c.phase, "overlapped": c.overlapped,
                      "ms_each": t, "times_per_step": grad_accum if c.per_micro else 1})
    cpu = link.cpu_ms_per_mb * node_bytes(colls, nodes, grad_accum) / 1e6
    return StepTime(compute_ms, total + cpu, exposed + cpu, parts, cpu)


def node_bytes(colls: list[Collective], nodes: int, grad_accum: int = 1) -> int:
    """Bytes one node sends over its inter-node link per optimizer step (rings: an all-reduce
    sends 2(n-1)/n of the tensor, a reduce-scatter or all-gather (n-1)/n)."""
    if nodes <= 1:
        return 0
    sent = sum((c.rounds or (2 if c.kind == "all-reduce" else 1)) * c.nbytes
               * (grad_accum if c.per_micro else 1) for c in colls)
    return int(sent * (nodes - 1) / nodes)


def node_counts(nodes: int) -> list[int]:
    """1, 2, 4, ... below `nodes`, and `nodes` itself."""
    if nodes < 1:
        raise UserError(f"--nodes {nodes}: must be at least 1")
    out, n = [], 1
    while n < nodes:
        out.append(n)
        n *= 2
    return out + [nodes]


@dataclass(frozen=True)
class Job:
    """A data-parallel job's communication: what it sends, on which network, over what compute."""

    stage: int
    params: int
    per_node: int
    link: Link
    compute_ms: float
    """One optimizer step's compute on one device (all micro steps), milliseconds."""
    grad_accum: int = 1
    precision: str = "bf16"
    comm_dtype: str | None = None
    """Gradient reduction dtype (None: the run's precision, DeepSpeed's default)."""
    device: str = "gpu"
    overlap: Overlap | None = None
    """None: OVERLAPPED's entry for the path and device."""
    backward_fraction: float = BACKWARD_FRACTION
    step_ms: float = 0.0
    """The optimizer step's part of `compute_ms` (measured: the run's perf/optimizer_ms): no
    collective hides behind it. 0: counted as forward and backward."""
    forward_ms: float | None = None
    """The forward passes' part of `compute_ms` (measured: perf/forward_ms x grad_accum); None:
    1 - backward_fraction of the forward and backward."""
    buckets: dict[str, int] = field(default_factory=dict)
    """reduce_bucket / allgather_bucket / prefetch_bucket / allreduce_bucket, and the app's
    reducer's reducer_bucket (elements; default: app/runtime/overlap.py's bucket_elements)."""
    zero3_gathers: int = 2
    """ZeRO-3 weight gathers per micro step: 2, or 1 when the weights stay gathered from forward
    to backward (the whole model within stage3_max_live_parameters)."""
    layout: tuple[Grad, ...] = ()
    """The parameters in backward order with where backward finishes and forward first uses
    each (the planner's `backward_layout`); () spreads them evenly."""

    def __post_init__(self) -> None:
        if not self.compute_ms > 0:
            raise UserError(f"--compute-ms {self.compute_ms}: must be positive")
        if not 0 <= self.backward_fraction <= 1:
            raise UserError(f"--overlap-fraction {self.backward_fraction}: must be in [0, 1]")
        if not 0 <= self.step_ms < self.compute_ms:
            raise UserError(f"--step-ms {self.step_ms:g}: must be 0 or more and below the "
                            f"compute time ({self.compute_ms:g} ms)")
        if self.forward_ms is not None and not 0 <= self.forward_ms <= self.compute_ms \
                - self.step_ms:
            raise UserError(f"--forward-ms {self.forward_ms:g}: must be 0 or more and at most "
                            f"the compute time less the optimizer step "
                            f"({self.compute_ms - self.step_ms:g} ms)")
        for name, value in (("grad_accum", self.grad_accum), ("per_node", self.per_node),
                            ("params", self.params)):
            if value < 1:
                raise UserError(f"{name} {value}: must be at least 1")
        if (self.comm_dtype or self.precision) not in DTYPE_BYTES:
            raise UserError(f"--comm-dtype {self.comm_dtype}: expected fp32, bf16 or fp16")

    def collectives(self, world: int = 0) -> list[Collective]:
        """The step's collectives, the app's buckets and chunks sized as the runtime sizes them
        at `world` ranks (0: by the reducer's bucket alone, as at a world that does not pack
        them; the bytes are the same)."""
        overlap = self.overlap or overlap_of(self.stage, self.precision, self.device)
        b = {"reduce_bucket": 500_000_000, "allgather_bucket": 500_000_000, **self.buckets}
        path = path_of(self.stage, self.precision)
        reducer = b.pop("reducer_bucket", bucket_elements(self.params))
        if path in APP_REDUCER_PATHS and overlap.reduce:  # the app's reducer's buckets
            b["allreduce_bucket"] = b["reduce_bucket"] = reducer
        elif path == "zero2" and self.device == "cpu" and overlap.reduce \
                and b["reduce_bucket"] >= self.params:  # zero2_overlap cuts a whole-model bucket
            b["reduce_bucket"] = reducer
        elif path == "zero1-bf16":  # the engine's fallback reduces
            b["reduce_bucket"] = b.get("allreduce_bucket", ALLREDUCE_BUCKET)
        # PIECES: the reducer's buckets, the gather's chunks, sized by `collectives` at `world`
        return collectives(self.stage, self.params,
                           comm_bytes=DTYPE_BYTES[self.comm_dtype or self.precision],
                           weight_bytes=DTYPE_BYTES[self.precision], overlap=overlap,
                           zero3_gathers=self.zero3_gathers, layout=self.layout,
                           gloo=self.device == "cpu", blocks=partition_blocks(self.stage),
                           world=world, reducer_bucket=reducer, **b)

    def at(self, nodes: int) -> StepTime:
        return step_time(self.collectives(nodes * self.per_node), nodes, self.per_node,
                         self.link, self.compute_ms, self.grad_accum, self.backward_fraction,
                         self.step_ms, self.forward_ms)

    def node_bytes(self, nodes: int) -> int:
        """Bytes one node sends over its inter-node link per optimizer step at `nodes`."""
        return node_bytes(self.collectives(nodes * self.per_node), nodes, self.grad_accum)

    def scaling(self, nodes: int, tokens_per_step_per_device: int) -> list[dict[str, Any]]:
        """tokens/s and efficiency (tokens/s per device against one node's) at 1, 2, 4 ... N."""
        return scaling_rows(self.at, self.at(1), self.per_node, nodes,
                            tokens_per_step_per_device)


def scaling_rows(at: Callable[[int], StepTime], one: StepTime, per_node: int, nodes: int,
                 tokens_per_step_per_device: int) -> list[dict[str, Any]]:
    """tokens/s and efficiency at 1, 2, 4 ... N nodes of `at(nodes)`'s steps; efficiency is
    tokens/s per device against one node's at step `one` (a synchronous node: the same
    reference for every mode), which is one.step_ms / step_ms."""
    rows = []
    base = per_node * tokens_per_step_per_device / (one.step_ms / 1000)
    for m in node_counts(nodes):
        t = at(m)
        tps = m * per_node * tokens_per_step_per_device / (t.step_ms / 1000)
        rows.append({"nodes": m, "devices": m * per_node, "step_ms": t.step_ms,
                     "exposed_comm_ms": t.exposed_comm_ms, "tokens_per_sec": tps,
                     "efficiency": tps / (m * base)})
    return rows


# -- Low-communication data parallelism (`--dp-mode diloco`) ------------------------------------

DP_MODES = ("sync", "diloco")
"""`sync`: every rank in one DeepSpeed data-parallel group (all of the above). `diloco`: islands
of ranks train synchronously inside; every H optimizer steps the islands average their
pseudo-gradients over the slow link and take an outer Nesterov step (DiLoCo, Douillard et al.
2023, arXiv:2311.08105)."""
OUTER_DTYPES = ("fp32", "bf16")
"""The outer sync's exchange dtype (`--outer-dtype`): the global weights and the outer step stay
fp32 either way."""
OUTER_EVERY_CANDIDATES = (10, 20, 50, 100, 200, 500)
"""The H the plan predicts (with the user's --outer-every): from DiLoCo's default of 500 (8
islands, its paper's main runs) down by about 2.5x a step, to 10, the modes table's view of how
the outer sync's cost grows as H falls."""
MIN_OUTER_EVERY = 20
"""The smallest H the plan recommends unless told otherwise (`--min-outer-every`). Quality
depends on H (and on the islands and the outer learning rate), and the plan does not predict
it: DiLoCo trained at H = 500 with 8 islands and found the loss rising with H over the values it
swept (50 up to thousands), so the plan takes the smallest H that reaches the efficiency target.
Small H is not free either: the outer Nesterov step (DiLoCo's learning rate 0.7, momentum 0.9)
was tuned for H in the hundreds, and at a handful of inner steps its momentum acts on nearly
every step's update on top of AdamW's. The issue's quality target is set at H >= 20. The
evidence for a given model is the quality benchmark in docs/benchmarks.md (eval loss against
tokens, synchronous against several H, same global batch), not this constant."""
MAX_OUTER_EVERY = 50
"""The largest H the plan recommends unless told otherwise (`--max-outer-every`): the largest
measured to keep the eval loss within 2 % of synchronous data parallelism at the same global
batch and tokens (docs/benchmarks.md, "Low-communication quality": 4 islands, 2,000 steps from a
250-step synchronous start, +1.46 % at H = 20, +1.89 % at H = 50, +2.7 % at H = 100). Like the
global batch bound, it stands for what the optimizer tolerates, which the wire model cannot
see; a user whose own quality run holds at a larger H raises it."""
TARGET_EFFICIENCY = 0.9
"""The efficiency a recommended mode reaches at the planned node count: the share of the step
the devices compute (compute / step: tokens/s per device against a node that communicates
nothing), so exposed communication at most 10% of the step (the issue's target for the
low-communication mode, and the synchronous recommendation's rule before it)."""
OUTER_MESSAGE_US = 0.0
"""Per message (ring step) of the outer all-reduce, on top of the link's own latency
(`Link.inter_latency_us`): what a torch.distributed all-reduce over the islands' `across` group
costs beyond its bytes (its launch outside DeepSpeed's buckets, the pseudo-gradient's copy into
the send buffer, the outer step on the slice). Not yet measured: 0 until the runtime's
outer-sync telemetry (its time against its bytes at two or more rates) refits it."""
LOW_COMM_STAGES = (0, 1, 2)
"""The ZeRO stages `app train --dp-mode diloco` runs (app/settle.py refuses ZeRO-3, offload and
fp16: a rank's slice is its fp32 masters, whole at ZeRO-0, its partition at ZeRO-1/2)."""


def island_shape(nodes: int, per_node: int, island_ranks: int) -> tuple[int, int, int]:
    """(islands, an island's nodes, an island's ranks on one node) for islands of
    `island_ranks` consecutive ranks on `nodes` x `per_node`: a divisor of a node's ranks, or
    whole nodes. A world smaller than an island is one island; in a world that is not a whole
    number of islands (the scaling rows between 1 and N nodes) the count is rounded down."""
    world = nodes * per_node
    n = min(max(island_ranks, 1), world)
    return max(1, world // n), max(1, ceil(n / per_node)), min(n, per_node)


@dataclass(frozen=True)
class OuterSync:
    """One outer sync of a low-communication job: blocking, nothing overlaps it."""

    ms: float
    """The all-reduce across islands, the all-gather inside the island, and the CPU a node's
    core spends on their bytes (`Link.cpu_ms_per_mb`). The runtime logs its own as
    `outer/sync_ms` (app.runtime.outer), against which OUTER_MESSAGE_US is to be refitted."""
    node_bytes: int
    """Bytes one node sends over its inter-node link per sync."""
    cpu_ms: float = 0.0
    parts: list[dict[str, Any]] = field(default_factory=list)


def outer_sync(params: int, nodes: int, per_node: int, island_ranks: int, link: Link,
               outer_dtype: str = "fp32", gather_bytes: int = 4) -> OuterSync:
    """One outer sync at `nodes` x `per_node` ranks in islands of `island_ranks`.

    Rank r of every island holds slice r (1/N of the B = outer dtype x P bytes) and all-reduces
    it with the ranks at its place in the other islands (app.runtime.islands' `across` group):
    N rings of B/N bytes side by side. Where k islands share a node, each ring is hierarchical
    as in `collective_ms` (k members over the device links, then the ring's nodes); the node's
    link carries its ranks' slices, so with one island a node it carries the whole
    2(I-1)/I x B (I islands), with an island over j nodes 1/j of that. Latency: 2(k-1) intra
    steps and 2(nodes of a ring - 1) inter steps of `link`'s latency plus OUTER_MESSAGE_US.
    Then the island all-gathers the updated weights, `gather_bytes` a parameter, over its own
    links (the node's devices, and its other nodes where it spans several): as app.runtime.outer
    does it, the fp32 slices at ZeRO-0 (4), the model's weights at ZeRO-1/2 (DeepSpeed's own
    gather of its partitions: 2 in bf16 runs)."""
    islands, island_nodes, here = island_shape(nodes, per_node, island_ranks)
    if islands <= 1:
        return OuterSync(0.0, 0)
    ranks = island_nodes * here
    total = DTYPE_BYTES[outer_dtype] * params
    piece = total / ranks  # each rank's slice
    k = max(1, per_node // ranks) if island_nodes == 1 else 1  # a ring's members on one node
    ring_nodes = max(1, islands // k)
    sent = 2 * (ring_nodes - 1) / ring_nodes * piece * here
    seconds = (2 * (k - 1) / k * piece / (link.intra_gbps * 1e9 / 8)
               + sent / (link.inter_gbps * 1e9 / 8))
    latency_us = (2 * (k - 1) * link.intra_latency_us
                  + 2 * (ring_nodes - 1) * (link.inter_latency_us + OUTER_MESSAGE_US))
    reduce_ms = 1000 * seconds + latency_us / 1000
    gather = Collective("all-gather", "global weights", gather_bytes * params, 1, False,
                        "outer", False)
    gather_ms = collective_ms(gather, island_nodes, here, link)
    node = int(sent) + node_bytes([gather], island_nodes)
    cpu = link.cpu_ms_per_mb * node / 1e6
    parts = [{"kind": "all-reduce", "what": "pseudo-gradients", "bytes": total,
              "buckets": 1, "per_micro_step": False, "phase": "outer", "overlapped": False,
              "ms_each": reduce_ms},
             {"kind": "all-gather", "what": "global weights", "bytes": gather.nbytes,
              "buckets": 1, "per_micro_step": False, "phase": "outer", "overlapped": False,
              "ms_each": gather_ms}]
    return OuterSync(reduce_ms + gather_ms + cpu, node, cpu, parts)


@dataclass(frozen=True)
class LowComm:
    """A low-communication (DiLoCo) job: islands of `island_ranks` train `job`'s stage, batch
    and compute synchronously inside (its collectives at the island's world, over the island's
    links: the node's devices, or its nodes where it spans several); every `outer_every`
    optimizer steps, `outer_sync`, not overlapped with the inner steps (the runtime's first
    version blocks), so exposed whole and amortised over H steps:

        step = inner step (the synchronous model at the island's world) + outer sync / H
    """

    job: Job
    """The synchronous job of the same stage, batch, link and compute; `per_node` the node's
    devices."""
    island_ranks: int
    outer_every: int
    outer_dtype: str = "fp32"

    def __post_init__(self) -> None:
        if self.island_ranks < 1:
            raise UserError(f"--island-ranks {self.island_ranks}: must be at least 1")
        if self.outer_every < 1:
            raise UserError(f"--outer-every {self.outer_every}: must be at least 1")
        if self.outer_dtype not in OUTER_DTYPES:
            raise UserError(f"--outer-dtype {self.outer_dtype}: expected "
                            f"{' or '.join(OUTER_DTYPES)}")

    def inner(self, nodes: int) -> tuple[Job, int]:
        """(the island's synchronous job, the island's nodes) at `nodes`."""
        _, island_nodes, here = island_shape(nodes, self.job.per_node, self.island_ranks)
        return replace(self.job, per_node=here), island_nodes

    @property
    def runs(self) -> bool:
        """Whether `app train` runs the mode at this stage and precision (LOW_COMM_STAGES)."""
        return self.job.stage in LOW_COMM_STAGES and self.job.precision != "fp16"

    def outer(self, nodes: int) -> OuterSync:
        gather = 4 if self.job.stage == 0 else DTYPE_BYTES[self.job.precision]
        return outer_sync(self.job.params, nodes, self.job.per_node, self.island_ranks,
                          self.job.link, self.outer_dtype, gather)

    def at(self, nodes: int, inner: StepTime | None = None) -> StepTime:
        """The step at `nodes` (`inner`: the island's step, where already known)."""
        if inner is None:
            job, island_nodes = self.inner(nodes)
            inner = job.at(island_nodes)
        sync, h = self.outer(nodes), self.outer_every
        parts = inner.parts + [dict(p, times_per_step=1 / h) for p in sync.parts]
        return StepTime(inner.compute_ms, inner.comm_ms + sync.ms / h,
                        inner.exposed_comm_ms + sync.ms / h, parts,
                        inner.cpu_comm_ms + sync.cpu_ms / h, sync.ms)

    def node_bytes(self, nodes: int) -> int:
        """Bytes one node sends over its inter-node link per optimizer step, on average: the
        island's own (where it spans nodes) and 1/H of an outer sync's."""
        job, island_nodes = self.inner(nodes)
        return job.node_bytes(island_nodes) + round(self.outer(nodes).node_bytes
                                                    / self.outer_every)

    def scaling(self, nodes: int, tokens_per_step_per_device: int) -> list[dict[str, Any]]:
        """As `Job.scaling`, against one synchronous node's tokens/s."""
        return scaling_rows(self.at, self.job.at(1), self.job.per_node, nodes,
                            tokens_per_step_per_device)


def predict_step(*, params: int, nodes: int, net_gbps: float, compute_ms: float, stage: int,
                 gpus_per_node: int = 1, net_latency_us: float = 0.0,
                 intra_gbps: float = PCIE4_INTRA[0], intra_latency_us: float = PCIE4_INTRA[1],
                 precision: str = "fp32", comm_dtype: str | None = None, grad_accum: int = 1,
                 device: str = "gpu", overlapped: bool | None = None,
                 backward_fraction: float = BACKWARD_FRACTION,
                 buckets: dict[str, int] | None = None, zero3_gathers: int = 2,
                 cpu_ms_per_mb: float = 0.0, dp_mode: str = "sync",
                 outer_every: int | None = None, island_ranks: int | None = None,
                 outer_dtype: str = "fp32") -> dict[str, Any]:
    """One optimizer step of a data-parallel job on `nodes` x `gpus_per_node` devices.

    params: parameters (P); net_gbps/net_latency_us: the inter-node link per node (a tc-shaped
    veth: its rate and delay); compute_ms: one step's compute measured on one node (all
    `grad_accum` micro steps); device "cpu" looks up the CPU rows of OVERLAPPED; `overlapped`
    overrides both the reduction's and the gathers' entry; cpu_ms_per_mb: the core's CPU per MB
    a node sends (`Link.cpu_ms_per_mb`). dp_mode "diloco": islands of `island_ranks` (default:
    a node's devices) with an outer sync every `outer_every` steps in `outer_dtype` (`LowComm`).
    Returns comm_ms, exposed_comm_ms, step_ms, compute_ms, efficiency (the 1-node synchronous
    step over this one), node_bytes (sent per node per step, on average), outer_sync_ms (one
    outer sync; 0 when synchronous) and the collectives."""
    overlap = None if overlapped is None else Overlap(overlapped, overlapped)
    job = Job(stage=stage, params=params, per_node=gpus_per_node,
              link=Link(net_gbps, net_latency_us, intra_gbps, intra_latency_us, cpu_ms_per_mb),
              compute_ms=compute_ms, grad_accum=grad_accum, precision=precision,
              comm_dtype=comm_dtype, device=device, overlap=overlap,
              backward_fraction=backward_fraction, buckets=dict(buckets or {}),
              zero3_gathers=zero3_gathers)
    if dp_mode not in DP_MODES:
        raise UserError(f"--dp-mode {dp_mode}: expected {' or '.join(DP_MODES)}")
    mode = None
    if dp_mode == "diloco":
        if outer_every is None:
            raise UserError("--dp-mode diloco: give --outer-every H")
        mode = LowComm(job, island_ranks or gpus_per_node, outer_every, outer_dtype)
    t, one = (mode or job).at(nodes), job.at(1)
    return {"comm_ms": t.comm_ms, "exposed_comm_ms": t.exposed_comm_ms, "step_ms": t.step_ms,
            "compute_ms": t.compute_ms, "efficiency": one.step_ms / t.step_ms,
            "node_bytes": (mode or job).node_bytes(nodes), "outer_sync_ms": t.outer_ms,
            "path": path_of(stage, precision), "collectives": t.parts}
