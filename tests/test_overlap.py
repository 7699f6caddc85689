"""The app's gradient reducer (app/runtime/overlap.py): gradients are all-reduced (ZeRO-0) or
reduce-scattered into the ranks' partitions (ZeRO-1) in buckets while backward still runs, on the
boundary micro step only, and the result is what DeepSpeed's own (after-backward) reduction
gives; the communication dtype is a flag."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from app.runtime.ds_config import fill_auto, load_ds_config, zero_config_path
from app.runtime.overlap import (
    MIN_BUCKET_ELEMENTS,
    MIN_PIECE_BYTES,
    TRACE_ENV,
    FlatGroup,
    bucket_elements,
    buckets_in_backward_order,
    packs,
    partition_buckets,
    piece_floor,
)
from data_tools.errors import UserError
from tests.helpers import TINY, check, launch, metrics, train_losses, two_gloo_ranks

STEPS = 3
# 2 ranks x micro 4 x grad accum 2; dropout 0 so the two paths compare step by step; the
# end-of-run eval at 8 samples (TINY's 16): no test here reads it
COMMON = [*TINY, "--max-steps", str(STEPS), "--log-every", "1", "--grad-accum", "2",
          "--dropout", "0", "--eval-every", "0", "--save-every", "0", "--eval-samples", "8"]


def test_buckets_follow_backward_order_and_scale_with_the_model():
    model = torch.nn.Sequential(torch.nn.Embedding(1000, 64), torch.nn.Linear(64, 64),
                                torch.nn.Linear(64, 64))
    model[0].weight.requires_grad_(False)
    buckets = buckets_in_backward_order(model.parameters(), 64 * 64 + 64)
    # last registered first; the frozen embedding is in none; a bucket holds about `size`
    assert [[tuple(p.shape) for p in b] for b in buckets] == [[(64,), (64, 64)],
                                                              [(64,), (64, 64)]]
    assert bucket_elements(10_000) == MIN_BUCKET_ELEMENTS
    assert bucket_elements(40_000_000) == 5_000_000
    assert bucket_elements(10**10) == 25 * 2**20 // 4  # DDP's 25 MB of fp32 at most


def test_partition_buckets_cut_every_partition_into_the_same_pieces():
    """2 ranks, a flat of 12 (10 elements of parameters and 2 of padding), partitions of 6,
    pieces of 4: bucket 0 holds elements [0, 4) and [6, 10), bucket 1 [4, 6) and [10, 12); a
    parameter spanning pieces and partitions is cut at each boundary."""
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(7))
    lengths, segments = partition_buckets([FlatGroup([a, b], [0, 3], 12)], 2, 8)
    assert lengths == [4, 2]
    assert segments[id(a)] == [(0, 0, 0, 0, 3)]  # (bucket, partition, at, start, length)
    # b = elements 3..9: [3, 4) piece 0 of partition 0; [4, 6) piece 1; [6, 10) piece 0 of
    # partition 1, at 1 x piece length (4) in bucket 0
    assert segments[id(b)] == [(0, 0, 3, 0, 1), (1, 0, 0, 1, 2), (0, 1, 4, 3, 4)]


# The app's 15 ZeRO-1/2 groups (8 layer blocks, each with and without weight decay:
# app.runtime.param_groups.optimizer_groups) of bert-120m (vocab 30,522) and of the netsim
# benchmark's model (bert-tiny, hidden 256, 4 heads, intermediate 1,024, vocab 2,000:
# docs/benchmarks.md)
BERT_120M = [23440896, 14155776, 413952, 14155776, 19968, 11796480, 16896, 11796480, 17664,
             11796480, 15360, 11796480, 16896, 10027008, 48186]
NETSIM = [512000, 131072, 132352, 393216, 1280, 262144, 1024, 262144, 1536, 262144, 768, 262144,
          1024, 65536, 3536]


def _groups(sizes: list[int], world: int) -> list[FlatGroup]:
    """Flat groups as DeepSpeed lays them out (the parameters back to back, the flat padded to
    a multiple of 2 x world), each of three parameters (meta tensors: only sizes count)."""
    out = []
    for size in sizes:
        thirds = [size // 3, size // 3, size - 2 * (size // 3)]
        params = [torch.nn.Parameter(torch.empty(n, device="meta")) for n in thirds]
        offsets = [0, thirds[0], thirds[0] + thirds[1]]
        out.append(FlatGroup(params, offsets, size + (-size) % (2 * world)))
    return out


def _check_bijection(groups: list[FlatGroup], world: int, lengths: list[int],
                     segments: dict) -> None:
    """Every parameter element is in exactly one (bucket, partition, position), the position in
    its partition's region of the bucket; no position holds two (by intervals: 110 M elements).
    The position is where `bucket_pieces` puts that element of the group's partition."""
    taken: dict[int, list[tuple[int, int]]] = {}
    for group in groups:
        part = group.numel // world
        for p, offset in zip(group.params, group.offsets):
            segs = sorted(segments[id(p)], key=lambda s: s.start)
            assert segs[0].start == 0 and all(a.start + a.length == b.start
                                              for a, b in zip(segs, segs[1:]))
            assert segs[-1].start + segs[-1].length == p.numel()
            for seg in segs:
                base = seg.partition * lengths[seg.bucket]
                assert base <= seg.at and seg.at + seg.length <= base + lengths[seg.bucket]
                assert (offset + seg.start) // part == seg.partition  # the owner's partition
                assert (offset + seg.start + seg.length - 1) // part == seg.partition
                taken.setdefault(seg.bucket, []).append((seg.at, seg.at + seg.length))
    for spans in taken.values():
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    held = sum(hi - lo for spans in taken.values() for lo, hi in spans)
    assert held == sum(p.numel() for g in groups for p in g.params)


