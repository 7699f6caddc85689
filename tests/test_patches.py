"""The patches to a built DeepSpeed engine (app/runtime/patches.py) against DeepSpeed's own code,
on a real engine in a process of its own (a world of one, DeepSpeed's CPU accelerator)."""
from __future__ import annotations

import pytest

from tests.helpers import clean_env, free_port, python

# ZeRO-0 fp32 with clipping active (the gradients' norm far above 0.05): the app's clipping,
# without DeepSpeed's all-reduce of the norm, gives DeepSpeed's clipped gradients bit for bit.
CLIPPING = r"""
import copy, torch
from deepspeed.runtime.utils import clip_grad_norm_
from app.runtime.engine import initialize

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
ds = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
      "train_batch_size": 4, "gradient_clipping": 0.05, "zero_optimization": {"stage": 0},
      "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
engine = initialize(model, ds, lambda step: 1.0, [{"params": list(model.parameters())}])
assert engine.clip_fp32_gradients.__qualname__.startswith("local_fp32_clipping"), "not patched"
loss = engine(torch.randn(4, 16)).pow(2).sum() * 100
engine.backward(loss)
params = [p for p in engine.module.parameters()]
theirs = [copy.deepcopy(p) for p in params]
for mine, copied in zip(params, theirs):
    copied.grad = mine.grad.clone()
norm = clip_grad_norm_(theirs, max_norm=0.05)
assert float(norm) > 0.5, f"clipping not active: norm {float(norm)}"
engine.clip_fp32_gradients()
for mine, copied in zip(params, theirs):
    assert torch.equal(mine.grad, copied.grad), (mine.grad - copied.grad).abs().max()
print("equal", float(norm))
"""


def alone(script: str) -> str:
    """The script's output, run in a world of one of its own (no launcher)."""
    env = clean_env(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                    MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    done = python("-c", script, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.mark.slow
def test_zero0_fp32_clipping_equals_deepspeeds_without_its_collective():
    assert "equal" in alone(CLIPPING)


# ZeRO-2 fp32 (DeepSpeedZeroOptimizer): the step's re-linking of the weights to the flat buffer
# (patches.relink_only_moved) leaves the weights viewing it, re-points one that was moved, and
# trains the same weights as DeepSpeed's own loop
RELINK = r"""
import types, torch
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from app.runtime.engine import initialize

def build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    ds = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
          "train_batch_size": 4, "zero_optimization": {"stage": 2},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}}
    return initialize(model, ds, lambda step: 1.0, [{"params": list(model.parameters())}])

def views_flat(opt):
    flat = opt.bit16_groups_flat[0]
    return all(p.data_ptr() == flat.data_ptr() + off * flat.element_size()
               for p, off in zip(opt.round_robin_bit16_groups[0], opt.round_robin_bit16_offsets[0]))

def train(engine, steps):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        loss = engine(torch.randn(4, 16, generator=g)).pow(2).sum()
        engine.backward(loss)
        engine.step()

mine, theirs = build(), build()
relinked = mine.optimizer._update_model_bit16_weights.__func__.__name__
assert relinked == "_relink_moved", "not patched"
theirs.optimizer._update_model_bit16_weights = types.MethodType(
    DeepSpeedZeroOptimizer._update_model_bit16_weights, theirs.optimizer)
train(mine, 3)
train(theirs, 3)
assert views_flat(mine.optimizer)
for a, b in zip(mine.module.parameters(), theirs.module.parameters()):
    assert torch.equal(a, b), (a - b).abs().max()
moved = next(mine.module.parameters())
moved.data = moved.data.clone()
assert not views_flat(mine.optimizer)
mine.optimizer._update_model_bit16_weights(0)
assert views_flat(mine.optimizer)
train(mine, 1)
train(theirs, 1)
for a, b in zip(mine.module.parameters(), theirs.module.parameters()):
    assert torch.equal(a, b), (a - b).abs().max()
print("equal")
"""


@pytest.mark.slow
def test_zero2_relinks_only_moved_weights_and_trains_deepspeeds_weights():
    assert "equal" in alone(RELINK)
