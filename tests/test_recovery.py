"""The anomaly policies of app.faults.recovery in process, on a fake run: a loader of per-batch
losses, a train state, checkpoints that are state dicts (milliseconds; tests/test_faults.py runs
the same policies end to end in real processes). A rollback onto a damaged checkpoint is also
run for real, at the end."""
from __future__ import annotations

import json
import math

import pytest
import torch

from app import rundir
from app.checkpoint import manifest
from app.checkpoint.train_state import TrainState
from app.faults import anomaly
from app.faults.preemption import EXIT_PREEMPTED
from app.faults.recovery import Recovery
from data_tools.errors import Stopped
from tests.helpers import TINY, check, clean_env, flip, launch, metrics, run_app

GBS, SEQ = 4, 8  # samples a global batch, tokens a sample


class Logger:
    """The three calls recovery makes of app.telemetry.sinks.MetricsLogger, recorded."""

    def __init__(self):
        self.alerts, self.records, self.notes = [], [], []

    def alert(self, kind, text):
        self.alerts.append((kind, text))

    def log(self, record):
        self.records.append(record)

    def note(self, text):
        self.notes.append(text)


class FakeRun:
    """The loop around a Recovery: step losses by global batch, saves as state dicts, a rewind
    that loads them (the engine's part of a rollback)."""

    def __init__(self, tmp_path, policy="rollback", losses=None, **rules):
        self.losses = losses or {}  # global batch -> its loss (else a flat 2.0)
        self.state = TrainState()
        self.logger = Logger()
        self.saved: dict[str, dict] = {}
        self.rewound: list[str] = []
        rules = anomaly.Rules(policy=policy, window=8, min_history=4, cooldown_steps=10,
                              cooldown_factor=0.5, **rules)
        self.recovery = Recovery(
            rules=rules, monitor=anomaly.LossMonitor(rules, torch.device("cpu")),
            skip=frozenset(), describe_batch=lambda g: {"samples": list(range(g * GBS,
                                                                              (g + 1) * GBS))},
            state=self.state, global_batch=GBS, run_dir=tmp_path, logger=self.logger,
            is_main=True)
        self.ckpt_dir = tmp_path / rundir.CHECKPOINTS

    def step(self) -> None:
        batch = self.state.consumed_samples // GBS
        loss = torch.tensor(self.losses.get(batch, 2.0), dtype=torch.float32)
        self.recovery.observe(self.state.step + 1, batch, loss)
        self.state.advance(GBS, SEQ, self.recovery.skip)

    def steps(self, n: int) -> None:
        for _ in range(n):
            self.step()

    def rows(self, ranks: int = 1) -> list[list[float]]:
        return [self.recovery.monitor.marks().tolist() + [0.0]] * ranks

    def check(self) -> bool:
        return self.recovery.check(self.rows(), self.rewind)

    def save(self) -> str:
        """A complete tag as app.checkpoint.store writes one: train_state.json, a model file,
        the manifest last, then `latest` (the weights are the state dict kept here)."""
        tag = f"global_step{self.state.step}"
        tag_dir = self.ckpt_dir / tag
        tag_dir.mkdir(parents=True)
        (tag_dir / "train_state.json").write_text(json.dumps({
            **self.state.state_dict(), "world_size": 1, "global_batch": GBS,
            "dataset_fingerprint": "fake", "model_config": {}, "run_config": {},
            "ds_config": {}, "manifest": manifest.NAME}))
        (tag_dir / "mp_rank_00_model_states.pt").write_bytes(bytes(range(256)) * 64)
        manifest.write(tag_dir, manifest.own_entries(tag_dir, 0))
        (self.ckpt_dir / "latest").write_text(tag)
        self.saved[tag] = self.state.state_dict()
        return tag

    def rewind(self, tag: str) -> None:
        self.rewound.append(tag)
        self.state.load_state_dict(self.saved[tag])


