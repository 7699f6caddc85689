"""Switching ZeRO stage and world size mid-run (app/checkpoint/universal.py,
app/checkpoint/convert.py), and ZeRO-3 models built partitioned (app/runtime/zero3_init.py
`partitioned`). Real processes, the real launcher, fp32.

A run under (stage a, W ranks) saves at step 4; the same run resumed from that checkpoint under
(stage b, W' ranks) with the same global batch must log the same losses for steps 5-8 as the
uninterrupted run (1e-5 relative; micro batches are the same samples: global batch 8 = 4 x 2
ranks = 4 x 2 accumulation steps on one rank), and clearly different ones when the Adam moments
are dropped (so the comparison can fail).
"""
from __future__ import annotations

import itertools
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from app.runtime.overlap import BLOCKS_ENV, PARTITION_BLOCKS, partition_blocks
from tests.helpers import (
    REPO,
    check,
    clean_env,
    error_lines,
    launch,
    run_app,
    script_ranks,
    train_losses,
)

pytestmark = [pytest.mark.slow, pytest.mark.multirank]

STEPS, SAVE = 8, 4
BASE = ["--model", "bert-tiny", "--seq-len", "64", "--global-batch", "8", "--micro-batch", "4",
        "--max-steps", str(STEPS), "--save-every", str(SAVE), "--log-every", "1",
        "--dropout", "0", "--seed", "5", "--eval-every", "0", "--wandb", "disabled",
        "--num-workers", "0", "--eval-samples", "8"]
# the end of a run evaluates; no test here reads it, and the default 256 samples cost more CPU
# than the run's 8 steps and its saves (~1.8 CPU-s a run)


def train(data: Path, out: Path, zero: int, world: int, *extra: str,
          env: dict[str, str] | None = None):
    args = ["train", "--data", data, "--out", out, *BASE, "--zero", str(zero), *extra]
    return check(launch(*args, procs=world, env=env) if world > 1 else run_app(*args, env=env))


class References:
    """The uninterrupted run of each (stage, world), made once per session."""

    def __init__(self, root: Path, data: Path):
        self.root, self.data, self.runs = root, data, {}

    def __call__(self, zero: int, world: int) -> Path:
        key = (zero, world)
        if key not in self.runs:
            out = self.root / f"ref_z{zero}w{world}"
            train(self.data, out, zero, world)
            self.runs[key] = out
        return self.runs[key]


@pytest.fixture(scope="module")
def refs(mlm_dataset, tmp_path_factory) -> References:
    return References(tmp_path_factory.mktemp("zero_refs"), mlm_dataset)


def tag_dir(run: Path) -> Path:
    return run / "checkpoints" / f"global_step{SAVE}"


def max_rel_diff(a: dict[int, float], b: dict[int, float]) -> float:
    steps = range(SAVE + 1, STEPS + 1)
    assert all(s in a and s in b for s in steps), (sorted(a), sorted(b))
    return max(abs(a[s] - b[s]) / abs(a[s]) for s in steps)


def resume_matches(refs: References, data: Path, tmp: Path, a: int, w: int, b: int, v: int,
                   resume_from: Path | None = None) -> Path:
    ref = refs(a, w)
    out = tmp / f"z{a}w{w}_to_z{b}w{v}"
    proc = train(data, out, b, v, "--resume", resume_from or tag_dir(ref))
    assert max_rel_diff(train_losses(ref), train_losses(out)) <= 1e-5
    if resume_from is None and (a, w) != (b, v) and not (a == b == 0):
        assert "converting" in proc.stderr
    return out


CI_PAIRS = [(0, 2, 3, 1), (3, 1, 0, 2), (3, 2, 3, 1)]


