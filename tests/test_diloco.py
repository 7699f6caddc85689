"""The low-communication mode (`--dp-mode diloco`, app/runtime/islands.py, app/runtime/outer.py):
islands train apart and average their weights every --outer-every steps; resume is exact in the
middle of a round; the outer step's arithmetic is DiLoCo's; a change of mode or islands is
converted or refused in one line; export takes the global weights."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import TINY, check, launch, metrics, run_app, train_losses, two_gloo_ranks

# the end-of-run eval at 8 samples (TINY's 16): no test here reads it
COMMON = [*TINY, "--model", "bert-tiny", "--seed", "3", "--log-every", "1", "--eval-every", "0",
          "--dropout", "0", "--eval-samples", "8"]
DILOCO = ["--dp-mode", "diloco", "--outer-every", "3", "--island-ranks", "1"]


def train(dataset: Path, out: Path, *extra: str, procs: int = 2):
    return launch("train", "--data", dataset, "--out", out, *COMMON, *extra, procs=procs)


def one_error(proc, *needles: str) -> str:
    """The run refused in one line (every rank says the same one)."""
    lines = sorted({ln for ln in proc.stderr.splitlines() if ": error: " in ln})
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def straight(mlm_dataset, tmp_path_factory):
    """8 steps of 2 islands of one rank each (ZeRO-1), saved at step 4 (mid-round: H = 3) and
    at 8 (the last step, which syncs)."""
    out = tmp_path_factory.mktemp("diloco") / "straight"
    check(train(mlm_dataset, out, *DILOCO, "--zero", "1", "--max-steps", "8", "--save-every",
                "4"))
    return out


@pytest.mark.slow
@pytest.mark.multirank
def test_a_resume_mid_round_trains_the_uninterrupted_losses(straight, mlm_dataset, tmp_path):
    """Stopped at step 4, one step into the second round (the islands' weights apart, the
    global weights and outer momentum in the checkpoint), then resumed: every loss equals the
    uninterrupted run's, bit for bit."""
    out = tmp_path / "stopped"
    check(train(mlm_dataset, out, *DILOCO, "--zero", "1", "--max-steps", "8", "--save-every",
                "4", "--stop-at-step", "4"))
    tag = out / "checkpoints" / "global_step4"
    assert {p.name for p in tag.iterdir()} >= {"island0", "island1", "outer_rank0.pt",
                                                "outer_rank1.pt", "manifest.json"}
    manifest = json.loads((tag / "manifest.json").read_text())["files"]
    assert "island1/zero_pp_rank_0_mp_rank_00_optim_states.pt" in manifest
    assert "outer_rank1.pt" in manifest
    check(train(mlm_dataset, out, *DILOCO, "--zero", "1", "--max-steps", "8", "--save-every",
                "4"))
    assert train_losses(out) == train_losses(straight)


@pytest.mark.slow
@pytest.mark.multirank
def test_a_rollback_reloads_the_islands_and_the_outer_state(mlm_dataset, tmp_path):
    """A NaN loss at step 6 (global batch 5) rolls back to step 4's checkpoint, mid-round: each
    island's own state and the global weights come back, batch 5 is skipped, and the run ends."""
    from tests.helpers import clean_env

    out = tmp_path / "run"
    proc = launch("train", "--data", mlm_dataset, "--out", out, *COMMON, *DILOCO, "--zero", "1",
                  "--max-steps", "8", "--save-every", "2",
                  env=clean_env(DSPRETRAIN_TEST_POISON="5:nan"))
    check(proc)
    assert "rolled back to" in proc.stderr and "global_step4" in proc.stderr
    skipped = [json.loads(line) for line in (out / "skipped_batches.jsonl").open()]
    assert [r["global_batch"] for r in skipped] == [5]
    assert json.loads((out / "summary.json").read_text())["steps"] == 8


@pytest.mark.slow
@pytest.mark.multirank
def test_the_run_records_its_mode_and_what_crossed_islands(straight):
    config = json.loads((straight / "config.json").read_text())
    assert (config["run"]["dp_mode"], config["run"]["outer_every"],
            config["run"]["island_ranks"]) == ("diloco", 3, 1)
    assert config["engine"]["dp_mode"].startswith("DiLoCo: 2 islands of 1 rank(s); every 3")
    assert config["batch"]["global_batch"] == 8  # both islands' micro batches of 4
    last = [m for m in metrics(straight) if "outer/syncs" in m][-1]
    assert last["outer/syncs"] == 3  # after steps 3 and 6, and the last step (8)
    # a 2-island ring all-reduce of the fp32 weights sends them once each way: 4 bytes a weight
    params = json.loads((straight / "config.json").read_text())["model"]["parameters"]
    assert last["outer/bytes_per_step"] == pytest.approx(3 * 4 * params / 8, rel=0.01)