def skipped(tmp_path) -> list[dict]:
    path = tmp_path / rundir.SKIPPED
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_clean_check_does_nothing(tmp_path):
    run = FakeRun(tmp_path)
    run.steps(5)
    assert run.check() is False
    assert run.rewound == [] and run.logger.alerts == [] and run.recovery.skip == frozenset()


def test_rollback_loads_the_last_checkpoint_skips_the_batch_and_cools_down(tmp_path):
    run = FakeRun(tmp_path, losses={6: math.nan})
    run.steps(5)
    assert not run.check()
    run.save()  # step 5
    run.steps(3)  # steps 6-8: step 7 trains on batch 6, NaN
    assert run.check() is True
    assert run.rewound == ["global_step5"]
    s = run.state
    assert s.step == 5 and s.consumed_samples == 5 * GBS  # batch 5 is next: not skipped
    assert run.recovery.skip == {6}
    assert [(r["step"], r["global_batch"], r["positions"], r["reason"]) for r in
            skipped(tmp_path)] == [(7, 6, [24, 28], "non-finite loss at step 7 (loss nan)")]
    assert skipped(tmp_path)[0]["samples"] == [24, 25, 26, 27]
    assert (s.cooldown.start, s.cooldown.steps, s.cooldown.factor) == (5, 10, 0.5)
    assert s.cooldown(5) == 0.5 and s.cooldown(15) == 1.0
    assert run.logger.records[0]["event"] == "rolling back" and run.logger.records[0][
        "event/step"] == 7
    assert run.recovery.monitor.marks().tolist()[0] == -1  # the marks start afresh
    run.steps(2)  # steps 6-7 train on batches 5 and 7: batch 6 is never seen again
    assert run.state.consumed_samples == 8 * GBS and not run.check()


def test_after_a_rollback_the_skipped_batch_is_stepped_over(tmp_path):
    run = FakeRun(tmp_path, losses={5: math.nan})
    run.steps(5)
    run.save()
    run.steps(1)  # step 6 trains on batch 5
    assert run.check()
    assert run.state.consumed_samples == 6 * GBS  # the position moved past batch 5


def test_skip_policy_skips_a_spike_without_rolling_back(tmp_path):
    run = FakeRun(tmp_path, policy="skip", losses={8: 50.0})
    run.steps(10)  # step 9 trains on batch 8: a spike over a flat history
    assert run.check() is False
    assert run.rewound == [] and run.recovery.skip == {8}
    assert [r["global_batch"] for r in skipped(tmp_path)] == [8]
    assert "loss spike at step 9" in run.logger.alerts[0][1]
    assert run.state.step == 10 and run.recovery.monitor.marks().tolist()[0] == -1


def test_skip_policy_rolls_back_when_the_loss_is_not_finite(tmp_path):
    run = FakeRun(tmp_path, policy="skip", losses={3: math.inf})
    run.steps(2)
    run.save()
    run.steps(3)
    assert run.check() is True and run.rewound == ["global_step2"]
    assert run.logger.records[0]["event"] == "rolling back (the weights are not finite)"


def test_stop_policy_stops_with_the_evidence(tmp_path):
    run = FakeRun(tmp_path, policy="stop", losses={2: math.nan})
    run.steps(4)
    with pytest.raises(Stopped, match="non-finite loss at step 3.*--on-anomaly stop") as e:
        run.check()
    assert e.value.code == anomaly.EXIT_ANOMALY
    assert [r["global_batch"] for r in skipped(tmp_path)] == [2] and run.rewound == []


def test_too_many_rollbacks_stop_the_run(tmp_path):
    run = FakeRun(tmp_path, losses={3: math.nan, 4: math.nan}, max_rollbacks=1)
    run.steps(2)
    run.save()
    run.steps(2)  # step 4: batch 3
    assert run.check()
    run.steps(2)  # steps 3-4: batches 2 and 4
    with pytest.raises(Stopped, match="2 rollbacks or skipped updates within 1000 steps") as e:
        run.check()
    assert e.value.code == anomaly.EXIT_ANOMALY