@pytest.mark.parametrize("a,w,b,v", CI_PAIRS, ids=lambda x: str(x))
def test_resume_under_another_stage_and_world_continues_the_run(refs, mlm_dataset, tmp_path,
                                                                a, w, b, v):
    out = resume_matches(refs, mlm_dataset, tmp_path, a, w, b, v)
    # the layout history: in the new checkpoints and in config.json
    state = json.loads((out / "checkpoints" / f"global_step{STEPS}" / "train_state.json")
                       .read_text())
    expected = [{"step": 0, "zero_stage": a, "world_size": w, "precision": "fp32",
                 "offload": False, "optimizer_blocks": partition_blocks(a)},
                {"step": SAVE, "zero_stage": b, "world_size": v, "precision": "fp32",
                 "offload": False, "optimizer_blocks": partition_blocks(b)}]
    assert state["history"] == expected
    assert json.loads((out / "config.json").read_text())["history"] == expected
    # the source was not touched; its conversion sits beside it and is reused
    src = tag_dir(refs(a, w))
    assert not (src / "universal.json").exists()
    assert (src.parent / f"{src.name}.universal" / "universal.json").is_file()


def test_convert_offline_then_resume_from_it_and_fresh_moments_differ(
        refs, mlm_dataset, tmp_path):
    """ZeRO-2 on 2 ranks -> ZeRO-1 on 1 rank through `app convert --out`; the same conversion
    with its Adam moments zeroed trains measurably differently."""
    ref = refs(2, 2)
    before = {p: p.stat().st_mtime_ns for p in tag_dir(ref).iterdir()}
    conv = tmp_path / "converted"
    proc = check(run_app("convert", tag_dir(ref), "--to-zero", "1", "--to-world", "1",
                         "--out", conv))
    assert proc.stdout.strip().splitlines()[-1] == str(conv)  # the path, last
    assert {p: p.stat().st_mtime_ns for p in tag_dir(ref).iterdir()} == before
    info = json.loads((conv / "universal.json").read_text())
    assert info["source_layout"] == {"zero_stage": 2, "world_size": 2, "precision": "fp32",
                                     "offload": False, "optimizer_blocks": PARTITION_BLOCKS}
    assert info["step"] == SAVE
    resume_matches(refs, mlm_dataset, tmp_path, 2, 2, 1, 1, resume_from=conv)

    # the moments matter: without them the continuation is clearly another run
    fresh = tmp_path / "fresh"
    shutil.copytree(conv, fresh)
    tensors = torch.load(fresh / "state.pt", weights_only=True)
    for kind in ("exp_avg", "exp_avg_sq"):
        tensors[kind] = {k: torch.zeros_like(v) for k, v in tensors[kind].items()}
    torch.save(tensors, fresh / "state.pt")
    out = tmp_path / "fresh_run"
    train(mlm_dataset, out, 1, 1, "--resume", fresh)
    assert max_rel_diff(train_losses(ref), train_losses(out)) > 1e-3

    # a second convert to the same place is refused without --overwrite, one line, exit 2
    again = run_app("convert", tag_dir(ref), "--to-zero", "1", "--to-world", "1", "--out", conv)
    assert again.returncode == 2 and len(error_lines(again.stderr)) == 1, again.stderr
    assert "--overwrite" in again.stderr


def test_precision_and_stage_switched_twice(refs, mlm_dataset, tmp_path):
    """fp32 ZeRO-2 on 2 ranks -> bf16 ZeRO-1 on 1 rank (DeepSpeed's BF16_Optimizer, written and
    read) -> fp32 ZeRO-3 on 2 ranks: each resume continues the run (bf16 within its rounding),
    and the checkpoints carry all three layouts."""
    ref = refs(2, 2)
    mid = tmp_path / "bf16"
    train(mlm_dataset, mid, 1, 1, "--precision", "bf16", "--resume", tag_dir(ref))
    assert any(mid.glob("checkpoints/global_step8/bf16_zero_pp_rank_0_*optim_states.pt"))
    assert max_rel_diff(train_losses(ref), train_losses(mid)) <= 2e-3
    end = tmp_path / "back"
    train(mlm_dataset, end, 3, 2, "--max-steps", "10",
          "--resume", mid / "checkpoints" / f"global_step{STEPS}")
    losses = train_losses(end)
    assert sorted(losses) == [9, 10] and all(abs(x - losses[9]) < 1.0 for x in losses.values())
    state = json.loads((end / "checkpoints" / "global_step10" / "train_state.json").read_text())
    assert [(h["step"], h["zero_stage"], h["world_size"], h["precision"])
            for h in state["history"]] == [(0, 2, 2, "fp32"), (SAVE, 1, 1, "bf16"),
                                           (STEPS, 3, 2, "fp32")]


