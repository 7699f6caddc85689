"""ZeRO-1/2's weight all-gather overlapped with the next forward (app/runtime/gather.py): chunks in
forward order, each module waiting for its own weights' chunks only, and the same losses as
DeepSpeed's blocking gather, across a save and a resume, at ZeRO-1 in fp32 and bf16 and at
ZeRO-2."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.runtime.gather import TRACE_ENV, piece_elements
from tests.helpers import TINY, check, launch, metrics, train_losses, two_gloo_ranks

HALF, STEPS = 3, 6
# 2 ranks x micro 4 x grad accum 2; dropout 0 so the two paths compare step by step. 32 tokens a
# sample and 8 eval samples: the gather moves the weights, whatever the batch (bf16 steps and
# evals on CPU cost by their tokens, most of the bf16 case's CPU at TINY's 64 x 16)
COMMON = [*TINY, "--seq-len", "32", "--eval-samples", "8", "--log-every", "1", "--grad-accum",
          "2", "--dropout", "0", "--eval-every", "2", "--save-every", str(HALF), "--zero", "1"]
# the resumed run's 5th step gets a NaN loss: a rollback to step 3's checkpoint, loaded while
# that step's gather is in flight (app/faults/injection.py counts global batches from 0)
POISON = "4:nan"


def test_pieces_cover_a_partition_aligned():
    assert piece_elements(100, 8, 1) == 13  # 8 pieces of 13: the last one shorter
    assert piece_elements(100, 8, 4) == 16
    assert piece_elements(3, 8, 2) == 2  # at least one aligned unit


GATHER = r"""
import os, sys, torch, torch.distributed as dist
from app.runtime.dist import shutdown
from app.runtime.gather import ParamGather
rank = int(sys.argv[2])
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=rank, world_size=2)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16),
                            torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
params = list(model.parameters())
flat = torch.zeros(sum(p.numel() for p in params))  # 1088 elements: partitions of 544
offset = 0
for p in params:  # the parameters become views of the flat buffer, as DeepSpeed makes them
    p.data = flat.narrow(0, offset, p.numel()).view_as(p)
    offset += p.numel()
parts = [flat.narrow(0, 0, 544), flat.narrow(0, 544, 544)]
g = ParamGather(model, [flat], [parts], [None], alignment=1, chunks=4)
assert g.sizes == [136]  # chunk c: flat[136c:136(c+1)] and flat[544+136c:544+136(c+1)]
# layer 0's weight (0-255) is in pieces 0-1 of partition 0, its bias (256-271) in piece 1;
# layer 2's weight (544-799) in pieces 0-1 of partition 1, its bias (800-815) in piece 1;
# layer 3's weight (816-1071) in pieces 2-3 of partition 1
assert g.chunks_of(params[0]) == {0, 1} and g.chunks_of(params[4]) == {0, 1}, \
    (g.chunks_of(params[0]), g.chunks_of(params[4]))
assert g.chunks_of(params[1]) == {1} and g.chunks_of(params[5]) == {1}
assert g.chunks_of(params[6]) == {2, 3} and g.chunks_of(params[7]) == {3}
assert g.chunks_of(torch.nn.Parameter(torch.zeros(3))) == set()
parts[rank].fill_(rank + 1.0)  # this rank's updated partition
g.launch()
assert len(g.works) == 4 and not g.done
model[0](torch.zeros(1, 16))  # layer 0's hook waited for its chunks (0, 1) only
assert {0, 1} <= g.done and 3 not in g.done, g.done
assert g.works[0] == g.works[1] == [] and g.works[3]  # waited chunks' buffers let go
assert torch.equal(model[0].weight, torch.ones(16, 16))
model(torch.zeros(1, 16))  # the whole model's forward ends with every chunk in
assert not g.works and torch.equal(flat, torch.cat([torch.ones(544), torch.full((544,), 2.)]))
dist.barrier()
shutdown()  # app's own: an exit just after a barrier can abort in gloo's thread
print("ok")
"""


def test_each_module_waits_for_its_own_chunks_and_the_forward_for_all():
    """Two real ranks over gloo: the chunks a parameter lies in (one piece of every partition a
    chunk), a module's forward waits for those only, and the whole forward leaves the weights
    whole: every rank's partition."""
    two_gloo_ranks(GATHER)


