"""The optimizer step is skipped when its gradients are not finite, on the device.

DeepSpeed skips a step whose global gradient norm is NaN or infinite by reading the norm on the
host (`is_invalid_grad_norm`: one device sync a step). The app's sync-free steps
(app.runtime.patches.sync_free_steps) take that read out, and DeepSpeed's ZeRO-0 in fp32 never
had the check. Without it a NaN gradient whose loss is finite would be applied to the fp32
masters and Adam's moments, and a checkpoint saved at that step would keep them (docs/design.md,
"Faults").

The guard wraps the torch optimizer inside DeepSpeed's wrapper (`engine.optimizer.optimizer`, or
the engine's optimizer itself at ZeRO-0 fp32). At the first inner step of an optimizer step it
takes the step's flag, `found`: 1.0 where the global norm the wrapper computed is not finite
(or DeepSpeed's -1 mask of it), else 0.0, a device scalar that every rank computes alike (the
norm is all-reduced). Then:

- torch's fused Adam/AdamW (the app's optimizer on CPU and CUDA: app.runtime.device) takes it as
  `found_inf`, the flag torch's GradScaler hands it: the fused kernel leaves the weights, both
  moments and the step count as they were where it is 1. No host read.
- any other inner optimizer (DeepSpeed's FusedAdam or CPU Adam from a ds_config of one's own):
  the flag is read on the host (what DeepSpeed's own check costs) and the inner step is not run.

The trainer reads `found` with the step's loss at its next check point (app.faults.anomaly):
the step is recorded as skipped, its batch named in skipped_batches.jsonl. fp16 is left to
DeepSpeed's loss scaler, whose overflow skips are routine.
"""
from __future__ import annotations

import types
from typing import Any, Callable

import torch

# A step's skip flag, as the anomaly monitor keeps it (app.faults.anomaly): the guard's (on the
# device), or DeepSpeed's own skip (read on the host, outside fp16)
DEVICE_SKIP, HOST_SKIP = 1.0, 2.0


class StepGuard:
    """The non-finite skip on one torch optimizer (module docstring). Made on the torch
    optimizer before DeepSpeed hands it to the LR scheduler (which wraps its step again: our
    wrapper is then the step it counts), then `attach`ed to the engine DeepSpeed built."""

    def __init__(self, inner: torch.optim.Optimizer):
        self.inner = inner
        self.wrapper: Any = None
        self.group = None
        # torch's fused kernels take the skip as a device tensor (GradScaler's found_inf)
        self.on_device = bool(getattr(inner, "_step_supports_amp_scaling", False))
        self.found: torch.Tensor | None = None
        self.active = False
        self._step: Callable = inner.step
        guard = self

        def step(optimizer, *args, **kwargs):  # a method of the optimizer, as torch's
            return guard._guarded_step(*args, **kwargs)  # LR scheduler re-binds it to it

        inner.step = types.MethodType(step, inner)

    def attach(self, engine: Any) -> "StepGuard | None":
        """Guard `engine`'s steps (its optimizer wraps this one, or is it); fp16 stays with
        DeepSpeed's loss scaler, whose overflow skips run on the host, as they must to lower its
        scale (then the guard steps aside and returns None)."""
        wrapper = engine.optimizer
        inner = wrapper if isinstance(wrapper, torch.optim.Optimizer) \
            else getattr(wrapper, "optimizer", None)
        if inner is not self.inner or engine.fp16_enabled():
            return None
        self.wrapper = None if wrapper is self.inner else wrapper
        self.group = getattr(engine, "seq_data_parallel_group", None)
        self.active = True
        engine.app_step_guard = self
        return self

    def describe(self) -> str:
        how = ("on the device (the fused optimizer's found_inf)" if self.on_device
               else f"on the host ({type(self.inner).__name__} has no device-side skip)")
        return f"a step with non-finite gradients is skipped {how}"

    def begin(self) -> None:
        """Before `engine.step()`: the next inner step computes this step's flag anew."""
        self.found = None

    def skipped(self) -> torch.Tensor | None:
        """This step's flag (1.0: not applied), a device scalar; None if no inner step ran."""
        return self.found

    def _guarded_step(self, *args, **kwargs):
        if not self.active:
            return self._step(*args, **kwargs)
        if self.found is None:  # once a step: ZeRO-1/2 step the inner optimizer group by group
            found = self.found = self._nonfinite()
        elif self._norm() is None:  # no global norm (compute_grad_norm off): each group's own
            found = self._nonfinite()
            self.found = torch.maximum(self.found, found)
        else:
            found = self.found
        if self.on_device:
            self.inner.found_inf = found
            try:
                return self._step(*args, **kwargs)
            finally:
                self.inner.found_inf = None
        if bool(found):
            return None
        return self._step(*args, **kwargs)

    def _norm(self):
        return getattr(self.wrapper, "_global_grad_norm", None) if self.wrapper else None

    def _nonfinite(self) -> torch.Tensor:
        """1.0 where this step's global gradient norm is not finite, as a float32 device scalar.
        The wrapper's norm (`_global_grad_norm`, set before its inner step in BF16_Optimizer,
        ZeRO 1-3 and FP16_UnfusedOptimizer: all-reduced, so every rank agrees); without a
        wrapper (ZeRO-0 fp32, whose gradients are all-reduced already) the gradients' own."""
        norm = self._norm()
        device = self._device()
        if norm is None:
            grads = [p.grad for group in self.inner.param_groups for p in group["params"]
                     if p.grad is not None]
            if not grads:
                return torch.zeros((), dtype=torch.float32, device=device)
            norm = torch.stack([n.float() for n in torch._foreach_norm(grads)]).sum()
        if not torch.is_tensor(norm):
            norm = torch.tensor(float(norm), device=device)
        bad = torch.logical_not(torch.isfinite(norm)) | (norm < 0)
        bad = bad.to(device=device, dtype=torch.float32).reshape(())
        if self.wrapper is not None and self._norm() is None:
            bad = _any_rank(bad, self.group)  # partitions, no norm computed: every rank's say
        return bad

    def _device(self) -> torch.device:
        for group in self.inner.param_groups:
            for p in group["params"]:
                return p.device
        return torch.device("cpu")

    def remove(self) -> None:
        self.active = False


def _any_rank(flag: torch.Tensor, group) -> torch.Tensor:
    """The flag's maximum over the data-parallel ranks (one scalar all-reduce)."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return flag


