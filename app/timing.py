"""Where training time goes: a window of steps between two log lines, its data wait, and the
throughput figures made from it (docs/design.md, "Metrics").

The window pauses while the run evaluates or saves (that time is not training time) and counts
how long the loop waited for the next batch. An accelerator runs ahead of the host, so the clock
is read after `sync` (the device's synchronize): when a window ends and where a pause starts and
ends, once per log interval, eval and save; never per step.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, Iterator


class Window:
    """Wall time and data wait since the window was (re)started, excluding paused spans."""

    def __init__(self, step: int = 0, sync: Callable[[], None] = lambda: None):
        self.sync = sync
        self.restart(step)

    def restart(self, step: int) -> None:
        self.first_step = step
        self.data_wait = 0.0
        self._start = time.perf_counter()
        self._paused = 0.0

    def waiting_for_data(self):
        return self._timing("data_wait")

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


def throughput(*, steps: int, global_batch: int, seq_len: int, world_size: int,
               busy_sum: float, wait_sum: float) -> dict[str, float]:
    """perf/ figures of a window of `steps` optimizer steps, from the window's wall time and data
    wait summed over ranks (each rank timed the same steps; their mean is the window's time)."""
    wall = max(busy_sum / world_size, 1e-9)
    samples = steps * global_batch
    return {"perf/tokens_per_sec": samples * seq_len / wall,
            "perf/samples_per_sec": samples / wall,
            "perf/step_time_ms": 1000.0 * wall / max(steps, 1),
            "perf/data_wait_pct": 100.0 * wait_sum / max(busy_sum, 1e-9)}
