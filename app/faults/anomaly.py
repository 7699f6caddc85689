"""Loss spikes and non-finite values: judged at check points, acted on there (docs/design.md,
"Faults").

Each optimizer step, a rank's step loss is copied into a buffer on its device (one copy kernel:
nothing waits for the device per step), and beside it the step's skip flag: 1 where the step's
gradients were not finite and its update was not applied (app.runtime.step_guard, on the device;
2 where DeepSpeed skipped it on the host outside fp16). At the log interval and before every save
(so a checkpoint is only ever written after a clean check: every kept checkpoint predates any
anomaly) the buffer comes to the host with the check point's other device values, in its one
copy, and the rule runs there, step by step in order: a NaN or an infinity, or a spike (more than
`z` standard deviations and `rise` above the mean of the recent history) marks the step. The marks
are gathered from every rank in the check point's one all-gather, and the earliest marked step
decides. The policy then rolls back, skips or stops (app.faults.recovery). Judging at the check
point reads the marks no later than judging each step on the device would.

A skipped update (non-finite gradients with a finite loss) is no loss anomaly: the weights are
those of the step before, so nothing is rolled back; the monitor lists it (`skipped_updates`)
for the recovery to record its batch as skipped. Every rank has the same flags (they follow from
the all-reduced gradient norm).
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
    """A rank's recent step losses and its first anomalous step.

    The losses since the last check point wait in a device buffer (`observe`); the history they
    are judged against (the last `window` good losses, a ring: a marked step leaves its slot as
    it was) and the marks live on the host (`judge`)."""

    def __init__(self, rules: Rules, device: torch.device, capacity: int = 64):
        self.rules, self.device = rules, device
        self._losses = torch.empty(capacity, dtype=torch.float64, device=device)
        self._flags = torch.zeros(capacity, dtype=torch.float64, device=device)
        self.reset()

    def reset(self) -> None:
        self.history = [math.nan] * self.rules.window
        self._slot = 0
        self.first_bad, self.bad_loss = -1, 0.0
        self._steps: list[int] = []  # the steps whose losses wait in the buffer, in order
        self.skipped_updates: list[tuple[int, float, float]] = []  # (step, loss, flag), judged

    def observe(self, step: int, loss: torch.Tensor,
                skipped: torch.Tensor | float = 0.0) -> None:
        """The loss of optimizer step `step`, and its skip flag (a device scalar, or a host
        number), kept for the next check point: copies on the device, no sync."""
        n = len(self._steps)
        if n == self._losses.numel():  # more steps between check points than ever: twice the room
            self._losses = torch.cat([self._losses, torch.empty_like(self._losses)])
            self._flags = torch.cat([self._flags, torch.zeros_like(self._flags)])
        self._losses[n].copy_(loss.detach())
        if torch.is_tensor(skipped):
            self._flags[n].copy_(skipped.detach())
        else:
            self._flags[n].fill_(float(skipped))
        self._steps.append(step)

    def pending(self) -> torch.Tensor:
        """The losses observed since the last check point, then their skip flags (float64, on
        the device): the caller copies them to the host with its other figures (one sync for
        all) and gives them to `judge`."""
        n = len(self._steps)
        return torch.cat([self._losses[:n], self._flags[:n]])

    def judge(self, values: list[float]) -> tuple[float, float]:
        """The rule over `pending()` read on the host, step by step; then (first anomalous step
        or -1, its loss), the marks, which stay until `reset`. Steps whose update was skipped
        with a finite loss go to `skipped_updates`."""
        n = len(self._steps)
        if len(values) != 2 * n:
            raise ValueError(f"judge: {len(values)} values for {n} steps")
        for step, loss, flag in zip(self._steps, values[:n], values[n:]):
            if flag and math.isfinite(loss):
                self.skipped_updates.append((step, loss, flag))
            self._judge_one(step, loss)
        self._steps = []
        return float(self.first_bad), self.bad_loss

    def take_skipped(self) -> list[tuple[int, float, float]]:
        """The skipped updates judged since the last call, in step order."""
        taken, self.skipped_updates = self.skipped_updates, []
        return taken

    def marks(self) -> torch.Tensor:
        """`judge` on the pending losses, read here (one copy), as a float64 tensor [first
        anomalous step or -1, its loss]: for a caller with no other device values to copy."""
        return torch.tensor(self.judge(self.pending().tolist()), dtype=torch.float64)

    def _judge_one(self, step: int, loss: float) -> None:
        rules = self.rules
        known = [x for x in self.history if not math.isnan(x)]
        spike = False
        if len(known) >= rules.min_history:
            mean = sum(known) / len(known)
            std = math.sqrt(sum((x - mean) ** 2 for x in known) / len(known))
            spike = loss - mean > rules.z * std and loss > (1.0 + rules.rise) * mean
        bad = not math.isfinite(loss) or spike
        if bad and self.first_bad < 0:
            self.first_bad, self.bad_loss = step, loss
        if not bad:
            self.history[self._slot] = loss
        self._slot = (self._slot + 1) % rules.window


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