PACKED = r"""
import os, sys, torch, torch.distributed as dist
from app.runtime.dist import shutdown
from app.runtime.gather import ParamGather
rank = int(sys.argv[2])
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=rank, world_size=2)
model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 128),
                            torch.nn.Linear(128, 256))
flats, parts = [], []
for i, layer in enumerate(model):  # a group a layer, each its own flat, as DeepSpeed makes them
    params = list(layer.parameters())  # the packed ones requiring grad, as BF16_Optimizer's do
    flat = torch.zeros(sum(p.numel() for p in params), requires_grad=i > 0)
    offset = 0
    for p in params:
        p.data = flat.narrow(0, offset, p.numel()).view_as(p)
        offset += p.numel()
    half = flat.numel() // 2
    flats.append(flat)
    parts.append([flat.narrow(0, 0, half), flat.narrow(0, half, half)])
# partitions of 65,792, 32,832 and 16,512 a rank; the reducer's pieces 32,768 (65,536-element
# buckets at 2 ranks): under a floor of 40,000 the last two groups are one chunk
g = ParamGather(model, flats, parts, [None] * 3, alignment=1, by_group=True,
                pairwise=PAIRWISE, min_piece=40_000)
assert g.chunk_groups == [[0], [1, 2]] and g.chunks == 2, g.chunk_groups
assert [g.chunks_stepped(i) for i in range(4)] == [0, 1, 1, 2]  # _launching_early's launches
assert g.chunks_of(model[0].weight) == {0} and g.chunks_of(model[1].bias) == {1}
assert g.chunks_of(model[2].weight) == {1} and "packed" in g.describe()
with torch.no_grad():
    for part in parts:
        part[rank].fill_(rank + 1.0)  # this rank's updated partitions
g.launch_upto(g.chunks_stepped(2))  # groups 0 and 1 stepped: chunk 1 waits for group 2
assert len(g.works) == 1 and not g.staged
g.launch()
assert len(g.works) == 2 and len(g.works[1]) == (2 if PAIRWISE else 1) and 1 in g.staged
model[0](torch.zeros(1, 256))  # layer 0's hook waited for chunk 0 only
assert g.done == {0}, g.done
model(torch.zeros(1, 256))  # the whole forward: chunk 1 in, copied out of its staging rows
assert not g.works and not g.staged
for flat in flats:
    half = flat.numel() // 2
    assert torch.equal(flat, torch.cat([torch.ones(half), torch.full((half,), 2.0)]))
dist.barrier()
shutdown()  # app's own: an exit just after a barrier can abort in gloo's thread
print("ok")
"""


@pytest.mark.parametrize("pairwise", [True, False], ids=["pairwise", "all_gather"])
def test_short_groups_are_packed_into_one_collective(pairwise):
    """Two real ranks over gloo, layer blocks whose short groups a floor packs into one chunk:
    the chunk is one collective (pairwise: one exchange with each peer; else one
    all_gather_into_tensor, the NCCL branch's code) into staging rows, copied out into both
    groups' flats at the wait; an optimizer step launches a chunk only once all its groups have
    stepped; parameters map to their groups' chunk."""
    two_gloo_ranks(PACKED.replace("PAIRWISE", str(pairwise)))