@pytest.mark.slow
@pytest.mark.multirank
def test_islands_of_two_ranks_train_at_zero2_in_bf16(mlm_dataset, tmp_path):
    """Four ranks as two islands of two (DeepSpeed's data-parallel world: the island), ZeRO-2 in
    bf16: trains, and the final export (the last step syncs) loads. 32 tokens a sample: bf16
    steps on CPU cost by their tokens, and nothing here reads more than that the losses are
    finite."""
    out = tmp_path / "run"
    check(train(mlm_dataset, out, "--dp-mode", "diloco", "--outer-every", "2",
                "--island-ranks", "2", "--zero", "2", "--precision", "bf16", "--max-steps", "4",
                "--seq-len", "32", procs=4))
    losses = train_losses(out)
    assert sorted(losses) == [1, 2, 3, 4] and all(torch.isfinite(torch.tensor(list(
        losses.values()))))
    check(run_app("export", out, "--out", tmp_path / "hf"))
    assert (tmp_path / "hf" / "model.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.multirank
def test_export_takes_the_global_weights_and_refuses_a_mid_round_tag(straight, tmp_path):
    check(run_app("export", straight, "--out", tmp_path / "hf"))  # step 8: synced
    (straight / "checkpoints" / "latest").write_text("global_step4")
    try:
        one_error(run_app("export", straight, "--out", tmp_path / "hf4"),
                  "global_step4: saved at step 4, in the middle of a --dp-mode diloco round",
                  "last agreed at step 3")
    finally:
        (straight / "checkpoints" / "latest").write_text("global_step8")


@pytest.mark.slow
@pytest.mark.multirank
def test_a_change_of_mode_or_islands_is_converted_or_refused(straight, mlm_dataset, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(straight, run)
    one_error(train(mlm_dataset, run, "--zero", "1", "--max-steps", "10"),
              "written by a --dp-mode diloco run", "--init-from")
    one_error(train(mlm_dataset, run, "--dp-mode", "diloco", "--island-ranks", "2", "--zero",
                    "1", "--max-steps", "10"),
              "one island of 2")  # a world of 2 in islands of 2: one island
    sync = tmp_path / "sync"
    check(train(mlm_dataset, sync, "--zero", "1", "--max-steps", "2"))
    resumed = check(train(mlm_dataset, sync, *DILOCO, "--zero", "1", "--max-steps", "4"))
    assert "is a synchronous run's; the islands start a round from its weights" in resumed.stderr
    # the recipe: from a synchronous start no note; from random weights, the note saying so
    assert "diloco from random weights" not in resumed.stderr
    fresh = check(train(mlm_dataset, tmp_path / "fresh", *DILOCO, "--zero", "1", "--max-steps",
                        "1"))
    assert fresh.stderr.count("note: --dp-mode diloco from random weights") == 1


@pytest.mark.parametrize("argv,needles", [
    (["--dp-mode", "diloco"], ["1 rank(s) make one island of 1", "two islands or more"]),
    (["--dp-mode", "diloco", "--island-ranks", "3"], ["3 rank(s) an island do not divide"]),
    (["--outer-momentum", "1"], ["--outer-momentum 1.0: must be in [0, 1)"]),
    (["--outer-every", "0"], ["--outer-every 0: must be at least 1"]),
    (["--dp-mode", "mesh"], ["invalid choice: 'mesh'"]),
])
def test_bad_settings_are_one_line(mlm_dataset, tmp_path, argv, needles):
    proc = run_app("train", "--data", mlm_dataset, "--out", tmp_path / "run", *COMMON, *argv)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    for needle in needles:
        assert needle in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.multirank
def test_zero3_is_refused_in_one_line(mlm_dataset, tmp_path):
    one_error(train(mlm_dataset, tmp_path / "run", *DILOCO, "--zero", "3", "--max-steps", "2"),
              "--dp-mode diloco runs at ZeRO 0-2", "ZeRO-3")


OUTER = r"""
import os, sys, torch, torch.distributed as dist
from types import SimpleNamespace
from app.runtime.dist import shutdown
from app.runtime.islands import Islands
from app.runtime.outer import OuterSync
rank = int(sys.argv[2])
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=rank, world_size=2)
group = dist.new_group([0, 1])
isl = Islands(size=1, count=2, index=rank, local=0, group=None, across=group, alone=None)
w = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))
opt = torch.optim.AdamW([w], lr=0.1)
engine = SimpleNamespace(optimizer=opt)
outer = OuterSync(engine, isl, every=2, lr=0.7, momentum=0.9)
start = w.detach().clone()
history = []
for round_ in range(3):  # each island moves its weights its own way, then the islands sync
    with torch.no_grad():
        w.add_(torch.tensor([0.1, -0.2, 0.3]) * (rank + 1) * (round_ + 1))
    outer.sync(step=2 * (round_ + 1))
    history.append(w.detach().clone())
# by hand: delta_k = mean over islands of (anchor - w_k); Nesterov SGD: buf = mu buf + delta;
# anchor -= lr (delta + mu buf)
anchor, buf = start.clone(), torch.zeros(3)
for round_, got in enumerate(history):
    moves = [torch.tensor([0.1, -0.2, 0.3]) * (r + 1) * (round_ + 1) for r in (0, 1)]
    delta = sum(-m for m in moves) / 2  # anchor - (anchor + move)
    buf = 0.9 * buf + delta
    anchor = anchor - 0.7 * (delta + 0.9 * buf)
    assert torch.allclose(got, anchor, atol=1e-6), (round_, got, anchor)
dist.barrier()
shutdown()
print("ok")
"""


def test_the_outer_step_is_nesterov_sgd_on_the_mean_pseudo_gradient():
    """Two islands of one rank (real gloo ranks) each move their weights differently for three
    rounds: after each sync both hold the weights DiLoCo's outer step gives by hand (the mean of
    the pseudo-gradients, torch's SGD with Nesterov momentum), on both ranks alike."""
    two_gloo_ranks(OUTER)