def test_no_checkpoint_to_roll_back_to_stops(tmp_path):
    run = FakeRun(tmp_path, losses={1: math.nan})
    run.steps(3)
    with pytest.raises(Stopped, match="no checkpoint to roll back to"):
        run.check()




def test_a_damaged_last_checkpoint_rolls_back_to_the_previous_good_one(tmp_path):
    """Before: the rollback loaded `latest`'s tag, its verification failed and the run stopped
    with the older good tag right there."""
    run = FakeRun(tmp_path, losses={6: math.nan})
    run.steps(2)
    run.save()
    run.steps(3)
    bad = run.save()  # step 5
    flip(run.ckpt_dir / bad / "mp_rank_00_model_states.pt")
    run.steps(3)  # step 7 trains on batch 6: NaN
    assert run.check() is True
    assert run.rewound == ["global_step2"] and run.state.step == 2
    note = [n for n in run.logger.notes if n.startswith("rollback: ")]
    assert len(note) == 1 and "\n" not in note[0]
    assert "global_step5 damaged" in note[0] and "mp_rank_00_model_states.pt" in note[0]
    assert "moved aside to global_step5.damaged" in note[0]
    assert note[0].endswith("rolling back to global_step2, the newest good checkpoint")
    assert (run.ckpt_dir / "global_step5.damaged").is_dir()
    assert not (run.ckpt_dir / bad).exists()  # the next save at step 5 starts clean
    assert (run.ckpt_dir / "latest").read_text() == "global_step2"


def test_an_interrupted_tag_is_deleted_and_passed_over(tmp_path):
    run = FakeRun(tmp_path, losses={4: math.nan})
    run.steps(2)
    run.save()
    run.steps(2)
    cut = run.save()
    (run.ckpt_dir / cut / manifest.NAME).unlink()  # the save never finished: its mark is there
    (run.ckpt_dir / cut / manifest.SAVING).write_text(cut)
    run.steps(2)
    assert run.check() and run.rewound == ["global_step2"]
    assert "global_step4 interrupted" in run.logger.notes[-2] and "deleted" in run.logger.notes[-2]
    assert not (run.ckpt_dir / cut).exists()


def test_a_tag_whose_manifest_was_deleted_is_set_aside_with_its_files(tmp_path):
    """Before: a tag whose manifest.json was deleted was removed as an interrupted save, its
    files with it. Without the save's own mark it is no interrupted save: here its model file
    fails the structure check (not a zip), so it is passed over and kept, named."""
    run = FakeRun(tmp_path, losses={4: math.nan})
    run.steps(2)
    run.save()
    run.steps(2)
    tag = run.save()
    (run.ckpt_dir / tag / manifest.NAME).unlink()
    run.steps(2)
    assert run.check() and run.rewound == ["global_step2"]
    note = run.logger.notes[-2]
    assert "global_step4 unverified" in note and "moved aside to global_step4.unverified" in note
    assert (run.ckpt_dir / "global_step4.unverified" / "mp_rank_00_model_states.pt").is_file()


@pytest.mark.parametrize("manifest_files", ["empty", "partial"])
def test_an_empty_or_partial_manifest_verifies_nothing(tmp_path, manifest_files):
    """Before: `"files": {}` counted as verified, and damaged weights were rolled back to."""
    run = FakeRun(tmp_path, losses={6: math.nan})
    run.steps(2)
    run.save()
    run.steps(2)
    tag = run.save()
    tag_dir = run.ckpt_dir / tag
    flip(tag_dir / "mp_rank_00_model_states.pt")
    listed = {} if manifest_files == "empty" else {
        k: v for k, v in manifest.own_entries(tag_dir, 0).items() if "model_states" not in k}
    manifest.write(tag_dir, listed)
    run.steps(3)
    assert run.check() and run.rewound == ["global_step2"]
    note = run.logger.notes[-2]
    assert "global_step4 damaged" in note
    assert ("lists no files" if manifest_files == "empty" else
            "mp_rank_00_model_states.pt: not listed in manifest.json") in note
    assert (run.ckpt_dir / "global_step4.damaged").is_dir()


