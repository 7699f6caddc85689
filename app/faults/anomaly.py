"""Loss spikes and non-finite values: found on the device, acted on at check points
(docs/design.md, "Faults").

Each optimizer step, every rank compares its step loss with its recent history: a NaN or an
infinity, or a spike (more than `z` standard deviations and `rise` above the recent mean) marks
the step. All of it is device arithmetic: nothing waits for the device per step. The marks are
read at the log interval and before every save (so a checkpoint is only ever written after a
clean check: every kept checkpoint predates any anomaly), gathered from every rank in the check
point's one all-gather, and the earliest marked step decides. The policy then rolls back, skips
or stops (app.faults.recovery).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

POLICIES = ("rollback", "skip", "stop")
EXIT_ANOMALY = 3  # the anomaly policy stopped the run (the evidence: metrics.jsonl events)


@dataclass(frozen=True)
class Rules:
    """When a step is anomalous, and what happens then (`app train --spike-*`, `--on-anomaly`)."""

    policy: str = "rollback"
    """rollback: back to the last good checkpoint, skip the step's batch, lower the LR for a
    while; skip: skip the batch from now on and go on (rolls back anyway if the loss went
    non-finite); stop: stop the run with the evidence."""
    window: int = 50
    """Steps of loss history a step is compared with."""
    min_history: int = 20
    """Steps of history needed before spikes are judged (NaN and infinities always are)."""
    z: float = 6.0
    """A spike is more than z standard deviations above the recent mean..."""
    rise: float = 0.3
    """...and more than this fraction above it (small noise in a flat curve is no spike)."""
    max_rollbacks: int = 3
    """More rollbacks than this within `rollback_window` steps stop the run."""
    rollback_window: int = 1000
    cooldown_steps: int = 100
    """After a rollback the LR starts at `cooldown_factor` x the schedule and returns to it
    linearly over this many steps."""
    cooldown_factor: float = 0.1


@dataclass(frozen=True)
class Anomaly:
    step: int
    """The first optimizer step marked (1-based, as `step` in metrics.jsonl)."""
    loss: float
    reason: str

    def describe(self) -> str:
        return f"{self.reason} at step {self.step} (loss {self.loss:.4g})"


class LossMonitor:
    """A rank's recent step losses and its first anomalous step, kept on the device."""

    def __init__(self, rules: Rules, device: torch.device):
        self.rules, self.device = rules, device
        self.reset()

    def reset(self) -> None:
        self.history = torch.full((self.rules.window,), math.nan, dtype=torch.float64,
                                  device=self.device)
        self.first_bad = torch.full((), -1.0, dtype=torch.float64, device=self.device)
        self.bad_loss = torch.zeros((), dtype=torch.float64, device=self.device)
        self._slot = 0

    def observe(self, step: int, loss: torch.Tensor) -> None:
        """The loss of optimizer step `step`: marked if anomalous, else added to the history.
        Device arithmetic only."""
        loss = loss.detach().to(torch.float64)
        known = ~torch.isnan(self.history)
        count = known.sum()
        mean = torch.nanmean(self.history)
        std = torch.sqrt(torch.nanmean((self.history - mean) ** 2))
        spike = ((count >= self.rules.min_history) & (loss - mean > self.rules.z * std)
                 & (loss > (1.0 + self.rules.rise) * mean))
        bad = ~torch.isfinite(loss) | spike
        first = bad & (self.first_bad < 0)
        self.first_bad = torch.where(first, torch.full_like(self.first_bad, step), self.first_bad)
        self.bad_loss = torch.where(first, loss, self.bad_loss)
        self.history[self._slot] = torch.where(bad, self.history[self._slot], loss)
        self._slot = (self._slot + 1) % self.rules.window

    def marks(self) -> torch.Tensor:
        """[first anomalous step or -1, its loss] (float64, on the device): the caller copies
        it to the host with its other figures at a check point (one sync for all of them)."""
        return torch.stack([self.first_bad, self.bad_loss])


def earliest(rows: list[tuple[float, float]]) -> Anomaly | None:
    """The first anomaly over all ranks' `marks()` (None if no rank marked a step)."""
    marked = [(step, loss) for step, loss in rows if step >= 0]
    if not marked:
        return None
    step, loss = min(marked)
    reason = "non-finite loss" if not math.isfinite(loss) else "loss spike"
    return Anomaly(step=int(step), loss=loss, reason=reason)


class Cooldown:
    """The LR multiplier after a rollback: `factor` at `start`, back to 1 over `steps`."""

    def __init__(self):
        self.start, self.steps, self.factor = -1, 0, 1.0

    def begin(self, step: int, steps: int, factor: float) -> None:
        self.start, self.steps, self.factor = step, steps, factor

    def __call__(self, step: int) -> float:
        if self.start < 0 or step < self.start or step >= self.start + self.steps:
            return 1.0
        return self.factor + (1.0 - self.factor) * (step - self.start) / self.steps

    def state_dict(self) -> dict:
        return {"start": self.start, "steps": self.steps, "factor": self.factor}

    def load_state_dict(self, state: dict | None) -> None:
        if state:
            self.begin(int(state["start"]), int(state["steps"]), float(state["factor"]))


def scaled(schedule, cooldown: Cooldown):
    """The LR schedule times the cool-down (an LR lambda for torch's LambdaLR)."""
    return lambda step: schedule(step) * cooldown(step)
