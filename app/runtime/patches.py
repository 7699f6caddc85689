"""Fixes applied to a DeepSpeed engine after `deepspeed.initialize`, each measured; each is a
patch of the registry (app.runtime.registry: its DeepSpeed targets, the version it was read
against, its test, what would retire it), installed by app.runtime.engine.install_patches.

`skip_lone_allreduce`: ZeRO-0 in a world of one skips a gradient "all-reduce" with itself.
`share_fp32_partitions`: ZeRO-3 in fp32 keeps one copy of each partition, not two.
`local_zero1_reduction`: ZeRO-1's boundary reduction skips its collective, for gradients the
app's reducer (app.runtime.overlap) summed during backward.
`partitioned_bf16_norm`: BF16_Optimizer's gradient norm from reduce-scattered partitions.
`sync_free_steps`: DeepSpeed's optimizer step without host reads of the device, outside fp16.
`bf16_unfused_step`: ZeRO-0 bf16's FP16_UnfusedOptimizer step, the same, re-implemented.
`stream_ordered_epilogue`: ZeRO-2's end of backward waits on a stream, not the host (CUDA).
`local_fp32_clipping`: ZeRO-0 in fp32 clips without a collective per step.
`one_norm_collective`: ZeRO-1/2's gradient norm in one all-reduce, not one per parameter group.
`relink_only_moved`: ZeRO-1/2's step re-points only the weights that no longer view the flat buffer.
None changes a trained value (each docstring says why); each returns what it did. Each takes
`ready(name, obj)`: called once the patch otherwise applies, False where the installed DeepSpeed
lacks an attribute the patch reads (the patch is then left out: DeepSpeed's own path).
"""
from __future__ import annotations

import contextlib
import types
from typing import Any, Callable

import torch

from app.runtime import registry
from app.runtime.islands import model_parallel

Ready = Callable[[str, Any], bool]


def _always(name: str, obj: Any) -> bool:
    return True