def test_what_is_set_aside_is_never_deleted(tmp_path):
    from app.checkpoint import tags

    for n in (1, 2, 3):
        (tmp_path / "global_step4").mkdir()
        (tmp_path / "global_step4" / "f").write_text(str(n))
        assert tags.set_aside(tmp_path, "global_step4", "damaged").name == \
            "global_step4.damaged" + ("" if n == 1 else f".{n}")
    assert sorted(p.read_text() for p in tmp_path.glob("*/f")) == ["1", "2", "3"]


def test_no_good_checkpoint_left_stops_naming_each_one(tmp_path):
    run = FakeRun(tmp_path, losses={4: math.nan})
    run.steps(2)
    first = run.save()
    run.steps(2)
    second = run.save()
    for tag in (first, second):
        flip(run.ckpt_dir / tag / "mp_rank_00_model_states.pt")
    run.steps(2)
    wanted = (r"no good checkpoint to roll back to: global_step4 damaged \(.*"
              r"mp_rank_00_model_states.pt.*; global_step2 damaged")
    with pytest.raises(Stopped, match=wanted) as e:
        run.check()
    assert e.value.code == anomaly.EXIT_ANOMALY and run.rewound == []
    assert "\n" not in str(e.value)


def test_a_tag_past_the_current_step_is_not_rolled_back_to(tmp_path):
    """A tag of a later step (another trajectory's, left by `--resume PATH` of an older tag) is
    no rollback: the newest good tag at or before the step is."""
    run = FakeRun(tmp_path)
    run.steps(2)
    run.save()
    run.steps(8)
    run.save()
    run.state.load_state_dict(run.saved["global_step2"])  # resumed from step 2
    run.losses[3] = math.nan
    run.steps(2)  # step 4: batch 3
    assert run.check() and run.rewound == ["global_step2"]


def test_the_earliest_mark_over_all_ranks_decides(tmp_path):
    run = FakeRun(tmp_path)
    run.steps(6)
    rows = [[5.0, 40.0, 0.0], [-1.0, 0.0, 0.0], [3.0, math.nan, 0.0]]
    found = anomaly.earliest([(r[0], r[1]) for r in rows])
    assert (found.step, found.reason) == (3, "non-finite loss")
    run.save()
    assert run.recovery.check(rows, run.rewind)  # the step-3 NaN: a rollback (to step 6)
    assert [r["global_batch"] for r in skipped(tmp_path)] == [2]


def test_a_stop_signal_saves_after_a_clean_check_and_exits_preempted(tmp_path):
    run = FakeRun(tmp_path)
    run.steps(3)
    with pytest.raises(Stopped, match="a stop signal at step 3: .*global_step3 saved") as e:
        run.recovery.stop_for_signal(run.rows(), run.rewind, run.save)
    assert e.value.code == EXIT_PREEMPTED and list(run.saved) == ["global_step3"]
    with pytest.raises(Stopped, match="global_step3 saved"):  # saved at this step already
        run.recovery.stop_for_signal(run.rows(), run.rewind, None)
    assert list(run.saved) == ["global_step3"]


def test_a_stop_signal_after_an_anomaly_rolls_back_instead_of_saving(tmp_path):
    run = FakeRun(tmp_path, losses={4: math.nan})
    run.steps(3)
    run.save()
    run.steps(2)
    with pytest.raises(Stopped, match="a stop signal at step 3: .*global_step3 saved"):
        run.recovery.stop_for_signal(run.rows(), run.rewind, run.save)
    assert run.rewound == ["global_step3"] and list(run.saved) == ["global_step3"]


# -- a real run: the checkpoint a rollback wants is damaged -------------------------------------

REAL = [*TINY, "--dropout", "0", "--log-every", "5", "--save-every", "3", "--max-steps", "12"]


