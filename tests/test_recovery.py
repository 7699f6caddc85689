"""The anomaly policies of app.faults.recovery in process, on a fake run: a loader of per-batch
losses, a train state, checkpoints that are state dicts (milliseconds; tests/test_faults.py runs
the same policies end to end in real processes)."""
from __future__ import annotations

import json
import math

import pytest
import torch

from app import rundir
from app.checkpoint.train_state import TrainState
from app.faults import anomaly
from app.faults.preemption import EXIT_PREEMPTED
from app.faults.recovery import Recovery
from data_tools.errors import Stopped

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

    def save(self) -> None:
        tag = f"global_step{self.state.step}"
        (self.ckpt_dir / tag).mkdir(parents=True)
        (self.ckpt_dir / "latest").write_text(tag)
        self.saved[tag] = self.state.state_dict()

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
    with pytest.raises(Stopped, match="2 rollbacks within 1000 steps") as e:
        run.check()
    assert e.value.code == anomaly.EXIT_ANOMALY


def test_no_checkpoint_to_roll_back_to_stops(tmp_path):
    run = FakeRun(tmp_path, losses={1: math.nan})
    run.steps(3)
    with pytest.raises(Stopped, match="no checkpoint to roll back to"):
        run.check()


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
