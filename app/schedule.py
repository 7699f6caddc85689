"""The learning-rate schedule: linear warmup, then cosine or linear decay to a floor.

A pure function of the step (tested on its own); the engine applies it through a torch LambdaLR,
so its state in a checkpoint is one integer and a resumed run continues on the same curve.
"""
from __future__ import annotations

import math
from functools import partial
from typing import Callable

from data_tools.errors import UserError

DECAYS = ("cosine", "linear", "constant")


def lr_factor(step: int, *, warmup_steps: int, total_steps: int, decay: str = "cosine",
              min_lr_ratio: float = 0.1) -> float:
    """Multiplier of the peak LR for the optimizer step `step` (0-based: the first update is 0).

    Warmup: (step + 1) / warmup_steps, so the first update already moves (a factor 0 would waste
    a step). Decay: from 1 at the end of warmup to `min_lr_ratio` at `total_steps`, flat after.
    """
    if step < 0:
        raise ValueError(f"step {step} is negative")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if decay == "constant":
        return 1.0
    span = max(total_steps - warmup_steps, 1)
    progress = min((step - warmup_steps) / span, 1.0)
    if decay == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    elif decay == "linear":
        shape = 1.0 - progress
    else:
        raise ValueError(f"decay {decay!r}: expected one of {', '.join(DECAYS)}")
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape


def check_schedule(*, warmup_steps: int, total_steps: int, decay: str, min_lr_ratio: float) -> None:
    """UserError for settings the schedule cannot follow (called before any process starts)."""
    if decay not in DECAYS:
        raise UserError(f"LR decay {decay!r}: expected one of {', '.join(DECAYS)}")
    if warmup_steps < 0:
        raise UserError(f"warmup_steps {warmup_steps}: must be 0 or more")
    if total_steps < 1:
        raise UserError(f"total steps {total_steps}: must be at least 1")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise UserError(f"min_lr_ratio {min_lr_ratio}: must be between 0 and 1")


def schedule_fn(*, warmup_steps: int, total_steps: int, decay: str = "cosine",
                min_lr_ratio: float = 0.1) -> Callable[[int], float]:
    """`lr_factor` with its settings bound: the `lr_lambda` of a torch LambdaLR."""
    check_schedule(warmup_steps=warmup_steps, total_steps=total_steps, decay=decay,
                   min_lr_ratio=min_lr_ratio)
    return partial(lr_factor, warmup_steps=warmup_steps, total_steps=total_steps, decay=decay,
                   min_lr_ratio=min_lr_ratio)