def _train_with_resume(dataset: Path, out: Path, monkeypatch, *extra: str, overlap: bool):
    """HALF steps (saved), then a resume of the same run to STEPS with a rollback in it, through
    the real launcher."""
    if not overlap:  # DeepSpeed's own blocking gather
        extra = (*extra, "--deepspeed-patches", "all,-param_gather")
    with monkeypatch.context() as env:
        if overlap:
            env.setenv(TRACE_ENV, str(out.parent / f"{out.name}.trace"))
        first = check(launch("train", "--data", dataset, "--out", out, *COMMON, "--max-steps",
                             str(HALF), *extra))
        env.setenv("DSPRETRAIN_TEST_POISON", POISON)
        resumed = check(launch("train", "--data", dataset, "--out", out, *COMMON, "--max-steps",
                               str(STEPS), *extra))
        assert "rolling back" in resumed.stderr
    return first


def eval_losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(m["step"], m["eval/loss"]) for m in metrics(run_dir) if "eval/loss" in m]


def _traces(out: Path) -> list[list[dict]]:
    return [[json.loads(line) for line in Path(f"{out.parent / out.name}.trace.rank{r}")
             .read_text().splitlines()] for r in (0, 1)]


def _waited_in_forward(step: dict) -> list[int]:
    """Chunks launched by the step and waited for only once the next forward had begun."""
    events = [(kind, c) for kind, c, _ in step["events"]]
    if ("forward", -1) not in events:
        return []
    start = events.index(("forward", -1))
    return [c for i, (kind, c) in enumerate(events)
            if kind == "launch" and i < start < events.index(("done", c))]


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("extra", [[], ["--precision", "bf16"], ["--zero", "2"]],
                         ids=["fp32", "bf16", "zero2"])
def test_the_weights_gather_during_the_next_forward_and_train_the_same_losses(
        extra, mlm_dataset, tmp_path, monkeypatch):
    """ZeRO-1 at 2 ranks (fp32: DeepSpeedZeroOptimizer; bf16: BF16_Optimizer), ZeRO-2 (its
    buckets async on CPU: app/runtime/zero2_overlap.py): every step's
    gather chunks are launched by the step and waited for in the next forward, and the losses
    (train and eval), across a save, a resume and a rollback, are those of DeepSpeed's blocking
    gather."""
    overlapped = tmp_path / "overlapped"
    first = _train_with_resume(mlm_dataset, overlapped, monkeypatch, *extra, overlap=True)
    assert "during the next forward" in first.stderr  # the start-up `gradients:` line
    engine = json.loads((overlapped / "config.json").read_text())["engine"]
    assert "during the next forward" in engine["grad_reduction"]
    traces = _traces(overlapped)
    for rank_steps in traces:
        waited = [_waited_in_forward(step) for step in rank_steps]
        # each step but a run's last launches its chunks, in order, for the next forward
        assert sum(1 for w in waited if w) >= STEPS - 2, waited
        for step in rank_steps:
            launched = [c for kind, c, _ in step["events"] if kind == "launch"]
            assert launched == list(range(step["chunks"])) and step["chunks"] > 1
            events = [(kind, c) for kind, c, _ in step["events"]]
            if "bf16" not in extra:  # DeepSpeedZeroOptimizer steps group by group: a block's
                # chunk is on the wire while the later blocks step (gather._launching_early;
                # at 2 ranks bert-tiny's 15 groups are packed into 4 chunks: app.runtime.overlap
                # packs)
                last_group = ("optimizer", max(c for kind, c in events if kind == "optimizer"))
                assert events.index(("launch", 0)) < events.index(last_group), events
    # observed, not only ordered: some chunk was still on the wire when a forward began
    assert any(kind == "in_flight" for steps in traces for step in steps
               for kind, _, _ in step["events"])
    reference = tmp_path / "deepspeed"
    ref_first = _train_with_resume(mlm_dataset, reference, monkeypatch, *extra, overlap=False)
    assert "during the next forward" not in ref_first.stderr
    ref, got = train_losses(reference), train_losses(overlapped)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert got == ref  # bit-identical: the same bytes land in the same buffers
    assert len(eval_losses(overlapped)) >= 3 and eval_losses(overlapped) == eval_losses(reference)
