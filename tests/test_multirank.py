"""Two ranks through the real `deepspeed` launcher (CPU accelerator, gloo): ZeRO 0-3 agree,
one rank and two give the same losses at the same global batch, resume is exact per rank,
--stage-to reads a node-local copy, ZeRO-3 partitions export, bad input stops every rank."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForMaskedLM

from app.__main__ import main as app_main
from tests.helpers import TINY, check, error_lines, launch, metrics, run_app, train_losses

# zero_runs launches four 2-rank runs before its first test
pytestmark = [pytest.mark.multirank, pytest.mark.slow, pytest.mark.timeout(1200)]

STEPS = 4
# global batch 16 = micro 4 x grad-accum 2 x 2 ranks; dropout 0 so world sizes compare; evals
# of 8 samples (TINY's 16): no test here reads them
COMMON = [*TINY, "--max-steps", str(STEPS), "--log-every", "1", "--grad-accum", "2",
          "--dropout", "0", "--eval-samples", "8"]


@pytest.fixture(scope="module")
def zero_runs(mlm_dataset, tmp_path_factory):
    """One 2-rank run per ZeRO stage (ZeRO-1 also stages its data to a node-local dir)."""
    root = tmp_path_factory.mktemp("zero")
    runs = {}
    for stage in (0, 1, 2, 3):
        extra = ["--stage-to", root / "local_copy"] if stage == 1 else []
        run = root / f"zero{stage}"
        check(launch("train", "--data", mlm_dataset, "--out", run, *COMMON, "--zero", stage,
                     *extra))
        runs[stage] = run
    return root, runs


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_every_zero_stage_matches_zero0(zero_runs, stage):
    _, runs = zero_runs
    ref, got = train_losses(runs[0]), train_losses(runs[stage])
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-5), (stage, step)
    config = json.loads((runs[stage] / "config.json").read_text())
    assert config["zero_stage"] == stage and config["environment"]["world_size"] == 2
    if stage == 3:  # partitions shared with the optimizer's fp32 masters, matrices partitioned
        state = {s: [m["sys/model_state_gb"] for m in metrics(runs[s])
                     if "sys/model_state_gb" in m][-1] for s in (0, 3)}
        assert state[3] <= 0.55 * state[0], state
    assert config["batch"]["global_batch"] == 16 and config["batch"]["grad_accum"] == 2


def test_one_rank_logs_the_same_losses_at_the_same_global_batch(zero_runs, mlm_dataset):
    root, runs = zero_runs
    single = root / "one_rank"
    check(run_app("train", "--data", mlm_dataset, "--out", single, *COMMON, "--grad-accum", "4"))
    ref, got = train_losses(runs[0]), train_losses(single)
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-5), step


def test_stage_to_reads_the_node_local_copy(zero_runs, mlm_dataset):
    root, runs = zero_runs
    data = json.loads((runs[1] / "config.json").read_text())["data"]
    assert data["source"] == str(mlm_dataset)
    assert data["read_from"] == str(root / "local_copy") and data["staged"] is True
    copied = json.loads((root / "local_copy" / "dataset.json").read_text())
    assert copied == json.loads((mlm_dataset / "dataset.json").read_text())


def test_zero3_partitions_export_to_the_trained_model(zero_runs, tmp_path):
    _, runs = zero_runs
    assert sorted(p.name for p in (runs[3] / "checkpoints" / f"global_step{STEPS}").glob(
        "*optim_states.pt")).__len__() == 2  # one partition per rank
    assert app_main(["export", str(runs[3]), "--out", str(tmp_path / "hf")]) == 0
    model = AutoModelForMaskedLM.from_pretrained(tmp_path / "hf").eval()
    ref = torch.load(runs[3] / "reference.pt")
    with torch.no_grad():
        logits = model(input_ids=ref["input_ids"], attention_mask=ref["attention_mask"]).logits
    torch.testing.assert_close(logits, ref["logits"], rtol=0, atol=1e-5)


def test_two_rank_resume_is_exact_with_dropout(mlm_dataset, tmp_path):
    """Each rank restores its own RNG: with dropout on, split == straight, step by step."""
    common = ["--data", mlm_dataset, *COMMON, "--dropout", "0.1", "--zero", "2",
              "--eval-every", "2"]
    check(launch("train", *common, "--out", tmp_path / "straight"))
    check(launch("train", *common, "--out", tmp_path / "split", "--stop-at-step", "2"))
    ckpt = tmp_path / "split" / "checkpoints" / "global_step2"
    assert {p.name for p in ckpt.glob("rng_rank*.pt")} == {"rng_rank0.pt", "rng_rank1.pt"}
    check(launch("train", *common, "--out", tmp_path / "split"))
    straight, split = train_losses(tmp_path / "straight"), train_losses(tmp_path / "split")
    assert sorted(split) == list(range(1, STEPS + 1))
    for step in straight:
        assert split[step] == pytest.approx(straight[step], abs=1e-6), step


def test_bad_input_stops_every_rank_with_one_line(mlm_dataset, tmp_path):
    proc = launch("train", "--data", mlm_dataset, "--out", tmp_path / "r", *TINY,
                  "--seq-len", "4096")
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in error_lines(proc.stderr + proc.stdout) if "error:" in line]
    assert lines and all("above the 512 positions" in line for line in lines), lines
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not (tmp_path / "r").exists()
