"""Probes of real training steps, run by tests/test_gpu_path.py in a process of their own (a world
of one, DeepSpeed's CPU accelerator): `syncs` lists the host-syncing ops one training step
dispatches; `skip` trains with one step DeepSpeed skips (as on an fp16 overflow) and prints the
learning rates each step applied.

    python tests/step_probe.py syncs|skip DATA RUN_DIR OBJECTIVE ZERO
"""
from __future__ import annotations

import collections
import dataclasses
import json
import sys

from torch.utils._python_dispatch import TorchDispatchMode

from app.build import build
from app.config import TrainConfig
from app.runtime.device import Device, detect

# ops that wait for the device to hand a value to the host
SYNCS = {"aten.nonzero", "aten.item", "aten._local_scalar_dense", "aten.is_nonzero",
         "aten.masked_select", "aten.equal"}


class SyncProbe(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name in SYNCS:
            self.seen[name] += 1
        return func(*args, **(kwargs or {}))


@dataclasses.dataclass(frozen=True)
class FusedAdamDevice(Device):
    """The detected device, with DeepSpeed's own (fused) Adam as on an accelerator: on CPU the
    app picks torch's (Device.torch_adam), whose bias correction reads the step on the host."""

    @property
    def torch_adam(self) -> bool:
        return False


def trainer_for(data: str, out: str, objective: str, zero: int, steps: int):
    cfg = TrainConfig(data=data, out=out, seq_len=64, micro_batch=4, max_steps=steps,
                      warmup_steps=2, log_every=1000, wandb="disabled", num_workers=0, zero=zero,
                      objective=objective)
    found = detect()
    device = FusedAdamDevice(**{f.name: getattr(found, f.name) for f in dataclasses.fields(found)})
    built = build(cfg, device)
    return built.trainer, built.plan


def syncs(trainer) -> dict:
    trainer.train_step()  # the first step builds lazy state
    probe = SyncProbe()
    with probe:
        trainer.train_step()
    return dict(probe.seen)


def skip(trainer, plan) -> dict:
    """Step 3 of 6 reports an overflow, as DeepSpeed's fp16 optimizers do: DeepSpeed then skips
    the LR scheduler's step; the trainer keeps the schedule on the step counter anyway."""
    lrs = []
    for step in range(6):
        if step == 3:
            trainer.engine.optimizer.overflow = True
        trainer.train_step()
        lrs.append(trainer._lr)
        if step == 3:
            del trainer.engine.optimizer.overflow
    return {"lrs": lrs, "schedule": [plan.lr_lambda(k) * plan.cfg.lr for k in range(6)],
            "skipped_steps": trainer.engine.skipped_steps}


if __name__ == "__main__":
    what, data, out, objective, zero = sys.argv[1:6]
    trainer, plan = trainer_for(data, out, objective, int(zero), steps=10)
    print("PROBE " + json.dumps(syncs(trainer) if what == "syncs" else skip(trainer, plan)))
