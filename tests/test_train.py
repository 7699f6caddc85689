"""`app train` on one rank, as a real process: learning, run directory, resume, bad input."""
from __future__ import annotations

import json
import shutil

import pytest

from app.__main__ import main as app_main
from tests.helpers import TINY, check, error_lines, metrics, run_app, snapshot, train_losses

pytestmark = pytest.mark.slow

METRIC_NAMES = {"step", "consumed_samples", "tokens_seen", "train/loss", "train/lr",
                "train/grad_norm", "perf/tokens_per_sec", "perf/samples_per_sec",
                "perf/step_time_ms", "perf/data_wait_pct", "sys/mem_gb", "sys/max_mem_gb"}


@pytest.fixture(scope="module")
def mlm_run(mlm_dataset, tmp_path_factory):
    """40 steps of bert-tiny on the stdlib corpus, with a real (offline) wandb run."""
    run = tmp_path_factory.mktemp("runs") / "mlm"
    proc = check(run_app("train", "--data", mlm_dataset, "--out", run, *TINY,
                         "--micro-batch", "8", "--lr", "2e-3", "--max-steps", "40",
                         "--log-every", "5", "--eval-every", "20", "--save-every", "10",
                         "--keep-last", "2", "--wandb", "offline"))
    return run, proc


def test_loss_falls_on_the_stdlib_corpus(mlm_run):
    run, _ = mlm_run
    losses = train_losses(run)
    assert sorted(losses) == list(range(5, 41, 5))
    assert losses[40] < losses[5] - 1.0, losses
    evals = [m["eval/loss"] for m in metrics(run) if "eval/loss" in m]
    assert len(evals) == 2 and evals[1] < evals[0]


def test_run_directory_follows_the_design(mlm_run, mlm_dataset):
    run, proc = mlm_run
    logged = metrics(run)
    assert METRIC_NAMES <= set(logged[0])
    evals = [m for m in logged if "eval/loss" in m]
    assert {"eval/loss", "eval/accuracy", "eval/perplexity"} <= set(evals[-1])
    assert logged[-1]["tokens_seen"] == 40 * 8 * 64 and logged[-1]["consumed_samples"] == 320
    config = json.loads((run / "config.json").read_text())
    assert config["batch"] == {"micro_batch": 8, "grad_accum": 1, "global_batch": 8,
                               "global_batch_tokens": 512}
    assert config["precision"] == "fp32" and config["zero_stage"] == 0
    assert config["ds_config"]["optimizer"]["params"]["lr"] == 2e-3
    assert config["data"]["read_from"] == str(mlm_dataset)
    assert config["environment"]["world_size"] == 1
    assert config["environment"]["device"]["name"] == "cpu"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 40 and summary["tokens_per_sec"] > 0
    assert summary["best_eval_loss"] == min(m["eval/loss"] for m in evals)
    tags = sorted(p.name for p in (run / "checkpoints").iterdir() if p.is_dir())
    assert tags == ["global_step30", "global_step40"]  # keep-last 2
    assert (run / "checkpoints" / "latest").read_text().strip() == "global_step40"
    assert list((run / "wandb").glob("offline-run-*")), "no offline wandb run"
    assert "step     40 | loss" in proc.stderr  # console line


def test_resume_continues_exactly(mlm_dataset, tmp_path):
    """N steps straight vs N/2, stop, resume: same per-step losses (dropout on: RNG restored)."""
    common = ["--data", mlm_dataset, *TINY, "--max-steps", "6", "--grad-accum", "2",
              "--dropout", "0.1", "--log-every", "1", "--eval-every", "2", "--num-workers", "1",
              "--eval-samples", "8"]  # the evals are in the resumed path, not read
    check(run_app("train", *common, "--out", tmp_path / "straight"))
    check(run_app("train", *common, "--out", tmp_path / "split", "--stop-at-step", "3"))
    assert max(train_losses(tmp_path / "split")) == 3
    proc = check(run_app("train", *common, "--out", tmp_path / "split"))
    assert "resumed from" in proc.stderr
    straight, split = train_losses(tmp_path / "straight"), train_losses(tmp_path / "split")
    assert sorted(split) == list(range(1, 7))
    for step in straight:
        assert split[step] == pytest.approx(straight[step], abs=1e-6), step
    assert len({round(v, 6) for v in straight.values()}) == 6  # the losses do move

    # the finished run's command again changes nothing (before: summary.json rewritten with
    # 0 tokens/s and no final eval)
    before = snapshot(tmp_path / "split")
    again = check(run_app("train", *common, "--out", tmp_path / "split"))
    assert "finished at step 6" in again.stderr and "nothing was changed" in again.stderr
    assert snapshot(tmp_path / "split") == before

    # the same checkpoint on another dataset is refused, before any training
    other = tmp_path / "other_data"
    shutil.copytree(mlm_dataset, other)
    manifest = json.loads((other / "dataset.json").read_text())
    manifest["fingerprint"] = "xxh3_128:" + "0" * 32
    (other / "dataset.json").write_text(json.dumps(manifest))
    refused = run_app("train", *common[2:], "--data", other, "--out", tmp_path / "split",
                      "--max-steps", "8")
    assert refused.returncode == 2 and "refusing to resume on different data" in refused.stderr
    assert "Traceback" not in refused.stderr