@pytest.mark.slow
def test_a_real_rollback_onto_a_damaged_tag_takes_the_previous_one(mlm_dataset, tmp_path):
    """global_step6 is damaged once saved; step 8's batch is NaN; the check at step 9 rolls
    back. Before: the rollback's load named the file and the run stopped (exit 2)."""
    run = tmp_path / "run"
    proc = check(run_app("train", "--data", mlm_dataset, "--out", run, *REAL,
                         env=clean_env(DSPRETRAIN_TEST_POISON="7:nan",
                                       DSPRETRAIN_TEST_DAMAGE_SAVE="6")))
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("rollback: ")]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert "global_step6 damaged" in lines[0] and "mp_rank_00_model_states.pt" in lines[0]
    assert lines[0].endswith("rolling back to global_step3, the newest good checkpoint")
    assert "global_step3 (step 3)" in proc.stderr
    assert (run / "checkpoints" / "global_step6.damaged").is_dir()
    steps = [r["step"] for r in metrics(run) if "train/loss" in r]
    assert steps[-1] == 12 and steps.count(5) == 2  # step 5 logged again after the rollback
    assert (run / "checkpoints" / "latest").read_text().strip() == "global_step12"


@pytest.mark.slow
def test_a_real_rollback_with_no_good_tag_left_stops(mlm_dataset, tmp_path):
    run = tmp_path / "run"
    proc = run_app("train", "--data", mlm_dataset, "--out", run, *REAL,
                   env=clean_env(DSPRETRAIN_TEST_POISON="3:nan", DSPRETRAIN_TEST_DAMAGE_SAVE="3"))
    assert proc.returncode == anomaly.EXIT_ANOMALY, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "no good checkpoint to roll back to: global_step3 damaged" in proc.stderr
    assert (run / "checkpoints" / "global_step3.damaged").is_dir()


@pytest.mark.multirank
def test_two_ranks_agree_on_the_tag_a_rollback_falls_back_to(mlm_dataset, tmp_path):
    """The same damage on a 2-rank job (forked with the launcher's environment): every rank
    checks each tag and they agree in a collective, so both load global_step3 and the job trains
    on to its end."""
    run = tmp_path / "run"
    proc = launch("train", "--data", mlm_dataset, "--out", run, *REAL, timeout=900,
                  env=clean_env(DSPRETRAIN_TEST_POISON="7:nan", DSPRETRAIN_TEST_DAMAGE_SAVE="6"))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "Traceback" not in out, out[-3000:]
    lines = [ln for ln in out.splitlines() if "rollback: passing over global_step6" in ln]
    assert len(lines) == 1 and "rolling back to global_step3" in lines[0], out[-3000:]
    assert (run / "checkpoints" / "global_step6.damaged").is_dir()
    steps = [r["step"] for r in metrics(run) if "train/loss" in r]
    assert steps[-1] == 12 and steps.count(5) == 2


def test_a_run_stopping_for_a_signal_keeps_its_handlers_to_its_exit():
    """Before: StopRequests.close (trainer.close, right after the stop checkpoint) put the
    default handlers back, so a second SIGTERM before the process exited killed it: 143
    instead of 75. A run that stops for a signal keeps them; app.train.run releases them only
    for another exit status."""
    import os
    import signal

    from app.faults import preemption

    before = signal.getsignal(signal.SIGTERM)
    try:
        stops = preemption.StopRequests(False)
        os.kill(os.getpid(), signal.SIGTERM)  # the first: the stop (a flag)
        assert preemption.requested() == signal.SIGTERM
        stops.close()
        assert signal.getsignal(signal.SIGTERM) is preemption._handle
        os.kill(os.getpid(), signal.SIGTERM)  # the second: still a flag, not a death
        assert preemption.requested() == signal.SIGTERM
    finally:
        preemption.release()
        signal.signal(signal.SIGTERM, before)
    assert preemption.requested() == 0
