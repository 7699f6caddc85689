"""The learning-rate schedule: linear warmup, then cosine or linear decay to a floor, or
warmup-stable-decay (WSD: the peak held, then a decay over the last fraction of the run).

A pure function of the step (tested on its own); the engine applies it through a torch LambdaLR,
so its state in a checkpoint is one integer and a resumed run continues on the same curve.
"""
from __future__ import annotations

import math
from functools import partial
from typing import Callable

from data_tools.errors import UserError

DECAYS = ("cosine", "linear", "constant", "wsd")
DECAY_SHAPES = ("1-sqrt", "linear", "cosine")
"""The shapes of WSD's decay: 1-sqrt (ModernBERT's, Hägele et al. 2024), linear, cosine."""


def lr_factor(step: int, *, warmup_steps: int, total_steps: int, decay: str = "cosine",
              min_lr_ratio: float = 0.1, decay_fraction: float = 0.2,
              decay_shape: str = "1-sqrt") -> float:
    """Multiplier of the peak LR for the optimizer step `step` (0-based: the first update is 0).

    Warmup: (step + 1) / warmup_steps, so the first update already moves (a factor 0 would waste
    a step). Decay: from 1 at the end of warmup to `min_lr_ratio` at `total_steps`, flat after.
    WSD holds 1 until the last `decay_fraction` of `total_steps`, then decays over those steps
    in `decay_shape`: every step of the stable phase has the same LR whatever the run's length,
    so a run resumed from one with a larger --max-steps (extended) or a smaller one (annealed
    now) follows the curve it would have had from the start.
    """
    if step < 0:
        raise ValueError(f"step {step} is negative")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if decay == "constant":
        return 1.0
    start, shape_name = warmup_steps, decay
    if decay == "wsd":
        start = max(warmup_steps, total_steps - decay_steps(total_steps, decay_fraction))
        shape_name = decay_shape
        if step < start:
            return 1.0
    span = max(total_steps - start, 1)
    progress = min((step - start) / span, 1.0)
    return min_lr_ratio + (1.0 - min_lr_ratio) * _shape(shape_name, progress)


def decay_steps(total_steps: int, decay_fraction: float) -> int:
    """WSD's decay length: the last `decay_fraction` of the run, at least one step."""
    return max(1, round(decay_fraction * total_steps))


def _shape(name: str, progress: float) -> float:
    """1 at progress 0, 0 at progress 1."""
    if name == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    if name == "linear":
        return 1.0 - progress
    if name == "1-sqrt":
        return 1.0 - math.sqrt(progress)
    raise ValueError(f"decay {name!r}: expected one of {', '.join(DECAYS + DECAY_SHAPES)}")


def check_schedule(*, warmup_steps: int, total_steps: int, decay: str, min_lr_ratio: float,
                   decay_fraction: float = 0.2, decay_shape: str = "1-sqrt") -> None:
    """UserError for settings the schedule cannot follow (called before any process starts)."""
    if decay not in DECAYS:
        raise UserError(f"LR decay {decay!r}: expected one of {', '.join(DECAYS)}")
    if decay_shape not in DECAY_SHAPES:
        raise UserError(f"--decay-shape {decay_shape!r}: expected one of "
                        f"{', '.join(DECAY_SHAPES)}")
    if not 0.0 < decay_fraction <= 1.0:
        raise UserError(f"--decay-fraction {decay_fraction}: must be in (0, 1]")
    if warmup_steps < 0:
        raise UserError(f"warmup_steps {warmup_steps}: must be 0 or more")
    if total_steps < 1:
        raise UserError(f"total steps {total_steps}: must be at least 1")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise UserError(f"min_lr_ratio {min_lr_ratio}: must be between 0 and 1")


def schedule_fn(*, warmup_steps: int, total_steps: int, decay: str = "cosine",
                min_lr_ratio: float = 0.1, decay_fraction: float = 0.2,
                decay_shape: str = "1-sqrt") -> Callable[[int], float]:
    """`lr_factor` with its settings bound: the `lr_lambda` of a torch LambdaLR."""
    settings = dict(warmup_steps=warmup_steps, total_steps=total_steps, decay=decay,
                    min_lr_ratio=min_lr_ratio, decay_fraction=decay_fraction,
                    decay_shape=decay_shape)
    check_schedule(**settings)
    return partial(lr_factor, **settings)