def test_a_resume_applies_a_changed_lr_and_refuses_an_optimizer_setting(mlm_dataset, tmp_path):
    """Before: --lr on a resume was ignored (the checkpoint's LR schedule kept its base LR)
    while config.json recorded the new value. The schedule's settings apply from the first
    step, said in a line; the optimizer's own settings (its state carries them) are refused."""
    common = ["--data", mlm_dataset, *TINY, "--max-steps", "6", "--log-every", "1",
              "--warmup-steps", "0", "--lr-decay", "constant", "--lr", "1e-3",
              "--eval-samples", "8"]  # the end-of-run eval: not read
    run, other = tmp_path / "run", tmp_path / "other"
    check(run_app("train", *common, "--out", run, "--stop-at-step", "3"))
    shutil.copytree(run, other)
    proc = check(run_app("train", *common, "--out", run, "--lr", "2e-3"))
    assert "resume: --lr 0.002 (the checkpoint's run: 0.001): applied from step 4" in proc.stderr
    lrs = {m["step"]: m["train/lr"] for m in metrics(run) if "train/lr" in m}
    assert [lrs[s] for s in range(1, 7)] == pytest.approx([1e-3] * 3 + [2e-3] * 3)
    assert json.loads((run / "config.json").read_text())["run"]["lr"] == 2e-3
    before = snapshot(other)
    refused = run_app("train", *common, "--out", other, "--weight-decay", "0.1")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-2000:]
    lines = [ln for ln in error_lines(refused.stderr) if "error:" in ln]
    assert len(lines) == 1 and "--weight-decay was 0.01 and is 0.1" in lines[0]
    assert snapshot(other) == before


def one_line_error(capsys, argv) -> str:
    try:
        rc = app_main([str(a) for a in argv])
    except SystemExit as e:  # argparse's own errors exit from inside the parser
        rc = e.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert rc == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("extra,match", [
    (["--model", "bert-huge"], "unknown preset"),
    (["--zero", "7"], "ZeRO stages"),
    (["--micro-batch", "0"], "--micro-batch 0"),
    (["--seq-len", "1024"], "above the 512 positions"),
    (["--model-arg", "vocab_size=100"], "token ids go up to"),
    (["--objective", "clm", "--model", "bert-tiny"], "encoder"),
    (["--no-such-flag"], "unrecognized arguments"),
    (["--max-steps", "-3"], "--max-steps -3"),
])
def test_bad_flags_exit_2_with_one_line(capsys, mlm_dataset, tmp_path, extra, match):
    line = one_line_error(capsys, ["train", "--data", mlm_dataset, "--out", tmp_path / "r",
                                   *extra])
    assert match in line
    assert not (tmp_path / "r").exists()  # nothing written


def test_bad_paths_exit_2_with_one_line(capsys, mlm_dataset, tmp_path):
    run = tmp_path / "r"
    assert "no such dataset directory" in one_line_error(
        capsys, ["train", "--data", tmp_path / "nope", "--out", run])
    incomplete = tmp_path / "incomplete"
    incomplete.mkdir()
    assert "no dataset.json" in one_line_error(capsys, ["train", "--data", incomplete,
                                                        "--out", run])
    bad_json = tmp_path / "ds.json"
    bad_json.write_text('{"zero_optimization": {"stage": 1},,}')
    assert f"{bad_json}: line 1" in one_line_error(
        capsys, ["train", "--data", mlm_dataset, "--out", run, "--ds-config", bad_json])
    empty = tmp_path / "empty_run"
    empty.mkdir()
    assert "no checkpoint there" in one_line_error(
        capsys, ["train", "--data", mlm_dataset, "--out", run, "--resume", empty])
    assert not run.exists()