def test_at_1024_ranks_the_buckets_pack_the_groups_above_the_floor():
    """bert-120m's 15 groups at 1,024 ranks: its buckets' pieces would be 6,400 fp32 elements
    (25.6 KB) a rank, 27 latency-bound rings; packed, no bucket moves less than the floor a rank
    (one bucket: the whole share, 106,956 elements, is below two floors), and every element
    still has exactly one place; at 128 ranks the share makes 13 buckets, each above it."""
    floor = piece_floor(4)
    assert floor * 4 == MIN_PIECE_BYTES
    for world, buckets in ((1024, 1), (128, 13)):
        groups = _groups(BERT_120M, world)
        bucket = bucket_elements(sum(g.numel for g in groups))
        assert packs(bucket, world, floor) and bucket // world < floor
        unpacked, _ = partition_buckets(groups, world, bucket)
        lengths, segments = partition_buckets(groups, world, bucket, floor)
        assert len(unpacked) >= 27 and len(lengths) == buckets, (len(unpacked), len(lengths))
        share = sum(g.numel // world for g in groups)
        assert sum(lengths) == share and min(lengths) >= min(floor, share)
        _check_bijection(groups, world, lengths, segments)
    # a whole share below the floor: one bucket, all of it
    tiny = _groups([300, 20, 700], 4)
    lengths, segments = partition_buckets(tiny, 4, 64, floor)
    assert lengths == [sum(g.numel // 4 for g in tiny)]
    _check_bijection(tiny, 4, lengths, segments)


def test_at_two_ranks_the_layout_is_the_unpacked_one():
    """Where the pieces are above the floor (the netsim model at 2 ranks: 143,245 fp32 elements
    a rank, 573 KB), the floor changes nothing: bucket (g, c) is piece c of group g, its last
    piece and the small groups included (17 buckets)."""
    groups = _groups(NETSIM, 2)
    bucket = bucket_elements(sum(g.numel for g in groups))
    piece = bucket // 2
    assert piece == 143_245 and not packs(bucket, 2, piece_floor(4))
    lengths, segments = partition_buckets(groups, 2, bucket, piece_floor(4))
    assert lengths == [min(piece, g.numel // 2 - c) for g in groups
                       for c in range(0, g.numel // 2, piece)]
    assert len(lengths) == 17 and (lengths, segments) == partition_buckets(groups, 2, bucket)
    _check_bijection(groups, 2, lengths, segments)


@pytest.mark.parametrize("precision,flag,file_value,want", [
    ("fp32", None, None, "fp32"), ("bf16", None, None, "fp32"), ("bf16", "bf16", None, "bf16"),
    ("fp32", None, "bf16", "bf16"), ("fp16", None, None, None), ("fp16", "fp32", None, "fp32")])
def test_the_communication_dtype_is_the_flag_else_the_file_else_fp32(precision, flag,
                                                                     file_value, want):
    ds = load_ds_config(zero_config_path(1))
    if file_value:
        ds["communication_data_type"] = file_value
    filled = fill_auto(ds, micro_batch=2, grad_accum=1, world_size=2, precision=precision,
                       lr=1e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0, pin_memory=False,
                       where=Path("x.json"), grad_comm_dtype=flag)
    assert filled.get("communication_data_type") == want


def test_a_flag_that_contradicts_the_file_is_one_line():
    ds = {**load_ds_config(zero_config_path(0)), "communication_data_type": "bf16"}
    with pytest.raises(UserError, match="communication_data_type.*--grad-comm-dtype"):
        fill_auto(ds, micro_batch=2, grad_accum=1, world_size=2, precision="fp32", lr=1e-3,
                  betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0, pin_memory=False,
                  where=Path("x.json"), grad_comm_dtype="fp32")


def _run(dataset: Path, out: Path, stage: int, monkeypatch, *extra: str, overlap: bool = True,
         all_reduce: bool = False, clip: bool = True, optimizer: dict | None = None,
         leave_out: tuple[str, ...] = ()):
    """A 2-rank run through the real launcher; overlapped runs trace their reducer. `overlap`
    False: DeepSpeed's own reduction (--deepspeed-patches without the reducers);
    `all_reduce`: ZeRO-1 through the all-reduce reducer, not the reduce-scatter one; `clip`
    False: ds_configs/zero{stage}.json with gradient clipping off; `optimizer`: its
    "optimizer" section instead; `leave_out`: more patches left out."""
    out_of = list(leave_out) + (["grad_overlap", "partition_reduce", "zero2_overlap"]
                                if not overlap else []) + (["partition_reduce"] if all_reduce
                                                           else [])
    extra = (*extra, "--deepspeed-patches", ",".join(["all", *(f"-{n}" for n in out_of)]))
    stage_args = ["--zero", stage]
    if not clip or optimizer:
        ds = load_ds_config(zero_config_path(stage))
        if not clip:
            ds["gradient_clipping"] = 0.0
        if optimizer:
            ds["optimizer"] = optimizer
        path = out.parent / f"{out.name}-ds.json"
        path.write_text(json.dumps(ds))
        stage_args = ["--ds-config", path]
    with monkeypatch.context() as env:
        if overlap:
            env.setenv(TRACE_ENV, str(out.parent / f"{out.name}.trace"))
        proc = check(launch("train", "--data", dataset, "--out", out, *COMMON, *stage_args,
                            *extra))
    return proc


def _traces(out: Path) -> list[list[dict]]:
    return [[json.loads(line) for line in Path(f"{out.parent / out.name}.trace.rank{r}")
             .read_text().splitlines()] for r in (0, 1)]


def _in_flight_during_backward(step: dict) -> list[int]:
    """Buckets launched in a gradient hook, while backward went on producing gradients (a later
    gradient was ready after the launch), and waited for only after backward ended."""
    events = [(kind, b) for kind, b, _ in step["events"]]
    end = events.index(("backward_end", -1))
    last_ready = max(i for i, (kind, _) in enumerate(events) if kind == "ready")
    return [b for i, (kind, b) in enumerate(events)
            if kind == "launch" and i < last_ready < end < events.index(("done", b))]


# bf16 at 32 tokens a sample (bf16 steps on CPU cost by their tokens): the buckets are the
# parameters', and a shorter backward leaves them no less in flight
BF16_32 = ["--precision", "bf16", "--seq-len", "32"]


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("stage,extra,mode", [
    (0, [], {}), (1, [], {}), (1, BF16_32, {"all_reduce": True}), (1, BF16_32, {"clip": False})],
    ids=["zero0", "zero1-scatter", "zero1-bf16-all-reduce", "zero1-bf16-scatter-noclip"])
def test_buckets_are_in_flight_while_backward_runs_and_train_the_same_losses(
        stage, extra, mode, mlm_dataset, tmp_path, monkeypatch):
    """ZeRO-0 (all-reduce), ZeRO-1 (fp32: DeepSpeed's optimizer; bf16: BF16_Optimizer, whose
    fp32 gradients are sent; reduce-scattered into the partitions, or all-reduced): the
    reducer's traces show buckets in flight during backward, and the losses are those of
    DeepSpeed's own reduction after backward (the reduce-scatter: bit for bit; at bf16 without
    clipping, which reads a norm summed in another order: test below)."""
    overlapped = tmp_path / "overlapped"
    proc = _run(mlm_dataset, overlapped, stage, monkeypatch, *extra, **mode)
    assert "during backward" in proc.stderr  # the start-up line says how gradients are reduced
    engine = json.loads((overlapped / "config.json").read_text())["engine"]
    assert engine["communication_data_type"] == "torch.float32"
    assert "during backward" in engine["grad_reduction"]
    scatter = stage == 1 and not mode.get("all_reduce")
    assert ("reduce-scattered" in engine["grad_reduction"]) == scatter, engine["grad_reduction"]
    traces = _traces(overlapped)
    # observed, not only ordered: a launched bucket not yet complete when a later gradient came
    assert any(kind == "in_flight" for steps in traces for step in steps
               for kind, _, _ in step["events"])
    for rank_steps in traces:
        assert len(rank_steps) == STEPS  # the boundary micro step only: one trace per step
        for step in rank_steps:
            assert step["buckets"] > 1
            assert _in_flight_during_backward(step), step["events"]
            launched = [b for kind, b, _ in step["events"] if kind == "launch"]
            assert launched == list(range(step["buckets"]))  # every bucket, in order
    reference = tmp_path / "deepspeed"
    _run(mlm_dataset, reference, stage, monkeypatch, *extra, overlap=False,
         clip=mode.get("clip", True))
    ref, got = train_losses(reference), train_losses(overlapped)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in ref:
        if scatter:  # 2 ranks: a + b either way, the same division after
            assert got[step] == ref[step], step
        else:
            assert got[step] == pytest.approx(ref[step], abs=1e-6), step


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("stage", [1, 2])
def test_zero12_norm_in_one_collective_is_deepspeeds_per_group_norm(stage, mlm_dataset, tmp_path,
                                                                    monkeypatch):
    """ZeRO-1/2 (DeepSpeedZeroOptimizer over the app's layer-block groups): the gradient norm
    from one all-reduce of every group's sum of squares (patches.one_norm_collective) is the
    norm of DeepSpeed's one all-reduce per group, bit for bit at 2 ranks, and so are the
    clipped steps' losses."""
    one, per_group = tmp_path / "one", tmp_path / "per-group"
    _run(mlm_dataset, one, stage, monkeypatch)
    _run(mlm_dataset, per_group, stage, monkeypatch, leave_out=("one_norm_collective",))
    norms = [{m["step"]: m["train/grad_norm"] for m in metrics(run) if "train/grad_norm" in m}
             for run in (per_group, one)]
    assert sorted(norms[1]) == list(range(1, STEPS + 1))
    assert norms[0][1] > 1.0  # clipping acts: the norm decides the update
    assert norms[1] == norms[0]
    assert train_losses(one) == train_losses(per_group)


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.timeout(1200)
def test_bf16_reduce_scatter_clips_by_the_norm_of_the_partitions(mlm_dataset, tmp_path,
                                                                 monkeypatch):
    """BF16_Optimizer after a reduce-scatter: only the partitions are reduced, so the global
    norm DeepSpeed clips by is summed from them across the ranks (patches.partitioned_bf16_norm)
    instead of read from the whole, now partly unreduced, local gradient: the same norms and
    losses as DeepSpeed's own reduction, to the rounding of fp32 norms taken over parts of a
    gradient (patches.partitioned_bf16_norm: ~1e-5 of the norm at step 1, where both runs hold
    the same weights; the clip coefficients then differ by as much, the bf16 weights round
    apart, and later steps drift by ~1e-4: measured 1.04e-4 at step 3 once); without clipping
    the losses are equal bit for bit, test above)."""
    overlapped, reference = tmp_path / "overlapped", tmp_path / "deepspeed"
    _run(mlm_dataset, overlapped, 1, monkeypatch, "--precision", "bf16")
    _run(mlm_dataset, reference, 1, monkeypatch, "--precision", "bf16", overlap=False)
    engine = json.loads((overlapped / "config.json").read_text())["engine"]
    assert "reduce-scattered" in engine["grad_reduction"]
    norms = [{m["step"]: m["train/grad_norm"] for m in metrics(run) if "train/grad_norm" in m}
             for run in (reference, overlapped)]
    assert sorted(norms[1]) == list(range(1, STEPS + 1))
    assert norms[0][1] > 1.0  # clipping acts: the norm decides the update
    assert norms[1][1] == pytest.approx(norms[0][1], rel=1e-4)  # the same weights: rounding
    for step in norms[0]:
        assert norms[1][step] == pytest.approx(norms[0][step], rel=1e-3), step
    ref, got = train_losses(reference), train_losses(overlapped)
    assert got[1] == ref[1]
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-4), step


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.timeout(1200)
def test_muon_at_zero1_all_reduces_whole_gradients(mlm_dataset, tmp_path, monkeypatch):
    """DeepSpeed's Muon orthogonalises each matrix's whole gradient, and a reduce-scatter
    reduces only this rank's partition (a matrix crossing the partition's edge would be part
    reduced, part this rank's own): ZeRO-1 with Muon keeps the all-reduce reducer, says so, and
    trains DeepSpeed's own reduction's losses."""
    muon = {"type": "Muon", "params": {"lr": "auto", "weight_decay": "auto"}}
    # every matrix 128 x 128 (bert-tiny's feed-forward ones are 128 x 512 and 512 x 128): each
    # rank torch.compiles DeepSpeed's Newton-Schulz once, not again for each of the other two
    # shapes (~1 CPU-s a rank); both sides alike
    square = ("--model-arg", "intermediate_size=128")
    overlapped, reference = tmp_path / "overlapped", tmp_path / "deepspeed"
    _run(mlm_dataset, overlapped, 1, monkeypatch, *square, optimizer=muon)
    _run(mlm_dataset, reference, 1, monkeypatch, *square, optimizer=muon, overlap=False)
    engine = json.loads((overlapped / "config.json").read_text())["engine"]
    assert "during backward" in engine["grad_reduction"]
    assert "reduce-scattered" not in engine["grad_reduction"], engine["grad_reduction"]
    ref, got = train_losses(reference), train_losses(overlapped)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in ref:
        assert got[step] == pytest.approx(ref[step], abs=1e-6), step


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.timeout(1200)
def test_bf16_communication_reduces_close_to_fp32(mlm_dataset, tmp_path, monkeypatch):
    """--grad-comm-dtype bf16 sums in bf16 (one rounding of the averaged gradient): the same
    losses as fp32 communication to bf16's precision, and config.json says which ran."""
    fp32, bf16 = tmp_path / "fp32", tmp_path / "bf16"
    _run(mlm_dataset, fp32, 0, monkeypatch)
    _run(mlm_dataset, bf16, 0, monkeypatch, "--grad-comm-dtype", "bf16")
    engine = json.loads((bf16 / "config.json").read_text())["engine"]
    assert engine["communication_data_type"] == "torch.bfloat16"
    ref, got = train_losses(fp32), train_losses(bf16)
    assert got[1] == ref[1]  # the first loss is computed before any update
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-2), step


SHARED_TWICE = r"""
import os, sys, torch, torch.distributed as dist
from app.runtime.dist import shutdown
from torch.utils.checkpoint import checkpoint
from app.runtime.overlap import GradReducer
rank = int(sys.argv[2])
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=rank, world_size=2)
torch.manual_seed(0)
shared, head = torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)
params = [*shared.parameters(), *head.parameters()]
x = torch.randn(4, 8, requires_grad=True) * (rank + 1)
def loss():  # `shared` in two reentrant checkpointed regions: its hook fires twice
    h = checkpoint(shared, x, use_reentrant=True)
    return head(checkpoint(shared, h, use_reentrant=True)).pow(2).sum()
loss().backward(retain_graph=True)
want = [p.grad.clone() for p in params]
for w in want:
    dist.all_reduce(w)
    w /= 2
for p in params:
    p.grad = None
reducer = GradReducer(params, group=None, world_size=2, comm_dtype=torch.float32,
                      is_boundary=lambda: True, bucket_size=8 * 8 + 8)
loss().backward()
assert reducer.stale == {0, 1}, reducer.stale  # both buckets got a gradient after being sent
reducer.finish()
assert all(torch.allclose(p.grad, w, rtol=1e-6, atol=0) for p, w in zip(params, want)), \
    "a bucket was sent before its last accumulation"
dist.barrier()
shutdown()  # app's own: an exit just after a barrier can abort in gloo's thread
print("ok")
"""


def test_a_gradient_accumulated_twice_in_one_backward_is_sent_whole():
    """A parameter in two checkpointed regions gets its gradient in two accumulations: its
    bucket, sent after the first, is sent again whole (two real ranks over gloo)."""
    two_gloo_ranks(SHARED_TWICE)


SCATTER = r"""
import os, sys, torch, torch.distributed as dist
from app.runtime.dist import shutdown
from torch.utils.checkpoint import checkpoint
from app.runtime.overlap import PartitionReducer, flat_group
rank = int(sys.argv[2])
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=rank, world_size=2)
torch.manual_seed(0)
emb, shared, head = torch.nn.Embedding(30, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)
order = [*emb.parameters(), *shared.parameters(), *head.parameters()]
groups = []
for params in GROUPS:  # as DeepSpeed: each group one flat buffer, padded
    n = sum(p.numel() for p in params)
    flat = torch.zeros(n + (-n) % 4 + 2)  # padding to an even length, and 2 more
    at = 0
    for p in params:
        flat[at:at + p.numel()] = p.data.reshape(-1)
        p.data = flat[at:at + p.numel()].view_as(p)
        at += p.numel()
    half = flat.numel() // 2
    groups.append(flat_group(params, flat, [flat[:half], flat[half:]]))
ids = torch.tensor([[1, 2, 3], [4, 5, 6]]) * (rank + 1)
def loss():  # `shared` in two reentrant checkpointed regions: its hook fires twice
    h = checkpoint(shared, emb(ids), use_reentrant=True)
    return head(checkpoint(shared, h, use_reentrant=True)).pow(2).sum()
loss().backward()
want = [p.grad.clone() for p in order]
for w in want:
    dist.all_reduce(w)
    w /= 2
for p in order:
    p.grad = None
reducer = PartitionReducer(groups, order, group=None, world_size=2, comm_dtype=torch.float32,
                           is_boundary=lambda: True, average=True, bucket_size=24,
                           pairwise=PAIRWISE, min_piece=MIN_PIECE)
group_of = {id(p): i for i, g in enumerate(groups) for p in g.params}
spanning = [b for b, m in enumerate(reducer.members) if len({group_of[id(p)] for p, _ in m}) > 1]
assert reducer.packed == bool(spanning) == (MIN_PIECE > 12), (reducer.lengths, spanning)
loss().backward()
assert len(reducer.lengths) > 2 and reducer.stale, (reducer.lengths, reducer.stale)
reducer.finish()
for g in groups:  # this rank's partition is the average, bit for bit; the rest is its own
    half = g.numel // 2
    for p, at in zip(g.params, g.offsets):
        w = want[[id(q) for q in order].index(id(p))].reshape(-1)
        for i in range(p.numel()):
            mine = (at + i) // half == rank
            assert (p.grad.reshape(-1)[i] == w[i]) or not mine, (p.shape, i)
dist.barrier()
shutdown()  # app's own: an exit just after a barrier can abort in gloo's thread
print("ok")
"""


@pytest.mark.parametrize("pairwise", [True, False], ids=["pairwise", "reduce_scatter_tensor"])
@pytest.mark.parametrize("packed", [False, True], ids=["by-group", "packed"])
def test_the_partition_reducer_hands_each_rank_its_averaged_partition(pairwise, packed):
    """PartitionReducer with two real ranks over gloo (its pairwise exchange, or torch's
    reduce_scatter_tensor: the NCCL branch's code): parameters that span pieces, partitions
    and padded flat groups, one accumulated twice in a backward (its buckets resent whole):
    each rank's partition of every gradient is the all-reduced average, bit for bit. Packed:
    pieces of 12 a rank under a floor of 40, so the partitions of three groups (shared's
    weight, 33 a rank; the small ones, 11; the embedding, 121) run together in four buckets of
    41-42, two spanning groups; the first, without the embedding, is sent before `shared`'s
    second accumulation and resent."""
    groups = "([order[1]], order[2:], [order[0]])" if packed else "(order[:2], order[2:])"
    two_gloo_ranks(SCATTER.replace("GROUPS", groups).replace("PAIRWISE", str(pairwise))
                   .replace("MIN_PIECE", "40" if packed else "1"))