def test_a_checkpoint_in_two_groups_resumes_into_layer_blocks(refs, mlm_dataset, tmp_path):
    """ZeRO-1 on 2 ranks in the optimizer's two groups (as every checkpoint written before the
    layer blocks) trains the same losses as in blocks, and its checkpoint resumes under the
    blocks through the universal form: the same continuation, every group's LR from the saved
    schedule (2 groups' in the checkpoint, 16 in the run: universal.load_schedule)."""
    ref = refs(1, 2)
    legacy = tmp_path / "two_groups"
    train(mlm_dataset, legacy, 1, 2, env=clean_env(**{BLOCKS_ENV: "1"}))
    state = json.loads((tag_dir(legacy) / "train_state.json").read_text())
    assert state["optimizer_blocks"] == 1 and state["history"][0]["optimizer_blocks"] == 1
    assert max(abs(x - y) / abs(x) for x, y in zip(train_losses(ref).values(),
                                                   train_losses(legacy).values())) <= 1e-5
    out = tmp_path / "into_blocks"
    proc = train(mlm_dataset, out, 1, 2, "--resume", tag_dir(legacy))
    assert "converting" in proc.stderr and f"{PARTITION_BLOCKS} layer blocks" in proc.stderr, \
        proc.stderr[-3000:]
    assert max_rel_diff(train_losses(ref), train_losses(out)) <= 1e-5


def test_a_zero0_checkpoint_without_its_parameters_names_converts_by_the_model(refs, tmp_path):
    """ZeRO-0 keeps Adam's state by each parameter's index in the optimizer's groups: the train
    state names them at save time, so checkpoints are read without building a model. A tag
    written before that (and before manifests) still converts: `app convert` names them from a
    skeleton of the model, to the same tensors; without such a caller the read says so."""
    from app.checkpoint import universal
    from app.models.build import skeleton_group_names
    from data_tools.errors import UserError

    src = tag_dir(refs(0, 2))
    state = json.loads((src / "train_state.json").read_text())
    assert state["param_group_names"] == skeleton_group_names(state["model_config"])
    old = tmp_path / "old" / src.name
    shutil.copytree(src, old, ignore=shutil.ignore_patterns("manifest.json"))
    for key in ("param_group_names", "manifest"):
        del state[key]
    (old / "train_state.json").write_text(json.dumps(state))
    with pytest.raises(UserError, match="app convert"):
        universal.read(old, state)
    for tag, out in ((src, tmp_path / "from_names"), (old, tmp_path / "from_model")):
        check(run_app("convert", tag, "--to-zero", "3", "--to-world", "1", "--out", out))
    named, rebuilt = (torch.load(tmp_path / out / "state.pt", weights_only=True)
                      for out in ("from_names", "from_model"))
    assert {k: sorted(v) for k, v in named.items()} == {k: sorted(v) for k, v in rebuilt.items()}
    assert all(torch.equal(named[k][n], rebuilt[k][n]) for k in named for n in named[k])


@pytest.mark.parametrize("argv,needle", [
    (["--to-zero", "3", "--to-world", "0"], "--to-world 0"),
    (["--to-zero", "5", "--to-world", "1"], "--to-zero"),
])
def test_convert_bad_arguments_are_one_line(refs, tmp_path, argv, needle):
    proc = run_app("convert", tag_dir(refs(3, 1)), *argv, "--out", tmp_path / "x")
    assert proc.returncode == 2, proc.stderr
    assert len(error_lines(proc.stderr)) == 1 and needle in proc.stderr, proc.stderr
    assert not (tmp_path / "x").exists()