def test_an_existing_run_is_not_replaced_silently(capsys, mlm_run, mlm_dataset):
    run, _ = mlm_run
    line = one_line_error(capsys, ["train", "--data", mlm_dataset, "--out", run,
                                   "--resume", "never"])
    assert "holds a previous run" in line and "--overwrite" in line
    assert (run / "checkpoints" / "latest").is_file()


def test_plan_settles_the_run_before_any_process_group(mlm_dataset, tmp_path):
    """Token budget -> steps, default warmup, ds_config filled from the flags (no training)."""
    import argparse

    from app.config import TrainConfig, add_arguments
    from app.runtime.device import detect
    from app.runtime.dist import World
    from app.settle import plan_run

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--data", str(mlm_dataset), "--out", str(tmp_path / "r"),
                              "--seq-len", "64", "--micro-batch", "4", "--global-batch", "16",
                              "--max-steps", "100", "--max-tokens", "5000", "--lr", "3e-4",
                              "--zero", "2"])
    plan = plan_run(TrainConfig.from_args(args), detect(), World(0, 2, 0, 2))
    ds = plan.ds_config  # the batch sizes, as the engine reads them
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"],
            ds["train_batch_size"]) == (4, 2, 16)
    assert plan.total_steps == 5  # ceil(5000 tokens / (16 x 64 tokens a step))
    assert plan.warmup_steps == 1 and plan.precision == "fp32" and plan.eval_sources == (0,)
    assert ds["zero_optimization"]["stage"] == 2
    assert ds["optimizer"]["params"]["lr"] == 3e-4 and ds["bf16"]["enabled"] is False
    vocab = json.loads((mlm_dataset / "dataset.json").read_text())["vocab_size"]
    assert (vocab, plan.model_config.vocab_size) == (2000, 2048)  # padded to a multiple of 128
    assert not (tmp_path / "r").exists()


def test_resume_checks_geometry_but_lets_dropout_change(tmp_path):
    from app.checkpoint.store import check_resumable
    from data_tools.errors import UserError

    saved = {"dataset_fingerprint": "xxh3_128:aa",
             "model_config": {"num_hidden_layers": 2, "hidden_dropout_prob": 0.1,
                              "id2label": {"0": "LABEL_0"}}}
    now = {"num_hidden_layers": 2, "hidden_dropout_prob": 0.0, "id2label": {0: "LABEL_0"}}
    check_resumable(saved, fingerprint="xxh3_128:aa", model_config=now, where=tmp_path)
    with pytest.raises(UserError, match="num_hidden_layers"):
        check_resumable(saved, fingerprint="xxh3_128:aa",
                        model_config=now | {"num_hidden_layers": 4}, where=tmp_path)
    with pytest.raises(UserError, match="different data"):
        check_resumable(saved, fingerprint="xxh3_128:bb", model_config=now, where=tmp_path)


def test_an_empty_or_foreign_latest_is_no_checkpoint(tmp_path):
    from app.checkpoint.tags import latest_tag

    (tmp_path / "global_step7").mkdir()
    (tmp_path / "notes").mkdir()
    for text, want in [("global_step7", "global_step7"), ("", None), ("notes", None),
                       ("global_step8", None)]:
        (tmp_path / "latest").write_text(text)
        assert latest_tag(tmp_path) == want


def test_resuming_an_older_tag_beside_later_ones_is_refused(tmp_path):
    # saving from step 110 next to an abandoned 200 and 300 would mix two histories
    from app.checkpoint.tags import tags_after

    for step in (100, 200, 300):
        (tmp_path / f"global_step{step}").mkdir()
    assert tags_after(tmp_path, "global_step100") == ["global_step200", "global_step300"]
    assert tags_after(tmp_path, "global_step300") == []
    assert tags_after(tmp_path, "custom") == []
    assert tags_after(tmp_path / "no", "global_step1") == []


def test_resume_beside_later_checkpoints_exits_2(capsys, mlm_run, mlm_dataset, tmp_path):
    run, _ = mlm_run
    copy = tmp_path / "run"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("wandb"))
    (copy / "checkpoints" / "global_step999").mkdir()
    tag = (copy / "checkpoints" / "latest").read_text()
    line = one_line_error(capsys, ["train", "--data", mlm_dataset, "--out", copy,
                                   "--resume", copy / "checkpoints" / tag])
    assert "holds later checkpoints (global_step999)" in line
