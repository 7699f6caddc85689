"""The LR schedule: warmup, cosine/linear decay, floor (a pure function)."""
import math

import pytest
import torch

from app.schedule import check_schedule, lr_factor, schedule_fn
from data_tools.errors import UserError


def test_warmup_is_linear_and_starts_above_zero():
    f = [lr_factor(s, warmup_steps=4, total_steps=20) for s in range(4)]
    assert f == pytest.approx([0.25, 0.5, 0.75, 1.0])


@pytest.mark.parametrize("decay", ["cosine", "linear"])
def test_decay_reaches_the_floor_and_stays(decay):
    kw = dict(warmup_steps=10, total_steps=110, decay=decay, min_lr_ratio=0.1)
    assert lr_factor(10, **kw) == pytest.approx(1.0)
    assert lr_factor(110, **kw) == pytest.approx(0.1)
    assert lr_factor(500, **kw) == pytest.approx(0.1)
    values = [lr_factor(s, **kw) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))  # never rises after warmup


def test_midpoints():
    cos = lr_factor(60, warmup_steps=10, total_steps=110, decay="cosine", min_lr_ratio=0.0)
    lin = lr_factor(35, warmup_steps=10, total_steps=110, decay="linear", min_lr_ratio=0.2)
    assert cos == pytest.approx(0.5)
    assert lin == pytest.approx(0.2 + 0.8 * 0.75)
    quarter = lr_factor(35, warmup_steps=10, total_steps=110, decay="cosine", min_lr_ratio=0.0)
    assert quarter == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))


def test_constant_and_no_warmup():
    assert lr_factor(0, warmup_steps=0, total_steps=5, decay="constant") == 1.0
    assert lr_factor(0, warmup_steps=0, total_steps=5, decay="cosine", min_lr_ratio=0) == 1.0


@pytest.mark.parametrize("kw", [dict(decay="step"), dict(warmup_steps=-1), dict(total_steps=0),
                                dict(min_lr_ratio=1.5)])
def test_bad_settings_are_user_errors(kw):
    settings = dict(warmup_steps=1, total_steps=10, decay="cosine", min_lr_ratio=0.1) | kw
    with pytest.raises(UserError):
        check_schedule(**settings)


def test_drives_a_torch_lambda_lr():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, schedule_fn(warmup_steps=2, total_steps=6, decay="linear", min_lr_ratio=0.0))
    seen = []
    for _ in range(7):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([1.0, 2.0, 2.0, 1.5, 1.0, 0.5, 0.0])


@pytest.mark.parametrize("shape", ["1-sqrt", "linear", "cosine"])
def test_wsd_holds_the_peak_then_decays_over_the_last_fraction(shape):
    kw = dict(warmup_steps=5, total_steps=100, decay="wsd", min_lr_ratio=0.1,
              decay_fraction=0.2, decay_shape=shape)
    f = [lr_factor(s, **kw) for s in range(120)]
    assert f[:5] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    assert f[5:81] == [1.0] * 76  # stable: exactly the peak up to the decay's start (step 80)
    assert all(a > b for a, b in zip(f[80:100], f[81:100]))  # strictly falling over the decay
    assert f[100:] == pytest.approx([0.1] * 20)  # the floor at total_steps, flat after
    half = {"1-sqrt": 1 - math.sqrt(0.5), "linear": 0.5, "cosine": 0.5}[shape]
    assert f[90] == pytest.approx(0.1 + 0.9 * half)


def test_wsd_extends_and_anneals_from_the_stable_phase():
    """The stable phase does not depend on the run's length: a resume with another
    --max-steps continues on the curve a run of that length has."""
    short = schedule_fn(warmup_steps=10, total_steps=200, decay="wsd")
    longer = schedule_fn(warmup_steps=10, total_steps=1000, decay="wsd")
    assert [short(s) for s in range(160)] == [longer(s) for s in range(160)]
    assert short(199) < 0.2 and longer(199) == 1.0


@pytest.mark.parametrize("kw", [dict(decay_fraction=0.0), dict(decay_fraction=1.5),
                                dict(decay_shape="step")])
def test_bad_wsd_settings_are_user_errors(kw):
    with pytest.raises(UserError):
        check_schedule(warmup_steps=1, total_steps=10, decay="wsd", min_lr_ratio=0.1, **kw)
