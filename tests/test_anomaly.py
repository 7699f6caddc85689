"""app.faults.anomaly's LossMonitor: losses kept on the device per step, the rule judged on the
host at check points. The marks must be those of the rule judged step by step on the device as
it was before (`device_rule` below, that code kept as the reference), whatever the check points."""
from __future__ import annotations

import math
import random

import pytest
import torch

from app.faults.anomaly import LossMonitor, Rules

RULES = Rules(window=8, min_history=4, z=3.0, rise=0.2)


def device_rule(rules: Rules, losses: list[float]) -> tuple[float, float]:
    """The marks of the former per-step device arithmetic (a ring of `window` float64 slots, NaN
    when empty; a marked step leaves its slot as it was), over steps 1..len(losses)."""
    history = torch.full((rules.window,), math.nan, dtype=torch.float64)
    first_bad, bad_loss = torch.tensor(-1.0, dtype=torch.float64), torch.tensor(0.0,
                                                                                dtype=torch.float64)
    for slot, (step, value) in enumerate(enumerate(losses, start=1)):
        loss = torch.tensor(value, dtype=torch.float32).to(torch.float64)
        count = (~torch.isnan(history)).sum()
        mean = torch.nanmean(history)
        std = torch.sqrt(torch.nanmean((history - mean) ** 2))
        spike = ((count >= rules.min_history) & (loss - mean > rules.z * std)
                 & (loss > (1.0 + rules.rise) * mean))
        bad = ~torch.isfinite(loss) | spike
        first = bad & (first_bad < 0)
        first_bad = torch.where(first, torch.full_like(first_bad, step), first_bad)
        bad_loss = torch.where(first, loss, bad_loss)
        i = slot % rules.window
        history[i] = torch.where(bad, history[i], loss)
    return first_bad.item(), bad_loss.item()


def observe_all(monitor: LossMonitor, losses: list[float], check_every: int
                ) -> tuple[float, float]:
    """Steps 1..n into the monitor, judged every `check_every` steps and at the end, as the
    trainer's check points do; the marks of the last check."""
    marks = monitor.marks().tolist()
    for step, value in enumerate(losses, start=1):
        monitor.observe(step, torch.tensor(value, dtype=torch.float32))
        if step % check_every == 0:
            marks = monitor.marks().tolist()
    marks = monitor.marks().tolist()
    return marks[0], marks[1]


def same(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return a[0] == b[0] and (a[1] == b[1] or (math.isnan(a[1]) and math.isnan(b[1])))


@pytest.mark.parametrize("seed", range(40))
def test_the_marks_are_those_of_the_per_step_device_rule(seed):
    rng = random.Random(seed)
    base = rng.uniform(1.0, 8.0)
    losses = [base * (1 - 0.01 * i) + rng.gauss(0, 0.05 * base) for i in range(60)]
    for _ in range(rng.randrange(3)):  # spikes of every size, a NaN or an infinity now and then
        losses[rng.randrange(60)] = rng.choice([math.nan, math.inf, base * rng.uniform(1.0, 3.0)])
    expected = device_rule(RULES, losses)
    for check_every in (1, 5, 60):
        got = observe_all(LossMonitor(RULES, torch.device("cpu"), capacity=4), losses,
                          check_every)
        assert same(got, expected), (check_every, got, expected)


def test_a_nan_is_marked_at_its_step_and_the_mark_stays_until_reset():
    monitor = LossMonitor(RULES, torch.device("cpu"))
    assert observe_all(monitor, [2.0, 2.0, math.nan, 2.0, 50.0], check_every=2)[0] == 3
    assert monitor.marks().tolist()[0] == 3  # a later check: the first mark still
    monitor.reset()
    assert monitor.marks().tolist()[0] == -1 and monitor.pending().numel() == 0


def test_a_spike_needs_min_history_and_both_thresholds():
    flat = [2.0, 2.1, 1.9, 2.0]
    assert observe_all(LossMonitor(RULES, torch.device("cpu")), flat[:3] + [50.0], 10)[0] == -1
    assert observe_all(LossMonitor(RULES, torch.device("cpu")), flat + [50.0], 10) == (5, 50.0)
    # many standard deviations above a very flat mean, but under `rise` above it: no spike
    assert observe_all(LossMonitor(RULES, torch.device("cpu")), flat + [2.3], 10)[0] == -1


def test_a_marked_step_stays_out_of_the_history():
    monitor = LossMonitor(RULES, torch.device("cpu"))
    observe_all(monitor, [2.0] * 6 + [50.0], check_every=3)
    assert 50.0 not in monitor.history and monitor.history.count(2.0) == 6


def test_the_losses_wait_on_the_device_until_a_check_point_judges_them():
    monitor = LossMonitor(RULES, torch.device("cpu"), capacity=2)
    for step in range(1, 6):  # past the buffer's first size
        monitor.observe(step, torch.tensor(float(step)))
    assert monitor.pending().tolist() == [1.0, 2.0, 3.0, 4.0, 5.0] + [0.0] * 5  # + skip flags
    assert monitor.judge(monitor.pending().tolist()) == (-1.0, 0.0)
    assert monitor.pending().numel() == 0 and monitor.history[:5] == [1.0, 2.0, 3.0, 4.0, 5.0]
