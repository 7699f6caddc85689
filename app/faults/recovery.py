"""What a run does about an anomaly or a stop signal (docs/design.md, "Faults"): roll back, skip
the batch, or stop, by the rules of app.faults.anomaly.

The loop (app.trainer) calls `observe` every step (device arithmetic, no sync) and `check` at
its check points (before a log and before a save) with the rows it gathered from every rank; the
first two columns of a rank's row are its `LossMonitor.marks()`. A rollback loads the checkpoint
through the `rewind(tag)` the loop passes (the engine, the train state and the RNG from `tag`);
the loop then restarts its loader and LR from the state this module leaves.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, NoReturn

import torch

from app import rundir
from app.checkpoint import tags
from app.checkpoint.train_state import TrainState
from app.data.order import skip_ahead
from app.faults import anomaly
from app.faults.preemption import EXIT_PREEMPTED
from app.runtime.step_guard import DEVICE_SKIP
from data_tools.errors import Stopped

ACTIONS = {"rollback": "rolling back", "skip": "skipping its batch", "stop": "stopping"}


class Recovery:
    """The anomaly rules and this rank's loss monitor, the skipped batches and the rollbacks so
    far, and the policies that act on them."""

    def __init__(self, *, rules: anomaly.Rules, monitor: anomaly.LossMonitor,
                 skip: frozenset[int], describe_batch: Callable[[int], dict[str, list]],
                 state: TrainState, global_batch: int, run_dir: Path, logger,
                 is_main: bool):
        self.rules, self.monitor, self.state = rules, monitor, state
        self.skip = skip
        """Global batches never trained on (app/rundir.py, skipped_batches.jsonl)."""
        self.describe_batch = describe_batch
        """The sample ids of a global batch, and with a mixture their sources (app.data.loader
        .batch_samples), for the record of a skipped one."""
        self.global_batch, self.run_dir, self.is_main = global_batch, run_dir, is_main
        self.ckpt_dir = run_dir / rundir.CHECKPOINTS
        self.logger = logger  # alert, log and note: app.telemetry.sinks.MetricsLogger
        self._batch_of: dict[int, int] = {}  # step -> its global batch, since the last check
        self._rollbacks: list[int] = []

    def observe(self, step: int, batch: int, loss: torch.Tensor,
                skipped: torch.Tensor | float = 0.0) -> None:
        """Optimizer step `step` trained on global batch `batch` with mean loss `loss` (a device
        scalar: the monitor marks it on the device, nothing is read here); `skipped`, its skip
        flag (app.runtime.engine.optimizer_step)."""
        self._batch_of[step] = batch
        self.monitor.observe(step, loss, skipped)

    def check(self, rows: list[list[float]], rewind: Callable[[str], None]) -> bool:
        """A check point: every rank's row, each starting with its anomaly marks. Records the
        steps whose update was skipped (before any anomaly: a rollback redoes what follows it),
        then acts on the earliest marked step by the policy; True when the run rolled back."""
        found = anomaly.earliest([(r[0], r[1]) for r in rows])
        for step, loss, flag in self.monitor.take_skipped():
            if found is None or step < found.step:
                self.skipped_update(step, loss, flag)
        if found is None:
            self._batch_of = {}
            return False
        return self.on_anomaly(found, rewind)

    def skipped_update(self, step: int, loss: float, flag: float) -> None:
        """A step whose gradients were not finite and whose update was not applied (the weights
        are the step before's): its batch is recorded as skipped and the run goes on, or stops
        under --on-anomaly stop, or when such steps and rollbacks come more than
        --max-rollbacks times within 1,000 steps."""
        rules, s = self.rules, self.state
        found = anomaly.Anomaly(step=step, loss=loss, reason="non-finite gradient")
        who = "the app's step guard" if flag == DEVICE_SKIP else "DeepSpeed"
        action = "stopping" if rules.policy == "stop" else "its update was not applied"
        self.logger.alert("anomaly", f"{found.describe()}: {action} ({who}; --on-anomaly "
                                     f"{rules.policy})")
        self.logger.log({"step": s.step, "consumed_samples": s.consumed_samples,
                         "tokens_seen": s.tokens_seen, "event": "skipped its update",
                         "event/reason": found.describe(), "event/step": step})
        if flag == DEVICE_SKIP:
            s.skipped_updates += 1
        batch = self._batch_of.get(step)
        if batch is not None and batch >= 0:
            self._skip_batch(batch, found)
        if rules.policy == "stop":
            raise Stopped(f"{found.describe()} (--on-anomaly stop; its batch is recorded in "
                          f"{self.run_dir / rundir.SKIPPED})", anomaly.EXIT_ANOMALY)
        self._count_against_limit(s.step, found)

    def on_anomaly(self, found: anomaly.Anomaly, rewind: Callable[[str], None]) -> bool:
        rules, s = self.rules, self.state
        action = ACTIONS[rules.policy]
        if rules.policy == "skip" and found.reason == "non-finite loss":
            action = "rolling back (the weights are not finite)"
        self.logger.alert("anomaly", f"{found.describe()}: {action} (--on-anomaly "
                                     f"{rules.policy})")
        self.logger.log({"step": s.step, "consumed_samples": s.consumed_samples,
                         "tokens_seen": s.tokens_seen, "event": action,
                         "event/reason": found.describe(), "event/step": found.step})
        batch = self._batch_of.get(found.step)
        if batch is not None and batch >= 0:
            self._skip_batch(batch, found)
        if rules.policy == "stop":
            raise Stopped(f"{found.describe()} (--on-anomaly stop; its batch is recorded in "
                          f"{self.run_dir / rundir.SKIPPED})", anomaly.EXIT_ANOMALY)
        if rules.policy == "skip" and found.reason != "non-finite loss":
            self.monitor.reset()
            return False
        self.rollback(found, rewind)
        return True

    def _skip_batch(self, batch: int, found: anomaly.Anomaly) -> None:
        self.skip = self.skip | {batch}
        if self.is_main:
            start = batch * self.global_batch
            rundir.add_skipped(self.run_dir, {
                "step": found.step, "global_batch": batch,
                "positions": [start, start + self.global_batch],
                **self.describe_batch(batch), "reason": found.describe()})

    def rollback(self, found: anomaly.Anomaly, rewind: Callable[[str], None]) -> None:
        """Back to the newest good checkpoint (written before the anomaly: saves follow clean
        checks; a damaged one passed over), without the skipped batches, with the LR cooled
        down for a while."""
        rules, s = self.rules, self.state
        self._count_against_limit(s.step, found)
        tag = self.rollback_tag(found)
        rewind(tag)  # the train state is the checkpoint's now, its cool-down too
        s.consumed_samples = skip_ahead(s.consumed_samples, self.global_batch, self.skip)
        s.cooldown.begin(s.step, rules.cooldown_steps, rules.cooldown_factor)
        self.monitor.reset()
        self._batch_of = {}
        self.logger.note(f"rolled back to {self.ckpt_dir / tag} (step {s.step}); the LR is "
                         f"cooled down for {rules.cooldown_steps} steps")

    def _count_against_limit(self, step: int, found: anomaly.Anomaly) -> None:
        """One more rollback or skipped update at `step`; more than --max-rollbacks of them
        within the rollback window stop the run (exit 3) with the evidence."""
        rules = self.rules
        self._rollbacks = [x for x in self._rollbacks if x > step - rules.rollback_window]
        self._rollbacks.append(step)
        if len(self._rollbacks) > rules.max_rollbacks:
            raise Stopped(f"{len(self._rollbacks)} rollbacks or skipped updates within "
                          f"{rules.rollback_window} steps (steps {self._rollbacks}; the last: "
                          f"{found.describe()}); the evidence is in "
                          f"{self.run_dir / rundir.METRICS} (events) and {rundir.SKIPPED}",
                          anomaly.EXIT_ANOMALY)

    def rollback_tag(self, found: anomaly.Anomaly) -> str:
        """The newest good checkpoint at or before this step (app.checkpoint.tags
        .choose_rollback): a damaged or interrupted tag is passed over for the previous one, in
        one line; Stopped when no good tag is left."""
        tag, passed = tags.choose_rollback(self.ckpt_dir, self.state.step,
                                           self.monitor.device, self.is_main)
        if tag is None and not passed:
            raise Stopped(f"{found.describe()}, and no checkpoint to roll back to (save more "
                          f"often: --save-every)", anomaly.EXIT_ANOMALY)
        if tag is None:
            raise Stopped(f"{found.describe()}, and no good checkpoint to roll back to: "
                          f"{'; '.join(passed)}", anomaly.EXIT_ANOMALY)
        if passed:
            self.logger.note(f"rollback: passing over {'; '.join(passed)}: rolling back to "
                             f"{tag}, the newest good checkpoint")
        return tag

    def stop_for_signal(self, rows: list[list[float]], rewind: Callable[[str], None],
                        save: Callable[[], object] | None) -> NoReturn:
        """Some rank got SIGTERM/SIGUSR1/SIGINT: after a clean check every rank saves the same
        checkpoint (`save`; None: saved at this step already) and the run exits with
        EXIT_PREEMPTED (`--resume auto` continues exactly)."""
        if not self.check(rows, rewind) and save is not None:
            save()
        saved = self.ckpt_dir / (tags.latest_tag(self.ckpt_dir) or "(none)")
        raise Stopped(f"a stop signal at step {self.state.step}: {saved} saved; run the same "
                      f"command again to continue", EXIT_PREEMPTED)
