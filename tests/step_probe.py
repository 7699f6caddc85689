"""Probes of real training steps, run by tests/test_gpu_path.py in a process of their own (a world
of one, DeepSpeed's CPU accelerator): `syncs` lists the host-syncing ops one training step
dispatches; `skip` trains with one step DeepSpeed skips (as on an fp16 overflow) and prints the
learning rates each step applied.

    python tests/step_probe.py syncs|skip DATA RUN_DIR OBJECTIVE ZERO

`count_host_syncs(OUT)` is the other probe, for tests/test_host_syncs.py: installed from a
sitecustomize.py before anything imports torch, it counts, by call site, DeepSpeed's accelerator
`synchronize()` calls (made on CPU too, where they cost nothing) and host reads of tensors
(item, tolist, float, int, bool) from outside torch itself, and writes them to OUT/PID.json when
a process that imported DeepSpeed exits. Only stdlib imports at module level, for that.
"""
from __future__ import annotations

import atexit
import collections
import importlib.abc
import json
import os
import sys

READS = ("item", "tolist", "__float__", "__int__", "__bool__")


def count_host_syncs(out: str) -> None:
    """Patch each DeepSpeed accelerator class as its module loads and torch.Tensor once torch
    has; write the counts to OUT/PID.json at exit (the launcher and workers left out)."""
    counts: collections.Counter = collections.Counter()
    sites: collections.Counter = collections.Counter()

    def mark(kind: str, frame) -> None:
        counts[kind] += 1
        sites[f"{kind} {frame.f_code.co_filename}:{frame.f_lineno}"] += 1

    def patch_accelerators(module) -> None:
        for cls in list(vars(module).values()):
            fn = isinstance(cls, type) and cls.__module__ == module.__name__ \
                and cls.__dict__.get("synchronize")
            if callable(fn):
                def synchronize(*a, _fn=fn, **k):
                    mark("synchronize", sys._getframe(1))
                    return _fn(*a, **k)
                cls.synchronize = synchronize
                counts["patched_accelerators"] += 1

    def patch_torch(torch) -> None:
        own = os.path.dirname(torch.__file__) + os.sep
        for name in READS:
            def read(self, *a, _orig=getattr(torch.Tensor, name), **k):  # noqa: B008
                frame = sys._getframe(1)
                if not frame.f_code.co_filename.startswith(own):
                    mark("read", frame)
                return _orig(self, *a, **k)
            setattr(torch.Tensor, name, read)
        counts["patched_torch"] += 1

    def write() -> None:
        mp = sys.modules.get("multiprocessing")
        if "deepspeed" not in sys.modules or (mp is not None and mp.parent_process() is not None):
            return
        with open(os.path.join(out, f"{os.getpid()}.json"), "w") as f:
            json.dump({"argv": sys.argv, "counts": dict(counts), "sites": dict(sites)}, f)

    sys.meta_path.insert(0, _PatchOnLoad(patch_torch, patch_accelerators))
    # in a fork of the tests' warm process (tests/zygote.py) they are loaded already
    if "torch" in sys.modules:
        patch_torch(sys.modules["torch"])
    for name, module in list(sys.modules.items()):
        if name.startswith("deepspeed.accelerator.") and name.endswith("_accelerator"):
            patch_accelerators(module)
    atexit.register(write)


class _PatchOnLoad(importlib.abc.MetaPathFinder):
    """Runs a patch on `torch` and on each `deepspeed.accelerator.*_accelerator` module right
    after the module itself has run."""

    def __init__(self, torch_patch, accelerator_patch):
        self.torch_patch, self.accelerator_patch = torch_patch, accelerator_patch

    def find_spec(self, name, path, target=None):
        if name == "torch":
            patch = self.torch_patch
        elif name.startswith("deepspeed.accelerator.") and name.endswith("_accelerator"):
            patch = self.accelerator_patch
        else:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                break
        else:
            return None
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


# ops that wait for the device to hand a value to the host
SYNCS = {"aten.nonzero", "aten.item", "aten._local_scalar_dense", "aten.is_nonzero",
         "aten.masked_select", "aten.equal"}


def sync_probe():
    """A dispatch mode counting the ops in SYNCS."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class SyncProbe(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen: collections.Counter = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func.overloadpacket)
            if name in SYNCS:
                self.seen[name] += 1
            return func(*args, **(kwargs or {}))

    return SyncProbe()


def fused_adam_device():
    """The detected device: its optimizer is torch's fused AdamW, as on CUDA (app.runtime.device;
    the single-tensor AdamW CPU runs took before read the step on the host in its bias
    correction, so probes took DeepSpeed's fused Adam instead, which cannot skip a non-finite
    step on the device: app.runtime.step_guard)."""
    from app.runtime.device import detect

    return detect()


def trainer_for(data: str, out: str, objective: str, zero: int, steps: int):
    from app.build import build
    from app.config import TrainConfig

    cfg = TrainConfig(data=data, out=out, seq_len=64, micro_batch=4, max_steps=steps,
                      warmup_steps=2, log_every=1000, wandb="disabled", num_workers=0, zero=zero,
                      objective=objective)
    built = build(cfg, fused_adam_device())
    return built.trainer, built.plan


def syncs(trainer) -> dict:
    trainer.train_step()  # the first step builds lazy state
    probe = sync_probe()
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
