"""Where training time goes: a window of steps between two log lines, its data wait, its
forward and optimizer-step time (docs/design.md, "Metrics"; app.telemetry.figures turns every
rank's window into figures).

The window pauses while the run evaluates or saves (that time is not training time) and counts
how long the loop waited for the next batch. An accelerator runs ahead of the host, so the clock
is read after `sync` (the device's synchronize): when a window ends and where a pause starts and
ends, once per log interval, eval and save; never per step. Forward passes and optimizer steps
are timed by the device's own events (`clock`, `step_clock`), read at the window's end.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, Iterator


class Window:
    """Wall time and data wait since the window was (re)started, excluding paused spans."""

    def __init__(self, step: int = 0, sync: Callable[[], None] = lambda: None, clock=None,
                 step_clock=None):
        self.sync, self.clock, self.step_clock = sync, clock, step_clock
        self.restart(step)

    def restart(self, step: int) -> None:
        self.first_step = step
        self.data_wait = 0.0
        self._start = time.perf_counter()
        self._paused = 0.0

    def waiting_for_data(self):
        return self._timing("data_wait")

    def forward(self):
        """A forward pass (device time; needs the `clock`)."""
        return self.clock.span()

    def forward_seconds(self) -> float:
        """Device time of the window's forward passes (after `elapsed()` synced the device)."""
        return self.clock.take() if self.clock is not None else 0.0

    def optimizer(self):
        """An optimizer step (device time; needs the `step_clock`)."""
        return self.step_clock.span()

    def optimizer_seconds(self) -> float:
        """Device time of the window's optimizer steps (after `elapsed()` synced the device)."""
        return self.step_clock.take() if self.step_clock is not None else 0.0

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Eval and save inside this block do not count as training time."""
        self.sync()  # the training work queued so far belongs to the window
        with self._timing("_paused"):
            yield
            self.sync()

    @contextmanager
    def _timing(self, total: str) -> Iterator[None]:
        """Add the time spent in the block to the attribute `total`."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            setattr(self, total, getattr(self, total) + time.perf_counter() - t0)

    def elapsed(self) -> float:
        self.sync()
        return time.perf_counter() - self._start - self._paused