def skip_lone_allreduce(engine, ready: Ready = _always) -> bool:
    """ZeRO-0 (and BF16_Optimizer, ZeRO-1 in bf16) in a world of one: no gradient all-reduce.
    DeepSpeed still flattens every gradient into one buffer, multiplies it by 1/1, "all-reduces"
    it alone and copies it back: an identity that cost GPT-2 4 x 256 (5 M parameters, CPU) ~3%
    of its step (docs/benchmarks.md, "bench"); BF16_Optimizer adds its fp32 gradients to its
    buffer before that (engine `_backward_epilogue`), so nothing is lost by skipping it. Returns
    whether it was skipped. ZeRO 1-3 keep their own reduction (it also moves gradients into
    their partitions)."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    stage0 = engine.zero_optimization_stage() == 0 or isinstance(engine.optimizer, BF16_Optimizer)
    if not stage0 or engine.dp_world_size != 1 or getattr(engine, "has_moe_layers", False) \
            or not ready("skip_lone_allreduce", engine):
        return False
    engine.enable_backward_allreduce = False
    return True


def local_fp32_clipping(engine, ready: Ready = _always) -> bool:
    """ZeRO-0 in fp32: DeepSpeed's gradient clipping without its all-reduce of the norm.
    DeepSpeed's `clip_grad_norm_` averages the norm over the data-parallel ranks every step (for
    MoE, whose expert gradients differ by rank): here every rank holds the same all-reduced
    gradients, so the collective sums N equal values to get one back, a latency-bound round trip
    per step across the whole job (on one rank a call with itself: ~0.2-1.8 ms of a bert-tiny CPU
    step, docs/benchmarks.md). The arithmetic is DeepSpeed's, in its order (per-tensor norms, the
    sum of their squares, its root; max_norm / (norm + 1e-6), at most 1), on torch's foreach
    kernels: the same bits on one rank and whenever N is a power of two (its average then
    divides exactly). Returns whether it was applied (not with MoE, model parallelism, a grad
    scaler, or fp16/bf16/ZeRO, which DeepSpeed clips inside its optimizer wrappers)."""
    if (engine.zero_optimization() or engine.bfloat16_enabled() or engine.fp16_enabled()
            or getattr(engine, "has_moe_layers", False) or model_parallel(engine)
            or getattr(engine, "torch_autocast_z0_gradscaler", None) is not None
            or not ready("local_fp32_clipping", engine)):
        return False
    params = [p for p in engine.module.parameters() if p.requires_grad]

    def clip_fp32_gradients():
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return
        total = torch.stack(torch._foreach_norm(grads)).pow(2).sum().float().pow(0.5)
        limit = total.new_full((), float(engine.gradient_clipping()))  # no host-to-device copy
        coef = torch.clamp(limit / (total + 1e-6), max=1.0)
        torch._foreach_mul_(grads, coef)

    engine.clip_fp32_gradients = clip_fp32_gradients
    return True


def share_fp32_partitions(engine, ready: Ready = _always) -> int:
    """ZeRO-3 with fp32 parameters: the optimizer's fp32 partitions become the parameters' own
    partitions instead of a copy of them (4 bytes a parameter less, over the ranks). Returns the
    bytes freed on this rank.

    DeepSpeed skips the fp32 master copy when a partition is fp32 on the device already (its
    autocast case, where the two are aliases), but its test compares `tensor.device` with the
    accelerator's device name, a torch.device with a str, which is never equal in torch 2.x: fp32
    runs kept two identical copies (measured: model state at 2 ranks 0.625x ZeRO-0's instead of
    0.5x; docs/benchmarks.md, "bench"). Equal values, so nothing trained changes; DeepSpeed's
    copy of the master onto the partition after each step becomes a copy onto itself. Offloaded
    optimizers keep their own copies.
    """
    opt = engine.optimizer
    masters = getattr(opt, "fp32_partitioned_groups_flat", None)
    partitions = getattr(opt, "fp16_partitioned_groups_flat", None)
    if not masters or not partitions or getattr(opt, "offload_optimizer", False) \
            or not ready("share_fp32_partitions", opt):
        return 0
    freed = 0
    for master, part in zip(masters, partitions):
        if (part is not None and master.dtype == part.dtype and master.shape == part.shape
                and master.device == part.device and master.numel() > 0
                and master.untyped_storage().data_ptr() != part.untyped_storage().data_ptr()
                and torch.equal(master, part)):
            freed += master.untyped_storage().nbytes()
            master.data = part.data
    return freed


def relink_only_moved(optimizer, ready: Ready = _always) -> bool:
    """DeepSpeedZeroOptimizer (ZeRO-1 in fp32, ZeRO-2) ends every step by pointing each weight's
    `.data` at its slice of the flat bit16 buffer again, twice over (a `narrow` and a `view`, then
    the round-robin order's own assignment; DeepSpeed's comment: "we probably don't need this?
    just to be safe"). The weights view those slices from the start, and the step's all-gather
    writes into the buffer in place, so each of those 2 x N assignments re-creates the view the
    weight already has. On one H200 that loop was a 5.5 ms host gap a step in the profiled
    ZeRO-2 trace of bert-120m (182 weights: docs/benchmarks.md, "GPU: second runs on one H200").
    Here a weight is re-pointed only where it does not view its slice already (same address,
    shape and dtype, contiguous): after a checkpoint load or a buffer rebuilt, the same as
    DeepSpeed's. Nothing trained changes. Returns whether it was installed."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if not isinstance(optimizer, DeepSpeedZeroOptimizer) \
            or not ready("relink_only_moved", optimizer):
        return False
    optimizer._update_model_bit16_weights = types.MethodType(_relink_moved, optimizer)
    return True


def _relink_moved(self, group_index: int) -> None:
    flat = self.bit16_groups_flat[group_index]
    base, size = flat.data_ptr(), flat.element_size()
    for p, meta, offset in zip(self.round_robin_bit16_groups[group_index],
                               self.round_robin_bit16_meta[group_index],
                               self.round_robin_bit16_offsets[group_index]):
        if (p.data_ptr() != base + offset * size or p.shape != meta.shape
                or p.dtype != flat.dtype or not p.is_contiguous()):
            p.data = flat.narrow(0, offset, meta.numel()).view(meta.shape).data
    ordered = self.round_robin_bit16_groups[group_index]
    for index, param in enumerate(self.bit16_groups[group_index]):
        source = ordered[self.round_robin_bit16_indices[group_index][index]]
        if source is not param:
            param.data = source.data


def local_zero1_reduction(optimizer, predivided: bool = False) -> None:
    """ZeRO-1 (DeepSpeedZeroOptimizer, gradients in `param.grad`): its reduction at the boundary
    keeps everything but the collective. The app's reducer has already summed every rank's
    gradient into `param.grad` during backward (its reduce-scatter, PartitionReducer: only the
    slices in this rank's partition, the only ones read here); DeepSpeed then divides by the
    world size, as before its all-reduce, and moves this rank's slice into its partition, now a
    local copy. `predivided`: the reducer divided each rank's gradient before the sum, as
    DeepSpeed does (16-bit wires: the sum of N fp16 gradients overflows N times sooner), so
    nothing is divided here.

    Every gradient collective of ZeRO-1 goes through `allreduce_bucket` (the bucketed
    reduce-scatter path, `reduce_scatter: true`) or `gradient_reduction_w_predivide` (`false`);
    both are replaced on this instance by their bodies without the collective. fp32: sum then
    divide against DeepSpeed's divide then sum, the same bits when the world size is a power of
    two (an exact division), else within an ulp; 16-bit: divide then sum, DeepSpeed's order.
    """
    def allreduce_bucket(self, bucket, communication_data_type, rank=None, log=None,
                         divide=True, process_group=None):
        tensor = self.flatten(bucket)
        reduced = tensor if communication_data_type == tensor.dtype \
            else tensor.to(communication_data_type)
        if divide and self.gradient_average and not predivided:
            reduced.div_(_dp_size(self, process_group))
        if reduced is not tensor:
            tensor.copy_(reduced)
        return reduced

    def gradient_reduction_w_predivide(self, tensor, communication_data_type):
        if tensor.numel() == 0:
            return tensor
        reduced = tensor if communication_data_type == tensor.dtype \
            else tensor.to(communication_data_type)
        if self.gradient_average and not predivided:
            reduced.div_(_dp_size(self, None))
        if reduced is not tensor:
            tensor.copy_(reduced)
        return reduced

    optimizer.allreduce_bucket = types.MethodType(allreduce_bucket, optimizer)
    optimizer.gradient_reduction_w_predivide = types.MethodType(gradient_reduction_w_predivide,
                                                                optimizer)


def partitioned_bf16_norm(optimizer, group) -> None:
    """BF16_Optimizer whose gradients were reduce-scattered (app.runtime.overlap's
    PartitionReducer): only this rank's partition of its fp32 gradients is reduced, so the
    global norm (for clipping and the logs) is taken from the partitions and summed across the
    ranks (one scalar all-reduce) instead of from the whole local buffer, which holds this
    rank's own unreduced gradient outside the partition. DeepSpeed's arithmetic: the norm of
    each parameter's gradient (here of its part in the partition), their squares summed, the
    root; its step takes the norm of what `get_grads_for_norm` returns, here a one-element list
    holding the norm itself. Equal to DeepSpeed's but for the parameters cut by a partition
    boundary and the order of the sum: fp32 norms of multi-million-element gradients round
    differently in parts (bert-tiny at 2 ranks: 5e-6 relative; DeepSpeed's own per-tensor norm
    and the flat buffer's differ by 1e-5 there)."""
    import torch.distributed as dist

    get_grads = optimizer.get_grads_for_norm
    parts = _partition_views(optimizer)

    def get_grads_for_norm(for_clipping=False):
        if for_clipping:
            return get_grads(for_clipping=True)
        norms = [view.norm(2) for view in parts]
        squares = torch.stack(norms).pow(2).sum() if norms else \
            torch.zeros((), device=optimizer.fp32_groups_gradients_flat[0].device)
        dist.all_reduce(squares, group=group)
        return [squares.sqrt().reshape(1)], {}

    optimizer.get_grads_for_norm = get_grads_for_norm


def one_norm_collective(optimizer, ready: Ready = _always) -> bool:
    """DeepSpeedZeroOptimizer (ZeRO-1/2) takes the gradient norm group by group
    (`scaled_global_norm` -> `get_grad_norm_direct`), each with its own blocking all-reduce of
    one scalar: the app's layer blocks make that 16 round trips a step, each waiting for the
    slowest rank (measured on the 2-node netsim at 384 Mbit/s: 19-39 ms of a 330 ms step before
    the optimizer could start). Here every group's local sum of squares is taken first and the
    sums are all-reduced together, once; each group's norm, its inf/NaN mask and their
    combination are then DeepSpeed's. The same arithmetic per group (the sum of squares of
    per-tensor fp32 norms, then its root): the same bits at 2 ranks, where a sum of two does
    not depend on the collective's order. Returns whether it was applied (not with CPU offload,
    MoE, model or pipeline parallelism, or Muon, whose norms DeepSpeed rescales)."""
    import torch.distributed as dist
    from deepspeed.comm import pg_utils
    from deepspeed.runtime.utils import combine_grad_norm_groups
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    from deepspeed.runtime.zero.utils import get_norm_dtype

    if (not isinstance(optimizer, DeepSpeedZeroOptimizer) or optimizer.cpu_offload
            or getattr(optimizer, "has_moe_layers", False)
            or pg_utils.is_parallel(optimizer.model_parallel_group)
            or any(optimizer._muon_update_lacks_loss_scale(i)
                   for i in range(len(optimizer.bit16_groups)))
            or not ready("one_norm_collective", optimizer)):
        return False
    opt = optimizer

    def group_square_sum(i: int) -> torch.Tensor:
        grads = [g for g in opt.averaged_gradients[i] or []
                 if not getattr(g, "_zero_padding", False)]
        norms = [torch.linalg.vector_norm(g.detach().to(get_norm_dtype()), ord=2)
                 for g, p in zip(grads, opt.params_in_partition[i])
                 if not getattr(p, "ds_pipe_replicated", False)]
        if not norms:
            return torch.zeros((), dtype=torch.float32, device=opt.device)
        return torch.stack(norms).pow(2).sum().float()

    def scaled_global_norm(norm_type=2):
        assert norm_type == 2, "only L2 norm supported"
        sums = torch.stack([group_square_sum(i).to(opt.device)
                            for i in range(len(opt.bit16_groups))])
        dist.all_reduce(sums, group=opt.dp_process_group)
        norms = [total.pow(0.5) for total in sums.unbind()]
        for norm in norms:
            _mask_in_place(norm)
        return combine_grad_norm_groups(norms, norm_type=2)

    optimizer.scaled_global_norm = scaled_global_norm
    return True


def _partition_views(optimizer) -> list[torch.Tensor]:
    """Each parameter's part of this rank's partition of BF16_Optimizer's fp32 gradients."""
    views = []
    for i, params in enumerate(optimizer.bf16_groups):
        flat, grads = optimizer.bf16_groups_flat[i], optimizer.fp32_groups_gradients_flat[i]
        part = optimizer.fp32_groups_gradient_flat_partition[i]
        lo = (part.data_ptr() - grads.data_ptr()) // grads.element_size()
        hi = lo + part.numel()
        for p in params:
            start = (p.data_ptr() - flat.data_ptr()) // flat.element_size()
            a, b = max(start, lo), min(start + p.numel(), hi)
            if a < b:
                views.append(grads.narrow(0, a, b - a))
    return views


def _dp_size(optimizer, process_group) -> float:
    import torch.distributed as dist

    group = optimizer.dp_process_group if process_group is None else process_group
    return dist.get_world_size(group=group) / float(optimizer.sequence_parallel_size)


# -- no host sync in a step ----------------------------------------------------------------------
#
# DeepSpeed's optimizer wrappers read the device on the host every step: to skip a step whose
# gradients are not finite (`is_invalid_grad_norm`: `bool(...)`), to clip only when needed (`if
# clip_coef < 1`), and, at ZeRO-0 in bf16, a `float()` of every group's norm and a `bool()` of
# every gradient's inf/NaN check. Each read drains the device's queue. Outside fp16 (whose dynamic
# loss scale must know on the host whether to skip) the wrappers' checks are switched off while an
# app-patched optimizer steps, and the app's step guard (app.runtime.step_guard) skips a step with
# non-finite gradients on the device instead: the norm the wrapper computed is the guard's input,
# and the torch optimizer inside the wrapper does not apply that step.
_SYNC_FREE = {"depth": 0}


@contextlib.contextmanager
def _sync_free():
    _SYNC_FREE["depth"] += 1
    try:
        yield
    finally:
        _SYNC_FREE["depth"] -= 1


def _unless_sync_free(checked):
    """`is_invalid_grad_norm` for DeepSpeed's modules: False inside an app-patched step (the
    step guard skips it on the device), DeepSpeed's own check elsewhere (fp16)."""
    def is_invalid_grad_norm(norm):
        return False if _SYNC_FREE["depth"] else checked(norm)
    return is_invalid_grad_norm


def _clip_without_reading(clip):
    """`clip_tensors_by_global_norm` of BF16_Optimizer inside an app-patched step: the same
    coefficient `max_norm / (norm + eps)`, applied as min(coefficient, 1) on the device with one
    foreach multiply, where DeepSpeed reads `clip_coef < 1` on the host and then multiplies tensor
    by tensor (x * 1.0 is x: the values are DeepSpeed's). A non-finite norm arrives masked to -1;
    the coefficient is kept at 0 or more, so that mask never flips the gradients' signs (the step
    guard skips that step anyway)."""
    def clip_tensors_by_global_norm(input_tensors, max_norm=1.0, global_norm=None, mpu=None,
                                    eps=1e-6):
        if not _SYNC_FREE["depth"] or global_norm is None or not torch.is_tensor(global_norm):
            return clip(input_tensors, max_norm=max_norm, global_norm=global_norm, mpu=mpu,
                        eps=eps)
        coef = torch.clamp(max_norm / (global_norm + eps), min=0.0, max=1.0)
        tensors = [t.detach() for t in input_tensors]
        if tensors:
            torch._foreach_mul_(tensors, coef)  # as DeepSpeed's mul_ by the fp32 coefficient
        return global_norm
    return clip_tensors_by_global_norm


def _mask_in_place(input, device=None, val=-1.):
    """DeepSpeed's `mask_nan_or_inf_with_val_inplace` with the value as a kernel argument: its
    `torch.tensor(-1.0, device=...)` is a blocking copy from host memory, which waits for the
    device's queue on CUDA. The same values."""
    input.masked_fill_(input.isnan().logical_or(input.isinf()), val)


def _install_sync_free(engine) -> None:
    """Swap the module-level helpers DeepSpeed's optimizers call, for as long as `engine` lives
    (app.runtime.registry.swap: undone with the last engine that needs them). Outside an
    app-patched step they behave as DeepSpeed's own."""
    from deepspeed.runtime import bf16_optimizer, utils
    from deepspeed.runtime.zero import stage3, stage_1_and_2

    for module in (bf16_optimizer, stage_1_and_2, stage3):
        registry.swap(module, "is_invalid_grad_norm", _unless_sync_free, owner=engine)
    registry.swap(bf16_optimizer, "clip_tensors_by_global_norm", _clip_without_reading,
                  owner=engine)
    for module in (utils, stage_1_and_2, stage3):
        registry.swap(module, "mask_nan_or_inf_with_val_inplace", lambda _: _mask_in_place,
                      owner=engine)


def _keeps_host_checks(engine) -> bool:
    """fp16 (dynamic loss scaling skips steps on the host's word), model or expert parallelism
    (their norms are summed through the host here and there)."""
    return engine.fp16_enabled() or model_parallel(engine) \
        or getattr(engine, "has_moe_layers", False)


def sync_free_steps(engine, ready: Ready = _always) -> str | None:
    """Make the optimizer's step free of host reads (above); returns what was done, None where
    DeepSpeed's checks stay: fp16, model or expert parallelism, a ds_config that asks for
    `bf16.check_grad_overflow` at ZeRO-2 (the one optimizer of DeepSpeed's that reads it),
    ZeRO-1/2 without a gradient norm (`compute_grad_norm: false`), and optimizers not listed
    below (ZeRO-0 bf16's FP16_UnfusedOptimizer: `bf16_unfused_step`)."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    opt = engine.optimizer
    if _keeps_host_checks(engine):
        return None
    if isinstance(opt, DeepSpeedZeroOptimizer) and (getattr(opt, "check_grad_overflow", True)
                                                    or not getattr(opt, "compute_grad_norm",
                                                                   False)):
        return None  # fp32 leaves it off; bf16 at ZeRO-2: off unless the file turned it on
    if not isinstance(opt, (BF16_Optimizer, DeepSpeedZeroOptimizer,
                            DeepSpeedZeroOptimizer_Stage3)) or not ready("sync_free_steps", opt):
        return None
    _install_sync_free(engine)
    if isinstance(opt, DeepSpeedZeroOptimizer):
        opt.check_grad_overflow = False  # ZeRO-2 bf16: has_overflow's .item()
    step = opt.step

    def sync_free_step(*args, **kwargs):
        with _sync_free():
            return step(*args, **kwargs)

    opt.step = sync_free_step
    return f"{type(opt).__name__} step without host reads (non-finite steps skipped on the " \
           f"device: app.runtime.step_guard)"


def bf16_unfused_step(engine, ready: Ready = _always) -> str | None:
    """ZeRO-0 in bf16 (FP16_UnfusedOptimizer): its step replaced by `_bf16_unfused_step`, the
    same arithmetic without host reads; None elsewhere."""
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    opt = engine.optimizer
    if _keeps_host_checks(engine) or not isinstance(opt, FP16_UnfusedOptimizer) \
            or not ready("bf16_unfused_step", opt) or opt.fused_lamb_legacy:
        return None
    opt.step = types.MethodType(_bf16_unfused_step, opt)
    return "bf16 step without host reads (non-finite steps skipped on the device: " \
           "app.runtime.step_guard)"


@torch.no_grad()
def _bf16_unfused_step(self, closure=None):
    """FP16_UnfusedOptimizer.step (DeepSpeed's ZeRO-0 wrapper in bf16: no loss scale) with its
    arithmetic on the device: the group norms are DeepSpeed's (fp32 sum of squared gradient norms,
    square root in double), combined in double, and the clip multiplier is applied whether or not
    it clips (x * 1.0 is x), so the values are DeepSpeed's, without its per-gradient `bool()`
    overflow check and `float()` of each norm. A non-finite norm: the step guard skips the torch
    optimizer's step on the device (app.runtime.step_guard), as DeepSpeed's check would."""
    total = None
    for lp_group, fp32_group in zip(self.fp16_groups, self.fp32_groups):
        grads = [p.grad for p in lp_group if p.grad is not None]
        if grads:
            squares = 0.
            for g in grads:
                squares = squares + g.data.float().norm(2) ** 2
            group = squares.double() ** 0.5
            total = group ** 2.0 if total is None else total + group ** 2.0
        for fp32_param, lp in zip(fp32_group, lp_group):
            fp32_param.grad = torch.zeros(lp.size(), dtype=fp32_param.dtype,
                                          device=fp32_param.device) if lp.grad is None \
                else lp.grad.to(fp32_param.dtype)
    norm = total.sqrt() if total is not None else torch.zeros((), dtype=torch.float64)
    self._global_grad_norm = norm
    self._update_scale(False)
    scale = self.loss_scale_config.cur_scale
    if self.clip_grad > 0.:
        clip = (norm / scale + 1e-6) / self.clip_grad
        combined = torch.where(clip > 1, clip * scale, torch.full_like(clip, scale))
        grads = [p.grad for group in self.fp32_groups for p in group if p.grad is not None]
        torch._foreach_mul_(grads, (1. / combined).to(torch.float32))
    elif scale != 1.0:
        for group in self.fp32_groups:
            for p in group:
                if p.grad is not None:
                    p.grad.data.mul_(1. / scale)
    self.optimizer.step()
    for fp32_group, lp_group in zip(self.fp32_groups, self.fp16_groups):
        for fp32_param, lp in zip(fp32_group, lp_group):
            fp32_param.grad = None
            lp.data.copy_(fp32_param.data)
    return self.overflow


def stream_ordered_epilogue(opt, ready: Ready = _always) -> bool:
    """ZeRO-1/2 with `overlap_comm` on a device with streams (CUDA): the end of each backward
    waits for the reduction stream in the compute stream instead of the host waiting for the
    whole device.

    DeepSpeed's `independent_gradient_partition_epilogue` (and the `allreduce_and_copy` it may
    call) runs `get_accelerator().synchronize()` before it drops the gradients the reduction
    stream has read ("safe to clear"), then goes on with compute-stream work that reads the
    reduced gradients. What must come after the reduction is device work: the compute stream's
    later kernels (reading the reduced partition; reusing, through the caching allocator, the
    blocks of the dropped gradients, which were allocated on the compute stream) and the
    reduction stream's own later work. `current_stream().wait_stream(reduction_stream)` orders
    all of it after the reduction queued so far, as the device sync did, without the host
    waiting. Not with an offloaded optimizer (the host then reads what the reduction wrote) nor
    where the accelerator orders streams itself (the CPU: no sync is made there). Returns
    whether the epilogue was changed."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    accel = get_accelerator()
    if (not isinstance(opt, DeepSpeedZeroOptimizer) or accel.resolves_data_dependency()
            or not ready("stream_ordered_epilogue", opt)):
        return False
    stream = getattr(opt, "reduction_stream", None)
    if not opt.overlap_comm or opt.cpu_offload or stream is None:
        return False
    epilogue = opt.independent_gradient_partition_epilogue

    def independent_gradient_partition_epilogue(*args, **kwargs):
        had = "synchronize" in vars(accel)
        before = vars(accel).get("synchronize")
        accel.synchronize = lambda device_index=None: accel.current_stream().wait_stream(stream)
        try:
            return epilogue(*args, **kwargs)
        finally:
            if had:
                accel.synchronize = before
            else:
                del accel.synchronize

    opt.independent_gradient_partition_epilogue = independent_gradient_partition_epilogue
    return True
