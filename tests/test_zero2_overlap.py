"""ZeRO-2's bucket reductions launched asynchronously on CPU (app/runtime/zero2_overlap.py): the
collectives are in flight while backward still runs, and the losses are bit for bit those of
DeepSpeed's own (blocking) reduction, at every micro step of gradient accumulation."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.runtime.overlap import TRACE_ENV
from app.runtime.zero2_overlap import PENDING_BUCKETS
from tests.helpers import REPO, TINY, check, launch, train_losses

STEPS = 3


def _run(dataset: Path, out: Path, monkeypatch, *extra: str, patched: bool = True):
    """A 2-rank ZeRO-2 run through the real launcher; the patched one traces its collectives."""
    if not patched:  # DeepSpeed's own ZeRO-2 reduction
        extra = (*extra, "--deepspeed-patches", "all,-zero2_overlap")
    with monkeypatch.context() as env:
        if patched:
            env.setenv(TRACE_ENV, str(out.parent / f"{out.name}.trace"))
        return check(launch("train", "--data", dataset, "--out", out, *TINY, "--max-steps",
                            str(STEPS), "--log-every", "1", "--dropout", "0", "--eval-every", "0",
                            "--save-every", "0", "--eval-samples", "8",  # not read here
                            *([] if "--ds-config" in extra else ["--zero", "2"]), *extra))


def _in_flight_while_backward_runs(backward: dict) -> list[int]:
    """Collectives seen not yet complete by a gradient hook after their launch (backward was
    still producing gradients), and all complete by the time their completion ran."""
    events = backward["events"]
    launched = {k: t for kind, k, t in events if kind == "launch"}
    done = {k: t for kind, k, t in events if kind == "done"}
    assert sorted(launched) == sorted(done) == list(range(backward["collectives"]))
    return sorted({k for kind, k, t in events
                   if kind == "in_flight" and launched[k] < t < done[k]})


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("extra", [["--grad-accum", "1"], ["--grad-accum", "2"],
                                   ["--grad-accum", "2", "--precision", "bf16", "--seq-len",
                                    "32"],
                                   ["--grad-accum", "1", "--ds-config", "REDUCE"]],
                         ids=["fp32-ga1", "fp32-ga2", "bf16-ga2", "fp32-ga1-reduce"])
def test_zero2_collectives_overlap_backward_and_train_the_same_losses(
        extra, mlm_dataset, tmp_path, monkeypatch):
    """On gloo each slice goes to its owner only (DeepSpeed: an all-reduce of the bucket by
    default; a reduce to each owner with `use_multi_rank_bucket_allreduce` off, REDUCE). bf16
    at 32 tokens a sample (bf16 steps on CPU cost by their tokens): the buckets are the
    parameters', and a shorter backward leaves the collectives no less in flight."""
    if "REDUCE" in extra:
        ds = json.loads((REPO / "ds_configs" / "zero2.json").read_text())
        ds["zero_optimization"]["use_multi_rank_bucket_allreduce"] = False
        (tmp_path / "reduce.json").write_text(json.dumps(ds))
        extra = [str(tmp_path / "reduce.json") if x == "REDUCE" else x for x in extra]
    patched = tmp_path / "patched"
    proc = _run(mlm_dataset, patched, monkeypatch, *extra)
    engine = json.loads((patched / "config.json").read_text())["engine"]
    assert "launched asynchronously during backward" in engine["grad_reduction"]
    assert "launched asynchronously during backward (each slice sent to its owner only)" \
        in proc.stderr  # the start-up line
    accum = int(extra[1])
    for rank in (0, 1):
        backwards = [json.loads(line) for line in
                     Path(f"{patched.parent / patched.name}.trace.rank{rank}").read_text()
                     .splitlines()]
        assert len(backwards) == STEPS * accum  # every micro step reduces at ZeRO-2
        for backward in backwards:
            assert backward["collectives"] > 1
            kinds = [kind for kind, _, _ in backward["events"]]
            # launched in a hook, with gradients still to come in the same backward
            first_launch = kinds.index("launch")
            assert "ready" in kinds[first_launch:]
            assert kinds.index("backward_end") > first_launch
            # the end of backward's last bucket (and an oversized gradient) goes out behind the
            # ones in flight, before backward's end waits for any of them
            assert max(i for i, kind in enumerate(kinds) if kind == "launch") \
                < kinds.index("backward_end")
        # observed, not only ordered: some collective still running while backward went on
        assert any(_in_flight_while_backward_runs(b) for b in backwards)
        # more buckets in flight than DeepSpeed's two ipg buffers allow, never more than the cap
        depths = [b["in_flight_max"] for b in backwards]
        assert max(depths) > 2 and max(depths) <= PENDING_BUCKETS, depths
    reference = tmp_path / "deepspeed"
    proc = _run(mlm_dataset, reference, monkeypatch, *extra, patched=False)
    assert "not overlapped: --deepspeed-patches leaves it out" in proc.stderr
    ref, got = train_losses(reference), train_losses(patched)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert got == ref  # bit for bit: the same arithmetic, only its timing moved


COVERAGE = r"""
import json, os, sys, torch
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1",
                  LOCAL_RANK="0")
import deepspeed
from app.runtime.zero2_overlap import overlap_zero2
deepspeed.init_distributed("gloo")
out = {}
for name, zero in json.loads(sys.argv[2]).items():
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2, **zero},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config)
    text = overlap_zero2(engine)
    out[name] = [text, engine.optimizer.reduce_bucket_size,
                 hasattr(engine.optimizer, "app_zero2_overlap")]
print(json.dumps(out))
"""


def test_what_the_patch_does_not_cover_stays_on_deepspeeds_path_and_says_why():
    """A real ZeRO-2 optimizer (one rank, gloo): our config's knobs are patched, with a bucket
    cut to overlap when the configured one holds the whole model; one ipg buffer or one
    all-reduce a bucket stay DeepSpeed's, and the start-up text says why."""
    from app.runtime.dist import free_port
    from tests.helpers import python

    ours = {"overlap_comm": True, "contiguous_gradients": True, "reduce_scatter": True}
    cases = {"ours": {**ours, "reduce_bucket_size": 50_000_000},
             "small_bucket": {**ours, "reduce_bucket_size": 70_000},
             "one_buffer": {**ours, "overlap_comm": False},
             "allreduce": {**ours, "reduce_scatter": False}}
    proc = python("-c", COVERAGE, free_port(), json.dumps(cases), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    text, bucket, patched = got["ours"]
    assert patched and bucket == 65_536  # 2 x 65,792 elements: an eighth, at least 64 Ki
    assert "launched asynchronously during backward" in text and "held the whole model" in text
    text, bucket, patched = got["small_bucket"]
    assert patched and bucket == 70_000 and "held the whole model" not in text
    for case, why in (("one_buffer", "overlap_comm off"), ("allreduce", "reduce_scatter off")):
        text, _, patched = got[case]
        assert not patched and "not overlapped" in text and why in text, (case, text)