def test_a_switch_that_cannot_be_honoured_is_one_line_before_the_run(
        refs, mlm_dataset, tmp_path):
    out = tmp_path / "refused"
    proc = run_app("train", "--data", mlm_dataset, "--out", out, *BASE, "--zero", "0",
                   "--precision", "bf16", "--resume", tag_dir(refs(3, 1)))
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [x for x in error_lines(proc.stderr) if not x.startswith("warning:")]
    assert len(lines) == 1 and "ZeRO-0 with bf16" in lines[0], proc.stderr[-2000:]
    assert not (out / "checkpoints").exists()
    proc = run_app("train", "--data", mlm_dataset, "--out", out, *BASE, "--zero", "3",
                   "--model-arg", "hidden_size=256", "--resume", tag_dir(refs(3, 1)))
    assert proc.returncode == 2 and "hidden_size" in proc.stderr, proc.stderr[-2000:]


def test_convert_a_missing_checkpoint_is_one_line(tmp_path):
    proc = run_app("convert", tmp_path / "nothing", "--to-zero", "3", "--to-world", "2")
    assert proc.returncode == 2 and len(error_lines(proc.stderr)) == 1, proc.stderr
    assert "nothing" in proc.stderr


def test_zero3_builds_the_model_partitioned_with_the_same_weights(tmp_path):
    """2 ranks: every parameter is partitioned from construction (no rank held the model), and
    gathered back it equals an unpartitioned build of the same seed, bit for bit."""
    probe = tmp_path / "probe.py"
    probe.write_text(f"""
import sys, torch, deepspeed
sys.path.insert(0, {str(REPO)!r})
from app.runtime.device import detect
from app.runtime.dist import barrier, init_distributed, shutdown
from app.models.build import build_model
from app.models.presets import build_config
init_distributed(detect())  # as app train joins (the shm buffer's name removed, ...)
for name in ("bert-tiny", "gpt-tiny"):
    cfg = build_config(name, vocab_size=1000, special_ids={{"pad_token_id": 0}}, overrides={{}},
                       dropout=0.0, attn_implementation="eager")
    plain = build_model(cfg, seed=3, for_training=True)
    ref = {{k: v.clone() for k, v in plain.state_dict().items()}}
    ds = {{"train_micro_batch_size_per_gpu": 1, "zero_optimization": {{"stage": 3}}}}
    m = build_model(cfg, seed=3, for_training=True, zero3_config=ds)
    assert all(hasattr(p, "ds_id") and p.numel() == 0 for p in m.parameters()), name
    with deepspeed.zero.GatheredParameters(list(m.parameters())):
        got = m.state_dict()
        bad = [k for k in ref if not torch.equal(ref[k], got[k])]
    assert not bad, (name, bad[:3])
print("same weights", flush=True)
barrier()
shutdown()  # a group left to interpreter exit can abort in gloo's threads
""")
    proc = script_ranks(probe, cwd=str(REPO), timeout=600)  # 2 ranks, the launcher's env
    assert proc.stdout.count("same weights") == 2


MATRIX = [p for p in itertools.product(range(4), (1, 2), range(4), (1, 2))
          if (p[0], p[1]) != (p[2], p[3])]


@pytest.mark.skipif(not os.environ.get("ZERO_MATRIX"),
                    reason="the whole stage x world matrix (56 resumes, ~15 min): set "
                           "ZERO_MATRIX=1")
@pytest.mark.parametrize("a,w,b,v", MATRIX, ids=lambda x: str(x))
def test_full_matrix(refs, mlm_dataset, tmp_path, a, w, b, v):
    resume_matches(refs, mlm_dataset, tmp_path, a, w, b, v)
